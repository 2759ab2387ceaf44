//! On a GPU: every strategy x warm/cold x sizes, ranges, existing buffers, safetensors with
//! every dtype, sharded checkpoints, and the device batch loader over several epochs.

use std::collections::HashMap;

use gpufeed::dataset::{BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
use gpufeed::load::Error;
use gpufeed::safetensors::Error as CkptError;
use gpufeed::{LoadOptions, Loader, Refused, Strategy};
use safetensors::Dtype;
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, random_bytes};

#[test]
fn every_strategy_warm_and_cold_is_byte_exact() {
    let Some(gpu) = gpu_or_skip("every_strategy_warm_and_cold_is_byte_exact") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let sizes = [0usize, 1, 4097, (16 << 20) + 1, (300 << 20) + 7];
    for (k, &size) in sizes.iter().enumerate() {
        let path = dir.path().join(format!("f{k}.bin"));
        let data = random_bytes(size, k as u64);
        std::fs::write(&path, &data).expect("write");
        for strategy in [
            Strategy::Auto,
            Strategy::Registered,
            Strategy::Staged,
            Strategy::Direct,
        ] {
            let mut opts = LoadOptions::default().with_strategy(strategy);
            opts.register_chunk_bytes = 64 << 20;
            let loader = Loader::new(&gpu, opts).expect("loader");
            for cold in [false, true] {
                if cold {
                    gpufeed::os::cache::evict(&path).expect("evict");
                } else {
                    gpufeed::os::cache::warm(&path).expect("warm");
                }
                let (buf, report) = loader
                    .load_file(&path)
                    .unwrap_or_else(|e| panic!("{size} B {strategy} cold={cold}: {e}"));
                assert_eq!(buf.len(), size);
                assert_eq!(report.bytes, size as u64);
                if size > 0 {
                    let back = gpu.to_vec(&buf).expect("copy back");
                    assert_eq!(
                        xxh3_64(&back),
                        xxh3_64(&data),
                        "{size} B {strategy} cold={cold}: bytes differ"
                    );
                    let refused = report
                        .fallbacks
                        .iter()
                        .any(|f| f.refused == Refused::HostRegistration);
                    if refused {
                        // A platform that refuses registration stages, and says so.
                        assert_eq!(report.strategy, Strategy::Staged, "{report:?}");
                    } else if strategy != Strategy::Auto {
                        assert_eq!(report.strategy, strategy, "{report:?}");
                    } else {
                        assert_ne!(report.strategy, Strategy::Auto);
                        assert!(!report.reason.is_empty());
                    }
                }
            }
        }
    }
}

#[test]
fn ranges_existing_buffers_and_errors() {
    let Some(gpu) = gpu_or_skip("ranges_existing_buffers_and_errors") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("r.bin");
    let data = random_bytes((40 << 20) + 13, 77);
    std::fs::write(&path, &data).expect("write");
    for strategy in [Strategy::Registered, Strategy::Staged, Strategy::Direct] {
        let loader =
            Loader::new(&gpu, LoadOptions::default().with_strategy(strategy)).expect("loader");
        let (buf, _) = loader
            .load_range(&path, 4099..(33 << 20) + 5)
            .expect("range");
        assert_eq!(
            xxh3_64(&gpu.to_vec(&buf).expect("back")),
            xxh3_64(&data[4099..(33 << 20) + 5]),
            "{strategy}"
        );
        let mut dst = gpu.alloc_zeroed(1 << 20).expect("alloc");
        loader
            .load_into(&path, 100..300_100, &mut dst, 7)
            .expect("into");
        let back = gpu.to_vec(&dst).expect("back");
        assert!(back[..7].iter().all(|&b| b == 0));
        assert_eq!(&back[7..300_007], &data[100..300_100], "{strategy}");
        let mut small = gpu.alloc_zeroed(10).expect("alloc");
        assert!(
            loader.load_into(&path, 0..11, &mut small, 0).is_err(),
            "destination too small"
        );
        let err = loader
            .load_range(&path, 0..data.len() as u64 + 1)
            .unwrap_err();
        assert!(
            matches!(err, Error::Os(gpufeed::os::Error::RangePastEof { .. })),
            "{err:?}"
        );
        let err = loader.load_file(dir.path().join("missing")).unwrap_err();
        assert!(
            matches!(err, Error::Os(gpufeed::os::Error::NotFound { .. })),
            "{err:?}"
        );
        assert!(matches!(
            loader.load_file(dir.path()),
            Err(Error::Os(gpufeed::os::Error::IsDirectory { .. }))
        ));
    }
}

fn tensor_bytes(dtype: Dtype, elems: usize, seed: u64) -> Vec<u8> {
    random_bytes((elems * dtype.bitsize()).div_ceil(8), seed)
}

#[test]
fn safetensors_with_every_dtype_and_shards() {
    let Some(gpu) = gpu_or_skip("safetensors_with_every_dtype_and_shards") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let dtypes = [
        Dtype::BOOL,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];
    let mut want: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = HashMap::new();
    for (i, &dtype) in dtypes.iter().enumerate() {
        let shape = vec![3 + i, 7];
        want.insert(
            format!("layer{i}.weight"),
            (
                dtype,
                shape.clone(),
                tensor_bytes(dtype, shape.iter().product(), i as u64),
            ),
        );
    }
    let write = |path: &std::path::Path, names: &[&String]| {
        let views: Vec<_> = names
            .iter()
            .map(|n| {
                let (d, s, b) = &want[*n];
                (
                    (*n).clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).expect("serialize");
    };
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    let single = dir.path().join("model.safetensors");
    write(&single, &names);
    let ckpt = gpufeed::safetensors::load(&gpu, &single).expect("load");
    assert_eq!(ckpt.len(), dtypes.len());
    let check = |ckpt: &gpufeed::safetensors::Checkpoint| {
        for (name, (dtype, shape, bytes)) in &want {
            let (info, view) = ckpt.get(name).unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!((&info.dtype, &info.shape), (dtype, shape), "{name}");
            let mut host = vec![0u8; view.len()];
            gpu.default_stream()
                .memcpy_dtoh(&view, &mut host)
                .expect("copy back");
            assert_eq!(&host, bytes, "{name}: bytes on the GPU differ");
        }
    };
    check(&ckpt);
    // Sharded: two files and an index.
    let (a, b) = names.split_at(names.len() / 2);
    write(&dir.path().join("model-00001-of-00002.safetensors"), a);
    write(&dir.path().join("model-00002-of-00002.safetensors"), b);
    let mut map = serde_json::Map::new();
    for n in a {
        map.insert((*n).clone(), "model-00001-of-00002.safetensors".into());
    }
    for n in b {
        map.insert((*n).clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(&index, serde_json::json!({ "weight_map": map }).to_string()).expect("index");
    let sharded = gpufeed::safetensors::load(&gpu, &index).expect("sharded");
    assert_eq!(sharded.files().len(), 2);
    check(&sharded);
    // The one-shot path: the GPU opened on another thread while the headers are read.
    for path in [&single, &index] {
        let (ckpt, report) = gpufeed::safetensors::load_on(0, path).expect("load_on");
        check(&ckpt);
        assert_eq!(report.bytes, ckpt.bytes());
        assert_eq!(report.loads.len(), ckpt.files().len());
        assert!(report.context_seconds > 0.0 && report.total_seconds >= report.ready_seconds);
        assert!(report.staging_bytes > 0, "{report:?}");
    }
    // Tensor by tensor, on demand, from files registered once.
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    for path in [&single, &index] {
        let lazy = gpufeed::safetensors::OnDemand::open(&loader, path).expect("on demand");
        assert_eq!(lazy.len(), want.len());
        for (name, (dtype, shape, bytes)) in &want {
            let (buf, info) = lazy.load(&loader, name).expect("tensor");
            assert_eq!((&info.dtype, &info.shape), (dtype, shape), "{name}");
            assert_eq!(&gpu.to_vec(&buf).expect("back"), bytes, "{name} on demand");
        }
        let missing = lazy
            .load(&loader, "no.such.tensor")
            .expect_err("unknown name");
        assert!(missing.to_string().contains("no.such.tensor"), "{missing}");
    }
    // An index naming a tensor its shard lacks.
    map.insert("ghost".into(), "model-00001-of-00002.safetensors".into());
    std::fs::write(&index, serde_json::json!({ "weight_map": map }).to_string()).expect("index");
    assert!(matches!(
        gpufeed::safetensors::load(&gpu, &index),
        Err(CkptError::Index { .. })
    ));
    // A truncated file.
    let bytes = std::fs::read(&single).expect("read");
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).expect("write");
    assert!(matches!(
        gpufeed::safetensors::load(&gpu, &cut),
        Err(CkptError::Safetensors { .. })
    ));
}

#[test]
fn device_batches_over_several_epochs() {
    let Some(gpu) = gpu_or_skip("device_batches_over_several_epochs") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("records.bin");
    let data = random_bytes(5000 * 4099, 3);
    std::fs::write(&path, &data).expect("write");
    // SAFETY: private file, never changed.
    let records = unsafe { RecordFile::open_fixed(&path, 4099) }.expect("records");
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(96)
        .with_drop_last(false)
        .with_prefetch(2)
        .with_workers(4);
    let mut loader = BatchLoader::new(
        records,
        Sampler::new(Order::Shuffled { seed: 5 }),
        cfg,
        Some(&gpu),
    )
    .expect("loader");
    for epoch in 0..3 {
        let mut count = 0;
        for batch in loader.epoch(epoch).expect("epoch") {
            let batch = batch.expect("batch");
            let BatchData::Device(dev) = &batch.data else {
                panic!("host batch on a GPU loader")
            };
            let back = gpu.to_vec(dev).expect("back");
            let want: Vec<u8> = batch
                .indices
                .iter()
                .flat_map(|&i| data[i * 4099..(i + 1) * 4099].iter().copied())
                .collect();
            assert_eq!(
                xxh3_64(&back),
                xxh3_64(&want),
                "epoch {epoch} batch {}",
                batch.number
            );
            count += batch.indices.len();
        }
        assert_eq!(count, 5000);
    }
    eprintln!("{:?}", loader.stats());
}

#[test]
fn registered_loads_clean_up_in_the_background_and_can_be_waited_for() {
    let Some(gpu) =
        gpu_or_skip("registered_loads_clean_up_in_the_background_and_can_be_waited_for")
    else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("c.bin");
    let data = random_bytes((20 << 20) + 3, 5);
    std::fs::write(&path, &data).expect("write");
    gpufeed::os::cache::warm(&path).expect("warm");
    let with = |strategy| {
        Loader::new(&gpu, LoadOptions::default().with_strategy(strategy)).expect("loader")
    };
    let registered = with(Strategy::Registered);
    let mut expected = 0;
    for _ in 0..2 {
        let (buf, report) = registered.load_file(&path).expect("load");
        assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), xxh3_64(&data));
        // A platform that refuses registration stages instead: nothing to undo then.
        if report.strategy == Strategy::Registered && report.fallbacks.is_empty() {
            expected += 1;
        }
    }
    assert_eq!(registered.wait_for_cleanup(), expected);
    assert_eq!(registered.wait_for_cleanup(), 0, "nothing left");
    let staged = with(Strategy::Staged);
    drop(staged.load_file(&path).expect("staged load"));
    assert_eq!(
        staged.wait_for_cleanup(),
        0,
        "staged loads register nothing"
    );
}

/// Paths that are not regular files of a real file system are refused with a clear error by
/// every strategy (before, `/proc/self/status` loaded as 0 bytes).
#[test]
fn pseudo_files_fifos_and_devices_are_refused() {
    let Some(gpu) = gpu_or_skip("pseudo_files_fifos_and_devices_are_refused") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let fifo = dir.path().join("fifo");
    gpufeed_testkit::mkfifo(&fifo);
    for strategy in [Strategy::Auto, Strategy::Registered, Strategy::Staged] {
        let loader =
            Loader::new(&gpu, LoadOptions::default().with_strategy(strategy)).expect("loader");
        let err = loader.load_file("/proc/self/status").unwrap_err();
        assert!(
            matches!(err, Error::Os(gpufeed::os::Error::PseudoFile { .. })),
            "{strategy}: {err:?}"
        );
        for p in [fifo.as_path(), std::path::Path::new("/dev/zero")] {
            let err = loader.load_file(p).unwrap_err();
            assert!(
                matches!(err, Error::Os(gpufeed::os::Error::NotRegularFile { .. })),
                "{strategy} {}: {err:?}",
                p.display()
            );
        }
    }
    let err = gpufeed::safetensors::load(&gpu, "/proc/self/status").unwrap_err();
    assert!(
        matches!(
            err,
            CkptError::Load(Error::Os(gpufeed::os::Error::PseudoFile { .. }))
        ),
        "{err:?}"
    );
}

/// A writer atomically replaces a checkpoint again and again (rename over it, as
/// `torch.save` to a temporary file + rename does) while it is loaded: every load gives
/// exactly one version's tensors or an error naming the file; never one version's header with
/// the other's bytes.
#[test]
fn a_checkpoint_replaced_during_loads_never_yields_mixed_tensors() {
    let Some(gpu) = gpu_or_skip("a_checkpoint_replaced_during_loads_never_yields_mixed_tensors")
    else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("model.safetensors");
    // Two versions with the same tensor names but different shapes and bytes.
    let versions: Vec<(Vec<u8>, Vec<u8>)> = [(3usize << 20, 1u64), ((5 << 20) + 4, 2)]
        .iter()
        .map(|&(len, seed)| {
            let a = random_bytes(len, seed);
            let b = random_bytes(len / 2 + 4, seed + 10);
            let views = [
                (
                    "a",
                    safetensors::tensor::TensorView::new(Dtype::U8, vec![a.len()], &a)
                        .expect("view"),
                ),
                (
                    "b",
                    safetensors::tensor::TensorView::new(Dtype::U8, vec![b.len()], &b)
                        .expect("view"),
                ),
            ];
            let file = safetensors::serialize(views, None).expect("serialize");
            (file, [a, b].concat())
        })
        .collect();
    std::fs::write(&path, &versions[0].0).expect("write");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (mut whole, mut refused) = (0, 0);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                k += 1;
                let tmp = dir.path().join(format!("tmp{k}"));
                std::fs::write(&tmp, &versions[k % 2].0).expect("write version");
                std::fs::rename(&tmp, &path).expect("replace");
            }
        });
        let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
        for _ in 0..60 {
            match gpufeed::safetensors::load_with(&loader, &path) {
                Ok(ckpt) => {
                    let mut got = Vec::new();
                    for name in ["a", "b"] {
                        let (_, view) = ckpt.get(name).expect("tensor");
                        let mut host = vec![0u8; view.len()];
                        gpu.default_stream()
                            .memcpy_dtoh(&view, &mut host)
                            .expect("copy back");
                        got.extend(host);
                    }
                    assert!(
                        versions.iter().any(|(_, tensors)| tensors == &got),
                        "tensors mix two versions of the file"
                    );
                    whole += 1;
                }
                Err(CkptError::Load(Error::FileChangedDuringLoad { path: p, .. })) => {
                    assert_eq!(p, path);
                    refused += 1;
                }
                // A reader that opened the file just as it was replaced may also see it
                // shrink under it: an error naming the file, never wrong bytes.
                Err(e) => {
                    let msg = e.to_string();
                    assert!(msg.contains("model.safetensors"), "{msg}");
                    refused += 1;
                }
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    eprintln!("60 loads during replacement: {whole} whole versions, {refused} refused");
}

/// Registration refused by the driver (injected: the H200's driver never refuses): a
/// `Registered` load falls back to `Staged`, the bytes arrive whole, and the report says why.
#[test]
fn refused_registration_falls_back_to_staged_with_the_reason() {
    let Some(gpu) = gpu_or_skip("refused_registration_falls_back_to_staged_with_the_reason") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("r.bin");
    let data = random_bytes((20 << 20) + 333, 91);
    std::fs::write(&path, &data).expect("write");
    let mut opts = LoadOptions::default().with_strategy(Strategy::Registered);
    opts.testing_refuse_registration = true;
    let loader = Loader::new(&gpu, opts).expect("loader");
    let (buf, report) = loader.load_file(&path).expect("falls back");
    assert_eq!(
        xxh3_64(&gpu.to_vec(&buf).expect("copy back")),
        xxh3_64(&data)
    );
    // The report names what ran, and what was refused.
    assert_eq!(report.strategy, Strategy::Staged, "{report:?}");
    let refusal = gpufeed::pinned::Error::Cuda {
        op: "cuMemHostRegister",
        result: gpufeed::cuda::CUresult::CUDA_ERROR_NOT_PERMITTED,
    };
    assert_eq!(report.fallbacks.len(), 1, "{report:?}");
    let f = &report.fallbacks[0];
    assert_eq!(f.refused, Refused::HostRegistration, "{report:?}");
    assert_eq!(f.reason, refusal.to_string());
    assert!(f.reason.contains("CUDA_ERROR_NOT_PERMITTED"), "{f}");
    assert!(f.instead.contains("staged"), "{f}");
}

/// `load_file_on` at an unaligned size: bytes exact, both parts of the time reported, staging
/// bounded by the transfer settings (not the file) and sized down for a small file.
#[test]
fn one_shot_file_loads_are_byte_exact_with_bounded_staging() {
    let Some(gpu) = gpu_or_skip("one_shot_file_loads_are_byte_exact_with_bounded_staging") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let bound = LoadOptions::default().transfer.staging_bytes_for(None) as u64;
    for (size, seed) in [((300usize << 20) + 7, 11u64), (5 << 20, 12)] {
        let path = dir.path().join(format!("one-shot-{size}.bin"));
        let data = random_bytes(size, seed);
        std::fs::write(&path, &data).expect("write");
        let (on, buf, report) = gpufeed::load_file_on(0, &path).expect("load_file_on");
        assert_eq!(on.info().ordinal, 0);
        assert_eq!(
            xxh3_64(&gpu.to_vec(&buf).expect("back")),
            xxh3_64(&data),
            "{size} B"
        );
        assert_eq!(report.bytes, size as u64);
        assert!(
            report.context_seconds > 0.0 && report.load_seconds > 0.0,
            "{report:?}"
        );
        assert!(report.staging_bytes <= bound, "{report:?} past {bound}");
        if (size as u64) < bound {
            // A small file's staging is about its size (pieces in power-of-two classes).
            assert!(
                report.staging_bytes <= 2 * size as u64,
                "a {size} B file needs at most twice its size of staging: {report:?}"
            );
        }
    }
}

/// Saves from GPU memory: a buffer of an unaligned size and tensors at unaligned offsets of it
/// (one file, and shards with an index) come back bit for bit through gpufeed's loader and the
/// `safetensors` crate.
#[test]
fn saves_from_gpu_memory_are_byte_exact_and_load_back() {
    use gpufeed::safetensors::{SaveTensor, save, save_sharded};
    use gpufeed::{Piece, SaveOptions, Saver};
    let Some(gpu) = gpu_or_skip("saves_from_gpu_memory_are_byte_exact_and_load_back") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let data = random_bytes((20 << 20) + 4097, 31);
    let src = dir.path().join("src.bin");
    std::fs::write(&src, &data).expect("write");
    let (buf, _) = gpufeed::load_file(&gpu, &src, LoadOptions::default()).expect("load");
    let saver = Saver::new(&gpu, SaveOptions::default().with_window_bytes(4 << 20)).expect("saver");
    let out = dir.path().join("out.bin");
    let report = saver.save_file(&buf, &out).expect("save");
    assert_eq!(report.bytes, data.len() as u64);
    assert_eq!(xxh3_64(&std::fs::read(&out).expect("read")), xxh3_64(&data));
    let one_call = dir.path().join("one-call.bin");
    gpufeed::save_file(&gpu, &buf, &one_call).expect("save_file");
    assert_eq!(
        xxh3_64(&std::fs::read(&one_call).expect("read")),
        xxh3_64(&data)
    );

    // Tensors at unaligned offsets of the device buffer.
    let parts = [
        ("a", Dtype::U8, vec![1001usize], 0usize),
        ("b", Dtype::F32, vec![3, 1000], 1001),
        ("c", Dtype::BF16, vec![7, 333], 13_001),
        ("d", Dtype::F16, vec![4 << 20], 17_663),
    ];
    let views: Vec<_> = parts
        .iter()
        .map(|(_, d, s, at)| {
            let len = s.iter().product::<usize>() * d.bitsize() / 8;
            buf.slice(*at..at + len)
        })
        .collect();
    let tensors: Vec<SaveTensor<'_>> = parts
        .iter()
        .zip(&views)
        .map(|((n, d, s, _), v)| SaveTensor {
            name: n,
            dtype: *d,
            shape: s,
            data: Piece::Device(v),
        })
        .collect();
    let expect = |i: usize| {
        let (_, d, s, at) = &parts[i];
        &data[*at..at + s.iter().product::<usize>() * d.bitsize() / 8]
    };
    let st_path = dir.path().join("model.safetensors");
    save(&saver, &tensors, None, &st_path).expect("safetensors save");
    let bytes = std::fs::read(&st_path).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("the crate reads it");
    let back = gpufeed::safetensors::load(&gpu, &st_path).expect("gpufeed loads it");
    for (i, (n, d, s, _)) in parts.iter().enumerate() {
        let t = st.tensor(n).expect("tensor");
        assert_eq!((t.dtype(), t.shape()), (*d, &s[..]));
        assert_eq!(xxh3_64(t.data()), xxh3_64(expect(i)), "{n}");
        let (_, view) = back.get(n).expect("loaded");
        let on_gpu = gpu.default_stream().clone_dtoh(&view).expect("copy back");
        assert_eq!(xxh3_64(&on_gpu), xxh3_64(expect(i)), "{n} after a load");
    }
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).expect("mkdir");
    save_sharded(&saver, &tensors, None, &shards, "model", 1 << 20).expect("sharded");
    let back = gpufeed::safetensors::load(&gpu, shards.join("model.safetensors.index.json"))
        .expect("the index loads");
    for (i, (n, ..)) in parts.iter().enumerate() {
        let (_, view) = back.get(n).expect("loaded");
        let on_gpu = gpu.default_stream().clone_dtoh(&view).expect("copy back");
        assert_eq!(xxh3_64(&on_gpu), xxh3_64(expect(i)), "{n} from the shards");
    }
}
