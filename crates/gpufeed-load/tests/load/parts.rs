//! On a GPU: `Loader::load_parts_to` puts a file's spans into several device buffers in one
//! staged upload, and reports each part landed once, only when its bytes are there (each is
//! copied back and compared inside the report), by every strategy (those that do not stage
//! are staged for parts), random bytes at unaligned offsets, an empty part among them.

use std::sync::Mutex;

use gpufeed_load::{LoadOptions, Loader, Strategy};
use gpufeed_os::OpenedFile;
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, random_bytes};

/// A new device buffer of `n` bytes for a part (not written: the load writes it).
fn new_part(gpu: &gpufeed_load::Gpu, n: usize) -> gpufeed_load::DeviceBuffer {
    gpu.alloc_filled(
        n,
        gpufeed_load::layers::gpufeed_cuda::DeviceAlloc::Unpooled,
        |_| Ok::<(), gpufeed_load::Error>(()),
    )
    .expect("alloc")
    .0
}

#[test]
fn parts_land_one_by_one_each_with_its_bytes() {
    let test = "parts_land_one_by_one_each_with_its_bytes";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let len = (40 << 20) + 4099;
    let data = random_bytes(len, gpufeed_testkit::seed(test));
    let path = dir.path().join("parts.bin");
    std::fs::write(&path, &data).expect("write");
    // Parts of odd sizes (one of 0 bytes, one of a single byte, one of several spans, larger
    // than a staging piece), so that pieces straddle the parts' boundaries.
    let spans: Vec<Vec<std::ops::Range<u64>>> = vec![
        vec![7..(3 << 20) + 5],
        vec![],
        vec![(5 << 20) + 1..(5 << 20) + 2],
        vec![(6 << 20) + 3..(19 << 20) + 11, 100..4197],
        vec![(20 << 20) + 13..(40 << 20) + 4099],
    ];
    let wants: Vec<Vec<u8>> = spans
        .iter()
        .map(|ss| {
            ss.iter()
                .flat_map(|s| data[s.start as usize..s.end as usize].iter().copied())
                .collect()
        })
        .collect();
    for strategy in [
        Strategy::Auto,
        Strategy::Staged,
        Strategy::Direct,
        Strategy::Registered,
    ] {
        let loader =
            Loader::new(&gpu, LoadOptions::default().with_strategy(strategy)).expect("loader");
        let file = OpenedFile::open(&path).expect("open");
        let parts: Vec<_> = wants.iter().map(|w| new_part(&gpu, w.len())).collect();
        let refs: Vec<&_> = parts.iter().collect();
        let lists: Vec<&[std::ops::Range<u64>]> = spans.iter().map(|s| &s[..]).collect();
        // Each report: the part's bytes copied back then and there.
        let seen: Mutex<Vec<(usize, bool)>> = Mutex::new(Vec::new());
        let landed = |k: usize| {
            let back = gpu.to_vec(refs[k]).expect("copy back");
            let ok = xxh3_64(&back) == xxh3_64(&wants[k]);
            seen.lock().expect("lock").push((k, ok));
            true
        };
        // SAFETY: new allocations, read only in `landed` (after their report) and below.
        #[allow(unsafe_code, reason = "the test reads each part only once it landed")]
        let report =
            unsafe { loader.load_parts_to(&file, &lists, &refs, None, &landed) }.expect("load");
        let mut seen = seen.into_inner().expect("lock");
        assert!(
            seen.iter().all(|&(_, ok)| ok),
            "{strategy:?}: a part reported before its bytes were there: {seen:?}"
        );
        seen.sort_unstable();
        let ks: Vec<usize> = seen.iter().map(|&(k, _)| k).collect();
        assert_eq!(
            ks,
            (0..parts.len()).collect::<Vec<_>>(),
            "{strategy:?}: each part once"
        );
        assert_eq!(
            report.bytes,
            wants.iter().map(|w| w.len() as u64).sum::<u64>()
        );
        assert!(
            matches!(report.strategy, Strategy::Staged | Strategy::Direct),
            "{strategy:?} ran {:?}",
            report.strategy
        );
        for (p, w) in parts.iter().zip(&wants) {
            assert_eq!(
                xxh3_64(&gpu.to_vec(p).expect("back")),
                xxh3_64(w),
                "{strategy:?}"
            );
        }
    }
}

#[test]
fn parts_that_do_not_match_their_spans_are_refused_before_loading() {
    let test = "parts_that_do_not_match_their_spans_are_refused_before_loading";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("short.bin");
    std::fs::write(&path, random_bytes(4096, 3)).expect("write");
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let file = OpenedFile::open(&path).expect("open");
    let part = new_part(&gpu, 100);
    let landed = |k: usize| -> bool { panic!("part {k} reported for a refused load") };
    let (a, b, c, d) = (0..99, 4000..4100, 0..50, 50..100);
    let one = std::slice::from_ref;
    let cases: [(&[&[std::ops::Range<u64>]], &str); 3] = [
        (&[one(&a)], "99 bytes for a part of 100"),
        (&[one(&b)], "past the file's end"),
        (&[one(&c), one(&d)], "two lists for one part"),
    ];
    for (lists, what) in cases {
        // SAFETY: nothing reads the part.
        #[allow(unsafe_code, reason = "the loads are refused before they write")]
        let got = unsafe { loader.load_parts_to(&file, lists, &[&part], None, &landed) };
        assert!(got.is_err(), "{what}: loaded");
    }
}

#[test]
fn a_report_stops_the_load_and_empty_parts_are_reported_alone() {
    let test = "a_report_stops_the_load_and_empty_parts_are_reported_alone";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("stop.bin");
    let data = random_bytes((64 << 20) + 5, gpufeed_testkit::seed(test));
    std::fs::write(&path, &data).expect("write");
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let file = OpenedFile::open(&path).expect("open");
    let alloc = |n: usize| new_part(&gpu, n);
    // Only empty parts: each is reported, though nothing is uploaded.
    let (e1, e2) = (alloc(0), alloc(0));
    let seen = Mutex::new(Vec::new());
    let landed = |k: usize| {
        seen.lock().expect("lock").push(k);
        true
    };
    let none: &[std::ops::Range<u64>] = &[];
    // SAFETY: new allocations, never read.
    #[allow(unsafe_code, reason = "empty parts")]
    unsafe { loader.load_parts_to(&file, &[none, none], &[&e1, &e2], None, &landed) }
        .expect("empty parts");
    assert_eq!(*seen.lock().expect("lock"), vec![0, 1]);

    // Sixteen parts of 4 MiB: the first report asks to stop; the load ends with Stopped and
    // reports no part whose bytes did not land (each is checked when reported).
    let parts: Vec<_> = (0..16).map(|_| alloc(4 << 20)).collect();
    let refs: Vec<&_> = parts.iter().collect();
    let spans: Vec<std::ops::Range<u64>> = (0..16u64)
        .map(|k| 5 + (k << 22)..5 + ((k + 1) << 22))
        .collect();
    let lists: Vec<&[std::ops::Range<u64>]> = spans.iter().map(std::slice::from_ref).collect();
    let reported = Mutex::new(Vec::new());
    let stop = |k: usize| {
        let back = gpu.to_vec(refs[k]).expect("back");
        let want = &data[5 + (k << 22)..5 + ((k + 1) << 22)];
        reported
            .lock()
            .expect("lock")
            .push((k, xxh3_64(&back) == xxh3_64(want)));
        false
    };
    // SAFETY: new allocations, read only in `stop` (after their report).
    #[allow(unsafe_code, reason = "each part is read once it landed")]
    let got = unsafe { loader.load_parts_to(&file, &lists, &refs, None, &stop) };
    match got {
        Err(gpufeed_load::Error::Cuda(gpufeed_load::layers::gpufeed_cuda::Error::Stopped {
            landed,
        })) => assert!(landed >= 1, "{landed}"),
        other => panic!("a stopped load returned {other:?}"),
    }
    let reported = reported.into_inner().expect("lock");
    assert!(
        !reported.is_empty() && reported.iter().all(|&(_, ok)| ok),
        "{reported:?}"
    );
}
