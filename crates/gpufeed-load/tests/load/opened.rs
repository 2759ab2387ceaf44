//! On a GPU: a load opens its file once. Loads of an `OpenedFile` read the version opened
//! (every strategy, unaligned spans, random bytes), refuse it once it changed (written in
//! place, or replaced at its path) rather than hand out bytes of two versions, and a load in
//! rounds takes the route chosen once (`Loader::choose_route`).

use gpufeed_load::{Error, LoadOptions, Loader, Strategy};
use gpufeed_os::OpenedFile;
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, random_bytes};

#[test]
fn loads_of_an_opened_file_are_of_that_version_or_refused() {
    let test = "loads_of_an_opened_file_are_of_that_version_or_refused";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let len = (24 << 20) + 4099;
    let data = random_bytes(len, gpufeed_testkit::seed(test));
    let path = dir.path().join("v.bin");
    let spans = [3..(5 << 20) + 1, (9 << 20) + 7..(20 << 20) + 4098, 11..12];
    let want: Vec<u8> = spans
        .iter()
        .flat_map(|s| data[s.start as usize..s.end as usize].iter().copied())
        .collect();
    for strategy in [
        Strategy::Auto,
        Strategy::Staged,
        Strategy::Direct,
        Strategy::Registered,
    ] {
        let loader =
            Loader::new(&gpu, LoadOptions::default().with_strategy(strategy)).expect("loader");
        std::fs::write(&path, &data).expect("write");
        let file = OpenedFile::open(&path).expect("open");
        let (buf, report) = loader.load_spans_of(&file, &spans).expect("load");
        assert_eq!(
            xxh3_64(&gpu.to_vec(&buf).expect("back")),
            xxh3_64(&want),
            "{strategy}"
        );
        assert_eq!(report.path, path);
        // One span: Registered maps it.
        let whole = 0..len as u64;
        let (buf, _) = loader
            .load_spans_of(&file, std::slice::from_ref(&whole))
            .expect("load");
        assert_eq!(
            xxh3_64(&gpu.to_vec(&buf).expect("back")),
            xxh3_64(&data),
            "{strategy}"
        );

        // Replaced at its path: the opened version is no longer the file, and is refused.
        let next = dir.path().join("next");
        std::fs::write(&next, random_bytes(len, 99)).expect("write");
        std::fs::rename(&next, &path).expect("rename over");
        match loader.load_spans_of(&file, &spans) {
            Err(Error::FileChangedDuringLoad { path: p, .. }) => assert_eq!(p, path),
            other => panic!(
                "{strategy}: a replaced file loaded: {:?}",
                other.map(|r| r.1)
            ),
        }

        // Written in place: refused too.
        std::fs::write(&path, &data).expect("write");
        let file = OpenedFile::open(&path).expect("open");
        std::thread::sleep(std::time::Duration::from_millis(20));
        let w = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("rw");
        std::os::unix::fs::FileExt::write_all_at(&w, b"!", 5).expect("write in place");
        assert!(
            matches!(
                loader.load_spans_of(&file, &spans),
                Err(Error::FileChangedDuringLoad { .. })
            ),
            "{strategy}: a rewritten file loaded"
        );
    }
}

/// A load in rounds (as a replicated load reads its share) with one `RouteChoice`: every
/// round takes the chosen route and reports the one residency sample, whatever the page
/// cache does meanwhile; the bytes are exact.
#[test]
fn rounds_of_one_load_take_the_route_chosen_once() {
    let test = "rounds_of_one_load_take_the_route_chosen_once";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let len = (64 << 20) + 12345;
    let data = random_bytes(len, gpufeed_testkit::seed(test));
    let path = dir.path().join("rounds.bin");
    std::fs::write(&path, &data).expect("write");
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let file = OpenedFile::open(&path).expect("open");
    gpufeed_os::cache::warm(&path).expect("warm");
    let choice = loader.choose_route(&file, 0..len as u64);
    assert_eq!(choice.strategy(), Strategy::Staged, "{}", choice.reason());
    let round = (16 << 20) + 1;
    let mut got = Vec::with_capacity(len);
    let mut at = 0u64;
    while at < len as u64 {
        let end = (at + round).min(len as u64);
        let mut dst = gpu.alloc_zeroed((end - at) as usize).expect("alloc");
        // The rest of the file leaves the page cache: a choice made now would be Direct.
        gpufeed_os::cache::evict(&path).expect("evict");
        let report = loader
            .load_round(&file, at..end, &mut dst, &choice)
            .expect("round");
        assert_eq!(report.strategy, Strategy::Staged, "round at {at}");
        assert_eq!(report.reason, choice.reason(), "round at {at}");
        assert_eq!(report.residency_before, choice.residency(), "round at {at}");
        got.extend(gpu.to_vec(&dst).expect("back"));
        at = end;
    }
    assert_eq!(xxh3_64(&got), xxh3_64(&data));
    // Without a choice a cold round is judged again (and goes around the page cache).
    gpufeed_os::cache::evict(&path).expect("evict");
    let mut dst = gpu.alloc_zeroed(round as usize).expect("alloc");
    let report = loader
        .load_spans_to(&file, std::slice::from_ref(&(0..round)), &mut dst, None)
        .expect("cold round");
    assert_eq!(
        xxh3_64(&gpu.to_vec(&dst).expect("back")),
        xxh3_64(&data[..round as usize])
    );
    assert_ne!(
        report.reason,
        choice.reason(),
        "a new choice for a cold round"
    );
}
