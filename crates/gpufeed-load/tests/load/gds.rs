//! On a GPU: `Strategy::Gds` (cuFile). The H200 machine has libcufile without nvidia-fs, so
//! cuFile runs there in its compatibility mode: byte-exact loads at unaligned sizes, offsets and
//! spans, cold (evicted) and warm; compatibility mode turned off by a cufile.json given through
//! `CUFILE_ENV_PATH_JSON` (in a child process: cuFile reads its configuration once) -> the load
//! falls back to gpufeed's own path with cuFile's reason recorded; `O_DIRECT` refused (`EINVAL`,
//! injected) -> staged; a read failing after pieces landed (injected) -> the load done again
//! by `Direct` into the same destination. `Auto` takes `Gds` exactly where detection finds
//! peer-to-peer reads.

use gpufeed_load::{
    GDS_PIECE_BYTES, GdsBuffers, GdsFault, GdsRefusal, LoadOptions, Loader, Refused, Strategy,
};
use std::path::PathBuf;

use gpufeed_os::OpenedFile;
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, random_bytes};

/// Whether cuFile must load here: where GPU tests are required (the H200 machine has
/// libcufile.so.0) or the test was pointed at a library.
fn cufile_required() -> bool {
    gpufeed_testkit::gpu_required()
        || std::env::var("GPUFEED_CUFILE_LIBRARY").is_ok_and(|v| !v.is_empty())
}

/// GPU 0 where cuFile loads too; else `None` after printing why the test is skipped (a failure
/// where cuFile is required). `None` in a child process, whose role another test plays.
fn gpu_with_cufile_or_skip(test: &str) -> Option<gpufeed_load::Gpu> {
    if child_role().is_some() {
        return None;
    }
    let gpu = gpu_or_skip(test)?;
    if let Err(e) = gpufeed_cuda::cufile_version() {
        assert!(!cufile_required(), "cuFile: {e}");
        gpufeed_testkit::skip(test, &e);
        return None;
    }
    // A volume cuFile cannot look up (a container without udev's database) refuses every
    // handle whatever this code does: said, and tested by
    // `a_file_cufile_cannot_take_falls_back_with_detections_reason`. The GPU machine's run
    // script gives the container udev's record of its disk, so that these tests read there.
    let here = gpufeed_cuda::gds::detect(
        Some(std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))),
        Ok(String::new()),
        &gpufeed_cuda::gds::GdsRoots::system(),
    );
    if here.verdict == gpufeed_cuda::gds::GdsVerdict::Absent {
        gpufeed_testkit::skip(test, &format!("cuFile cannot read here: {}", here.reason));
        return None;
    }
    Some(gpu)
}

/// A file on tmpfs, which cuFile refuses (it looks volumes up by block device through udev):
/// the load is gpufeed's own, byte for byte, and the refusal's reason is detection's, with
/// the fix.
#[test]
fn a_file_cufile_cannot_take_falls_back_with_detections_reason() {
    let test = "a_file_cufile_cannot_take_falls_back_with_detections_reason";
    if child_role().is_some() {
        return;
    }
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    if let Err(e) = gpufeed_cuda::cufile_version() {
        assert!(!cufile_required(), "cuFile: {e}");
        gpufeed_testkit::skip(test, &e);
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm").expect("a folder in /dev/shm");
    let detection = gpufeed_cuda::gds::detect(
        Some(dir.path()),
        Ok(String::new()),
        &gpufeed_cuda::gds::GdsRoots::system(),
    );
    assert_eq!(
        detection.verdict,
        gpufeed_cuda::gds::GdsVerdict::Absent,
        "{}",
        detection.reason
    );
    let len = (3 << 20) + 4093;
    let data = random_bytes(len, gpufeed_testkit::seed(test));
    let path = dir.path().join("t.bin");
    std::fs::write(&path, &data).expect("write");
    let loader =
        Loader::new(&gpu, LoadOptions::default().with_strategy(Strategy::Gds)).expect("loader");
    let (buf, report) = loader.load_file(&path).expect("load");
    assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), xxh3_64(&data));
    assert_ne!(report.strategy, Strategy::Gds);
    let fallback = report
        .fallbacks
        .iter()
        .find(|f| f.refused == Refused::Gds)
        .expect("a cuFile fallback");
    println!("{test}: {:?}: {}", report.gds_refused, fallback.reason);
    match report.gds_refused {
        // The kernel refused O_DIRECT on tmpfs (before 6.6) before cuFile was asked.
        Some(GdsRefusal::DirectIo) => {}
        Some(GdsRefusal::Registration) => assert!(
            fallback.reason.contains(&detection.reason)
                && fallback.reason.contains("disk file system"),
            "{}",
            fallback.reason
        ),
        other => panic!("{other:?}: {}", fallback.reason),
    }
}

/// A file of `len` random bytes (seeded by `test`) named `name` in a new folder of the test
/// target's: the folder (removed when dropped), the path and the bytes.
fn random_file(test: &str, name: &str, len: usize) -> (tempfile::TempDir, PathBuf, Vec<u8>) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let data = random_bytes(len, gpufeed_testkit::seed(test));
    let path = dir.path().join(name);
    std::fs::write(&path, &data).expect("write");
    (dir, path, data)
}

/// Whether cuFile's driver reads through nvidia-fs here (where registered buffers are read
/// into).
fn reads_through_nvidia_fs(gpu: &gpufeed_load::Gpu) -> bool {
    gpufeed_cuda::cufile::CuFile::open(gpu)
        .expect("cuFile's driver")
        .properties()
        .nvidia_fs()
}

/// The bytes of `data` at `spans`, back to back.
fn bytes_at(data: &[u8], spans: &[std::ops::Range<u64>]) -> Vec<u8> {
    spans
        .iter()
        .flat_map(|s| data[s.start as usize..s.end as usize].iter().copied())
        .collect()
}

/// The test's role in a child process (`gpufeed_testkit::CHILD_ROLE`), if it is one.
fn child_role() -> Option<String> {
    std::env::var(gpufeed_testkit::CHILD_ROLE).ok()
}

#[test]
fn gds_loads_are_byte_exact_cold_and_warm_at_unaligned_sizes() {
    let test = "gds_loads_are_byte_exact_cold_and_warm_at_unaligned_sizes";
    let Some(gpu) = gpu_with_cufile_or_skip(test) else {
        return;
    };
    let len = (37 << 20) + 4093;
    let (_dir, path, data) = random_file(test, "gds.bin", len);
    let mut opts = LoadOptions::default().with_strategy(Strategy::Gds);
    opts.gds_path_counts = true;
    let loader = Loader::new(&gpu, opts).expect("loader");
    let nvidia_fs = gpufeed_cuda::gds::detect(
        None,
        Ok(String::new()),
        &gpufeed_cuda::gds::GdsRoots::system(),
    )
    .nvidia_fs
    .loaded;
    for warmth in ["cold", "warm"] {
        if warmth == "cold" {
            gpufeed_os::cache::evict(&path).expect("evict");
        }
        let (buf, report) = loader.load_file(&path).expect("load");
        assert_eq!(
            report.strategy,
            Strategy::Gds,
            "{warmth}: cuFile did not load: {:?}",
            report.fallbacks
        );
        assert_eq!(report.gds_refused, None);
        let backend = report.io_backend.clone().unwrap_or_default();
        assert!(backend.starts_with("cufile"), "{backend}");
        // Without nvidia-fs (the H200 machine) cuFile reads through its compatibility mode:
        // counted by its statistics where it has them, else said from its properties.
        if !nvidia_fs {
            assert!(backend.contains("compat"), "{backend}");
        }
        println!(
            "{warmth}: {} bytes in {:.3} s ({:.2} GB/s) through {backend}",
            report.bytes,
            report.seconds,
            report.gbps()
        );
        assert_eq!(
            xxh3_64(&gpu.to_vec(&buf).expect("back")),
            xxh3_64(&data),
            "{warmth}"
        );
    }
    // Unaligned ranges and several spans of one opened file.
    let (buf, report) = loader
        .load_range(&path, 4093..(20 << 20) + 11)
        .expect("range");
    assert_eq!(report.strategy, Strategy::Gds);
    assert_eq!(
        gpu.to_vec(&buf).expect("back"),
        &data[4093..(20 << 20) + 11]
    );
    let spans = [
        (9 << 20) + 7..(30 << 20) + 4098,
        1..2,
        3..(5 << 20) + 1,
        len as u64 - 5..len as u64,
    ];
    let file = OpenedFile::open(&path).expect("open");
    let (buf, report) = loader.load_spans_of(&file, &spans).expect("spans");
    assert_eq!(report.strategy, Strategy::Gds);
    let want = bytes_at(&data, &spans);
    assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), xxh3_64(&want));
}

/// `GdsBuffers::Registered`. Where cuFile reads through nvidia-fs: whole pieces into the
/// loader's registered device buffers, each copied into the destination on the GPU; the
/// buffers made and registered by the first load, within their bound (two per read thread),
/// the same ones serving the next loads. In cuFile's compatibility mode (the GPU machines):
/// nothing registered, cuFile reads into the destination, and a `Refused::Gds` fallback says
/// why. Either way the bytes are the file's, cold and warm, at unaligned sizes, offsets and
/// spans, into a destination that held other bytes; `Destination` and `Auto` in
/// compatibility mode register nothing and say nothing.
#[test]
fn registered_buffers_are_made_once_within_their_bound_and_loads_stay_byte_exact() {
    let test = "registered_buffers_are_made_once_within_their_bound_and_loads_stay_byte_exact";
    let Some(gpu) = gpu_with_cufile_or_skip(test) else {
        return;
    };
    let peer = reads_through_nvidia_fs(&gpu);
    let len = (45 << 20) + 4093;
    let (_dir, path, data) = random_file(test, "reg.bin", len);
    let threads = 3;
    let bound = (threads * 2 * GDS_PIECE_BYTES) as u64;
    let mut opts = LoadOptions::default().with_strategy(Strategy::Gds);
    opts.transfer = opts.transfer.with_fill_threads(threads);
    opts.gds_buffers = GdsBuffers::Registered;
    opts.gds_path_counts = true;
    let loader = Loader::new(&gpu, opts.clone()).expect("loader");
    assert_eq!(loader.gds_registered_bytes(), 0, "nothing before a load");
    // What a Registered load's report must say: registered buffers read into where cuFile
    // reads through nvidia-fs (within the bound), else none and the reason.
    let check = |what: &str, report: &gpufeed_load::LoadReport| {
        assert_eq!(
            report.strategy,
            Strategy::Gds,
            "{what}: {:?}",
            report.fallbacks
        );
        let declined = report.fallbacks.iter().find(|f| f.refused == Refused::Gds);
        println!(
            "{test}: {what}: {:.2} GB/s through {} into {} MiB registered; {declined:?}",
            report.gbps(),
            report.io_backend.clone().unwrap_or_default(),
            report.gds_registered_bytes >> 20
        );
        if peer {
            assert!(declined.is_none(), "{what}: {declined:?}");
            assert!(
                report.gds_registered_bytes > 0
                    && report.gds_registered_bytes <= bound
                    && report
                        .gds_registered_bytes
                        .is_multiple_of(GDS_PIECE_BYTES as u64),
                "{what}: {} bytes registered",
                report.gds_registered_bytes
            );
        } else {
            assert_eq!(report.gds_registered_bytes, 0, "{what}");
            assert!(
                declined.is_some_and(|f| f.reason.contains("compatibility mode")),
                "{what}: {declined:?}"
            );
        }
    };
    let mut made = 0;
    for warmth in ["cold", "warm"] {
        if warmth == "cold" {
            gpufeed_os::cache::evict(&path).expect("evict");
        }
        let (buf, report) = loader.load_file(&path).expect("load");
        check(warmth, &report);
        let now = loader.gds_registered_bytes();
        assert!(now >= report.gds_registered_bytes && now <= bound, "{now}");
        assert_eq!(now > 0, peer, "{warmth}: {now} bytes registered");
        if warmth == "cold" {
            made = now;
        } else {
            assert_eq!(now, made, "the buffers of the first load serve the next");
        }
        assert_eq!(
            xxh3_64(&gpu.to_vec(&buf).expect("back")),
            xxh3_64(&data),
            "{warmth}"
        );
    }
    // Spans at unaligned offsets into a destination holding other bytes.
    let spans = [
        (9 << 20) + 7..(30 << 20) + 4098,
        1..2,
        3..(5 << 20) + 1,
        len as u64 - 5..len as u64,
    ];
    let want = bytes_at(&data, &spans);
    let file = OpenedFile::open(&path).expect("open");
    let mut dst = gpu
        .default_stream()
        .clone_htod(&random_bytes(want.len(), 78))
        .expect("filled");
    let report = loader
        .load_spans_to(&file, &spans, &mut dst, None)
        .expect("spans");
    check("spans", &report);
    assert_eq!(loader.gds_registered_bytes(), made);
    assert_eq!(xxh3_64(&gpu.to_vec(&dst).expect("back")), xxh3_64(&want));
    drop(loader);
    // Into the destination, and Auto: registered only where cuFile reads peer-to-peer, and
    // nothing said either way.
    for (buffers, registers) in [(GdsBuffers::Destination, false), (GdsBuffers::Auto, peer)] {
        let mut o = opts.clone();
        o.gds_buffers = buffers;
        let loader = Loader::new(&gpu, o).expect("loader");
        let (buf, report) = loader.load_file(&path).expect("load");
        assert_eq!(report.strategy, Strategy::Gds, "{buffers:?}");
        assert!(
            !report.fallbacks.iter().any(|f| f.refused == Refused::Gds),
            "{buffers:?}: {:?}",
            report.fallbacks
        );
        assert_eq!(report.gds_registered_bytes > 0, registers, "{buffers:?}");
        assert_eq!(loader.gds_registered_bytes() > 0, registers, "{buffers:?}");
        assert_eq!(
            xxh3_64(&gpu.to_vec(&buf).expect("back")),
            xxh3_64(&data),
            "{buffers:?}"
        );
    }
}

/// What bench table 16 does, smaller: loaders of every route in one process (gpufeed's direct
/// path, cuFile into the destination, cuFile through registered buffers, `Auto`) take turns
/// on one file, each load after an eviction, the order rotated each round, so that the later
/// loads land in pool memory freed by the others; every load's bytes are the file's.
#[test]
fn loaders_of_every_route_take_turns_on_a_cold_file() {
    let test = "loaders_of_every_route_take_turns_on_a_cold_file";
    let Some(gpu) = gpu_with_cufile_or_skip(test) else {
        return;
    };
    let peer = reads_through_nvidia_fs(&gpu);
    let (_dir, path, data) = random_file(test, "turns.bin", (200 << 20) + 13);
    let want = xxh3_64(&data);
    drop(data);
    let routes = [
        (Strategy::Direct, GdsBuffers::Auto),
        (Strategy::Gds, GdsBuffers::Destination),
        (Strategy::Gds, GdsBuffers::Registered),
        (Strategy::Auto, GdsBuffers::Auto),
    ];
    let loaders: Vec<Loader> = routes
        .iter()
        .map(|&(strategy, buffers)| {
            let mut opts = LoadOptions::default().with_strategy(strategy);
            opts.gds_buffers = buffers;
            opts.gds_path_counts = strategy == Strategy::Gds;
            Loader::new(&gpu, opts).expect("loader")
        })
        .collect();
    for round in 0..3 {
        for k in 0..routes.len() {
            let i = (round + k) % routes.len();
            gpufeed_os::cache::evict(&path).expect("evict");
            let (buf, report) = loaders[i].load_file(&path).expect("load");
            let what = format!("round {round}, {:?}", routes[i]);
            if routes[i].0 == Strategy::Gds {
                assert_eq!(
                    report.strategy,
                    Strategy::Gds,
                    "{what}: {:?}",
                    report.fallbacks
                );
                assert_eq!(
                    report.gds_registered_bytes > 0,
                    routes[i].1 == GdsBuffers::Registered && peer,
                    "{what}"
                );
            }
            assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), want, "{what}");
            drop(buf);
            loaders[i].wait_for_cleanup();
        }
    }
}

/// cuFile refused after some pieces landed (a read failing at piece 2, injected), into a
/// destination holding other bytes: the load runs `Direct` into the same destination and every
/// byte is the file's; `O_DIRECT` refused (`EINVAL`, injected) -> `Staged`. Each refusal typed
/// in the report, with a `Refused::Gds` fallback.
#[test]
fn a_refused_gds_load_is_done_again_by_gpufeeds_own_path() {
    let test = "a_refused_gds_load_is_done_again_by_gpufeeds_own_path";
    let Some(gpu) = gpu_with_cufile_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let len = (29 << 20) + 13;
    let data = random_bytes(len, gpufeed_testkit::seed(test));
    let path = dir.path().join("r.bin");
    std::fs::write(&path, &data).expect("write");
    let file = OpenedFile::open(&path).expect("open");
    let spans = [5..(20 << 20) + 1, (21 << 20) + 3..len as u64];
    let want = bytes_at(&data, &spans);
    for (fault, refusal, ran) in [
        (GdsFault::ReadFailsAt(2), GdsRefusal::Read, Strategy::Direct),
        (
            GdsFault::ReopenEinval,
            GdsRefusal::DirectIo,
            Strategy::Staged,
        ),
    ] {
        let mut opts = LoadOptions::default().with_strategy(Strategy::Gds);
        opts.testing_gds_fault = Some(fault);
        let loader = Loader::new(&gpu, opts).expect("loader");
        // Another content first: whatever cuFile wrote before failing is written again.
        let mut dst = gpu
            .default_stream()
            .clone_htod(&random_bytes(want.len(), 77))
            .expect("filled");
        let report = loader
            .load_spans_to(&file, &spans, &mut dst, None)
            .expect("load");
        assert_eq!(report.strategy, ran, "{fault:?}");
        assert_eq!(report.gds_refused, Some(refusal), "{fault:?}");
        assert!(
            report.fallbacks.iter().any(|f| f.refused == Refused::Gds),
            "{:?}",
            report.fallbacks
        );
        assert_eq!(
            xxh3_64(&gpu.to_vec(&dst).expect("back")),
            xxh3_64(&want),
            "{fault:?}"
        );
    }
}

/// The child of [`compat_mode_off_falls_back_with_cufiles_reason`]: loads with `Gds` under
/// the cufile.json the parent gave and prints what ran.
#[test]
fn gds_child_entry() {
    if child_role().as_deref() != Some("gds-compat-off") {
        return;
    }
    let gpu = gpufeed_load::Gpu::open(0).expect("GPU");
    let path = std::env::var("GDS_TEST_FILE").expect("file");
    let data = std::fs::read(&path).expect("read");
    let loader =
        Loader::new(&gpu, LoadOptions::default().with_strategy(Strategy::Gds)).expect("loader");
    let (buf, report) = loader.load_file(&path).expect("load");
    assert_eq!(gpu.to_vec(&buf).expect("back"), data, "bytes");
    let gds = report.fallbacks.iter().find(|f| f.refused == Refused::Gds);
    println!(
        "RAN {} AS {:?} BACKEND {} REFUSED {}",
        report.strategy,
        report.gds_refused,
        report.io_backend.unwrap_or_default(),
        gds.map_or("-".to_owned(), |f| f.reason.clone())
    );
}

/// cufile.json with `allow_compat_mode: false` on a machine without nvidia-fs: cuFile refuses
/// (its driver does not open), the load runs gpufeed's `Direct` path, and the fallback
/// carries cuFile's status. Where nvidia-fs is loaded cuFile reads peer-to-peer instead, and
/// the test says so.
#[test]
fn compat_mode_off_falls_back_with_cufiles_reason() {
    let test = "compat_mode_off_falls_back_with_cufiles_reason";
    let Some(_gpu) = gpu_with_cufile_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("c.bin");
    std::fs::write(&path, random_bytes((9 << 20) + 5, 7)).expect("write");
    let json = dir.path().join("cufile.json");
    std::fs::write(
        &json,
        "{\n  // compatibility mode off: without nvidia-fs cuFile refuses\n  \"properties\": { \"allow_compat_mode\": false }\n}\n",
    )
    .expect("json");
    let out = gpufeed_testkit::run_child(
        "gds::gds_child_entry",
        "gds-compat-off",
        &[
            ("CUFILE_ENV_PATH_JSON", json.display().to_string()),
            ("GDS_TEST_FILE", path.display().to_string()),
        ],
    );
    let line = out
        .lines()
        .find(|l| l.starts_with("RAN "))
        .unwrap_or_else(|| panic!("no result line in {out}"));
    println!("{line}");
    let nvfs = gpufeed_cuda::gds::detect(
        None,
        Ok(String::new()),
        &gpufeed_cuda::gds::GdsRoots::system(),
    )
    .nvidia_fs
    .loaded;
    if nvfs {
        assert!(line.starts_with("RAN gds"), "{line}");
    } else {
        assert!(line.starts_with("RAN direct"), "{line}");
        assert!(
            line.contains("REFUSED cuFile"),
            "cuFile's own error: {line}"
        );
    }
}

/// `Auto` picks `Gds` for a cold file exactly where detection finds peer-to-peer reads for
/// its file system (never cuFile's compatibility mode).
#[test]
fn auto_takes_gds_only_where_detection_finds_it() {
    let test = "auto_takes_gds_only_where_detection_finds_it";
    if child_role().is_some() {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("a.bin");
    std::fs::write(&path, random_bytes((16 << 20) + 3, 3)).expect("write");
    gpufeed_os::cache::evict(&path).expect("evict");
    let file = OpenedFile::open(&path).expect("open");
    let (auto, why) = gpufeed_load::internal::auto_choice(&file, 0..file.len());
    let library = gpufeed_cuda::cufile_version().map_err(|e| e.to_string());
    let d = gpufeed_cuda::gds::detect(Some(&path), library, &gpufeed_cuda::gds::GdsRoots::system());
    println!(
        "{test}: detection {} ({}); Auto: {auto} ({why})",
        d.verdict, d.reason
    );
    let dio = gpufeed_os::align::dio_alignment(file.file()).is_ok_and(|a| a.supported());
    assert_eq!(
        auto == Strategy::Gds,
        dio && d.verdict == gpufeed_cuda::gds::GdsVerdict::Available,
        "{auto}: {why}"
    );
}
