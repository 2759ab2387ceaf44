//! Device batches on a GPU: a dropped batch's memory carries a later batch of its length
//! (`DeviceBatch`), no batch still held is ever written over, and a copy still reading a
//! dropped batch on another stream reads it before the loader writes it again. Every batch's
//! bytes are checked against the file, records of an odd size, a smaller last batch.

use gpufeed_cuda::cudarc::driver::DevicePtr;
use gpufeed_data::{
    Batch, BatchData, BatchLoader, BatchLoaderOptions, DeviceBatch, Order, RecordFile, Sampler,
};
use gpufeed_load::Gpu;

use crate::{gpu_or_skip, random_bytes};

/// 1,000 records of 4,093 bytes: batches of 64 leave a last one of 40.
const RECORD: usize = 4093;
const RECORDS: usize = 1000;
const BATCH: usize = 64;

/// A file of random records (`seed`) in a new folder, its bytes, and a loader of it.
fn records(gpu: &Gpu, seed: u64) -> (tempfile::TempDir, Vec<u8>, BatchLoader) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("records.bin");
    let data = random_bytes(RECORD * RECORDS, seed);
    std::fs::write(&path, &data).expect("write");
    // SAFETY: the file is private to the test and not changed while mapped.
    let records = unsafe { RecordFile::open_fixed(&path, RECORD) }.expect("records");
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(BATCH)
        .with_workers(3)
        .with_prefetch(4);
    let loader = BatchLoader::new(
        records,
        Sampler::new(Order::Shuffled { seed: 5 }),
        cfg,
        Some(gpu),
    )
    .expect("loader");
    (dir, data, loader)
}

/// The bytes a batch of `indices` must hold.
fn expected(data: &[u8], indices: &[usize]) -> Vec<u8> {
    indices
        .iter()
        .flat_map(|&i| data[i * RECORD..(i + 1) * RECORD].iter().copied())
        .collect()
}

fn device(data: &BatchData) -> &DeviceBatch {
    match data {
        BatchData::Device(d) => d,
        BatchData::Host(_) => panic!("a loader with a GPU hands out device batches"),
    }
}

fn device_bytes(gpu: &Gpu, data: &BatchData) -> Vec<u8> {
    gpu.to_vec(device(data)).expect("copy back")
}

/// Asserts that batch `b` holds its records' bytes (`when` names it in the failure).
fn assert_right(gpu: &Gpu, data: &[u8], b: &Batch, when: &str) {
    assert!(
        device_bytes(gpu, &b.data) == expected(data, &b.indices),
        "{when}: batch {} holds other bytes",
        b.number
    );
}

fn address(gpu: &Gpu, data: &BatchData) -> u64 {
    let stream = gpu.default_stream();
    device(data).device_ptr(&stream).0
}

#[test]
fn dropped_batches_memory_carries_later_batches_and_held_ones_stay_intact() {
    let Some(gpu) =
        gpu_or_skip("dropped_batches_memory_carries_later_batches_and_held_ones_stay_intact")
    else {
        return;
    };
    let (_dir, data, mut loader) = records(&gpu, 71);

    // Epoch 0: each batch checked and dropped at once, except batch 3, held as it is, and
    // batch 5, kept for good.
    let (mut held, mut kept) = (None, None);
    let mut batches = 0;
    for b in loader.epoch(0).expect("epoch") {
        let b = b.expect("batch");
        assert_right(&gpu, &data, &b, "epoch 0");
        batches += 1;
        match b.number {
            3 => held = Some(b),
            5 => {
                let BatchData::Device(d) = b.data else {
                    unreachable!()
                };
                kept = Some((b.indices, d.into_buffer()));
            }
            _ => {}
        }
    }
    assert_eq!(batches, RECORDS.div_ceil(BATCH));
    let reused = loader.stats().kept_memory_batches;
    assert!(
        reused > 0,
        "no batch was copied into the memory of one dropped before"
    );
    // Every batch's copy was waited for, and that wait is a part of the consumer's.
    let stats = loader.stats();
    assert!(
        stats.copy_waited_s > 0.0 && stats.copy_waited_s <= stats.waited_s,
        "{stats:?}"
    );

    // Epoch 1: its first half dropped as it comes (their memory carries later batches), its
    // second half held: none of those may be written over.
    let mut all_held = Vec::new();
    for b in loader.epoch(1).expect("epoch") {
        let b = b.expect("batch");
        assert_right(&gpu, &data, &b, "epoch 1");
        if b.number >= 8 {
            all_held.push(b);
        }
    }
    assert!(loader.stats().kept_memory_batches > reused);
    let mut addresses: Vec<u64> = all_held.iter().map(|b| address(&gpu, &b.data)).collect();
    addresses.sort_unstable();
    addresses.dedup();
    assert_eq!(
        addresses.len(),
        all_held.len(),
        "two held batches share memory"
    );
    for b in &all_held {
        assert_right(&gpu, &data, b, "epoch 1, held to the epoch's end");
    }
    let held = held.expect("batch 3");
    assert_right(
        &gpu,
        &data,
        &held,
        "a batch held through a later epoch was written over",
    );
    drop(all_held); // more than the loader keeps: the rest is freed

    // Epoch 2 after all that was given back, then the loader is dropped: the batch kept for
    // good outlives it.
    for b in loader.epoch(2).expect("epoch") {
        assert_right(&gpu, &data, &b.expect("batch"), "epoch 2");
    }
    drop(loader);
    drop(held); // given back to no loader: freed
    let (indices, buffer) = kept.expect("batch 5");
    assert_eq!(
        gpu.to_vec(&buffer).expect("copy back"),
        expected(&data, &indices),
        "a batch taken with into_buffer was written over"
    );
}

/// A dropped batch's memory is written again only after the copy that still reads it on
/// another stream (queued behind a long memset there): cudarc's read event, which the next
/// upload into that memory waits for. Then an epoch dropped half way, and the next one whole.
#[test]
fn a_copy_still_reading_a_dropped_batch_reads_its_bytes() {
    let Some(gpu) = gpu_or_skip("a_copy_still_reading_a_dropped_batch_reads_its_bytes") else {
        return;
    };
    let (_dir, data, mut loader) = records(&gpu, 72);
    let ctx = gpu.context();
    let other = ctx.new_stream().expect("stream");
    let mut delay = other.alloc_zeros::<u8>(1 << 30).expect("1 GiB");
    let len = BATCH * RECORD;
    // SAFETY: written by the copy below before it is read (after the stream's sync).
    let mut host = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }.expect("pinned");
    let mut read = None;
    for b in loader.epoch(0).expect("epoch") {
        let b = b.expect("batch");
        if b.number == 2 {
            // Tens of milliseconds of memsets first: the loader's later uploads, into this
            // batch's memory among others, are issued meanwhile.
            for _ in 0..40 {
                other.memset_zeros(&mut delay).expect("memset");
            }
            other
                .memcpy_dtoh(device(&b.data), &mut host)
                .expect("queue the read");
            read = Some(b.indices.clone());
        } else if b.number > 2 {
            assert_right(&gpu, &data, &b, "epoch 0");
        }
        // Every batch dropped at once, the one being read included.
    }
    assert!(loader.stats().kept_memory_batches > 0);
    other.synchronize().expect("sync");
    assert!(
        host.as_slice().expect("host") == &expected(&data, &read.expect("batch 2"))[..],
        "the loader wrote a dropped batch's memory before a queued copy had read it"
    );

    // An epoch dropped after three batches (the rest prepared, never handed out), then the
    // next one whole.
    let mut epoch = loader.epoch(1).expect("epoch");
    for _ in 0..3 {
        let b = epoch.next().expect("a batch").expect("batch");
        assert_right(&gpu, &data, &b, "epoch 1, dropped half way");
    }
    drop(epoch);
    let mut n = 0;
    for b in loader.epoch(2).expect("epoch") {
        assert_right(
            &gpu,
            &data,
            &b.expect("batch"),
            "epoch 2, after one dropped half way",
        );
        n += 1;
    }
    assert_eq!(n, RECORDS.div_ceil(BATCH));
}
