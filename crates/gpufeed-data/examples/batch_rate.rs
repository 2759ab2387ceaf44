//! The batch loader's rate over fixed-size records of one file (or a folder of files): the
//! time `BatchLoader::new` took (with `gpu_gather`, mapping and registering), then epoch by
//! epoch: GB/s, batches/s, cores busy, the consumer's share of time waiting
//! (`LoaderStats::waited_s`) and the part of it spent waiting for copies to the GPU
//! (`copy_waited_s`), its time dropping each batch, and the workers' time issuing each upload.
//!
//! ```text
//! cargo run --release -p gpufeed-data --example batch_rate -- PATH GIB SPEC...
//! ```
//! PATH is a record file (made of GIB GiB of pseudo-random bytes where it is missing or of
//! another size) or a folder (read as an `ImageFolder`, GIB ignored); each SPEC is
//! `record_kib,workers,prefetch,epochs[,gpu]` (gpu 1, the default: device batches on GPU 0;
//! 0: host batches; 2: device batches gathered by the GPU, `BatchLoaderOptions::gpu_gather`).
//! Batches of 256, shuffled; one untimed epoch, then EPOCHS. GPU run 198
//! (docs/benchmarks.md) ran its first form (the same loader and settings, without the
//! waited, drop and upload columns) with `/dev/shm/rec.bin 4 4,8,16,3 4,16,32,3 64,8,16,3
//! 64,16,32,3` and with `/dev/shm/imgs 0 0,8,16,3 0,16,32,3`, built at 5922380 and at
//! 895e479.

use std::io::Write;
use std::time::Instant;

use gpufeed_data::{
    BatchLoader, BatchLoaderOptions, Dataset, ImageFolder, Order, RecordFile, Sampler,
};

/// User plus system CPU seconds of this process so far (`/proc/self/stat` counts clock ticks
/// of USER_HZ, 100 a second in Linux's ABI).
fn cpu_secs() -> Result<f64, Box<dyn std::error::Error>> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let rest = &stat[stat.rfind(')').ok_or("no ) in /proc/self/stat")? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    Ok((fields[11].parse::<f64>()? + fields[12].parse::<f64>()?) / 100.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        return Err("usage: batch_rate PATH GIB SPEC... (see the example's docs)".into());
    }
    let path = std::path::PathBuf::from(&args[1]);
    let gib: u64 = args[2].parse()?;
    let is_dir = path.is_dir();
    if !is_dir && std::fs::metadata(&path).map_or(0, |m| m.len()) != gib << 30 {
        let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&path)?);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut buf = vec![0u8; 8 << 20];
        for _ in 0..(gib << 30) / (8 << 20) {
            for c in buf.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes());
            }
            f.write_all(&buf)?;
        }
        f.flush()?;
    }
    let gpu = gpufeed_cuda::Gpu::open(0).ok();
    for spec in &args[3..] {
        let v: Vec<usize> = spec.split(',').map(str::parse).collect::<Result<_, _>>()?;
        let [rec_kib, workers, prefetch, epochs, ..] = v[..] else {
            return Err(format!("{spec}: give record_kib,workers,prefetch,epochs[,gpu]").into());
        };
        let on_gpu = v.get(4).is_none_or(|&g| g >= 1);
        let gpu_gather = v.get(4) == Some(&2);
        let records: Dataset = if is_dir {
            ImageFolder::open(&path)?.into()
        } else {
            // SAFETY: the file is not changed while it is mapped.
            unsafe { RecordFile::open_fixed(&path, rec_kib << 10)? }.into()
        };
        let cfg = BatchLoaderOptions::default()
            .with_batch_size(256)
            .with_drop_last(true)
            .with_prefetch(prefetch)
            .with_workers(workers)
            .with_gpu_gather(gpu_gather);
        let device = match (on_gpu, &gpu) {
            (true, Some(g)) => Some(g),
            (true, None) => return Err(format!("{spec}: device batches need GPU 0").into()),
            (false, _) => None,
        };
        let sampler = Sampler::new(Order::Shuffled { seed: 1 });
        let made = Instant::now();
        let mut loader = BatchLoader::new(records, sampler, cfg, device)?;
        let mut rates = vec![format!(
            "made in {:.0} ms",
            made.elapsed().as_secs_f64() * 1e3
        )];
        for epoch in 0..=epochs as u64 {
            let (waited0, copy0, upload0) = (
                loader.stats().waited_s,
                loader.stats().copy_waited_s,
                loader.stats().upload_s,
            );
            let (cpu0, t0) = (cpu_secs()?, Instant::now());
            let (mut bytes, mut batches, mut drop_s) = (0u64, 0u64, 0.0);
            for batch in loader.epoch(epoch)? {
                let batch = batch?;
                bytes += batch.bytes() as u64;
                batches += 1;
                let t = Instant::now();
                drop(batch);
                drop_s += t.elapsed().as_secs_f64();
            }
            let secs = t0.elapsed().as_secs_f64();
            if epoch > 0 {
                let stats = loader.stats();
                rates.push(format!(
                    "{:.1} GB/s {:.0} b/s {:.1} cores, waited {:.0}% (copies {:.0}%) drop {:.1}us upload {:.1}us/b",
                    bytes as f64 / secs / 1e9,
                    batches as f64 / secs,
                    (cpu_secs()? - cpu0) / secs,
                    100.0 * (stats.waited_s - waited0) / secs,
                    100.0 * (stats.copy_waited_s - copy0) / secs,
                    1e6 * drop_s / batches as f64,
                    1e6 * (stats.upload_s - upload0) / batches as f64
                ));
            }
        }
        println!("{spec}: {}", rates.join(" | "));
    }
    Ok(())
}
