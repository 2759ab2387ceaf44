//! On a GPU: files registered once and loaded from many times (`RegisteredFile`), byte for
//! byte at unaligned ranges, from several loaders, and refused once the file changed.

use gpufeed_load::{Error, LoadOptions, Loader, RegisteredFile, Strategy};
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, random_bytes};

#[test]
fn registered_files_load_unaligned_ranges_byte_exact_from_any_loader() {
    let test = "registered_files_load_unaligned_ranges_byte_exact_from_any_loader";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let len = (40 << 20) + 4097;
    let data = random_bytes(len, gpufeed_testkit::seed(test));
    let path = dir.path().join("weights.bin");
    std::fs::write(&path, &data).expect("write");
    // Cold: registering reads what the page cache lacks.
    gpufeed_os::cache::evict(&path).expect("evict");
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let file = loader.register_file(&path).expect("register");
    assert_eq!((file.len(), file.path()), (len as u64, path.as_path()));
    let ranges = [
        0..len as u64,
        1..(1 << 20) + 4,
        4095..4097,
        (17 << 20) + 3..(33 << 20) + 11,
        len as u64 - 5..len as u64,
        7..7,
    ];
    for round in 0..2 {
        for r in &ranges {
            let (buf, report) = loader
                .load_registered(&file, r.clone())
                .unwrap_or_else(|e| panic!("{r:?}: {e}"));
            let want = &data[r.start as usize..r.end as usize];
            assert_eq!((buf.len(), report.bytes), (want.len(), want.len() as u64));
            assert_eq!(report.strategy, Strategy::Registered);
            if !want.is_empty() {
                let back = gpu.to_vec(&buf).expect("copy back");
                assert_eq!(xxh3_64(&back), xxh3_64(want), "round {round}, {r:?}");
            }
        }
    }
    // Into memory that exists, at an odd offset, between bytes that must stay as they were.
    let mut dst = gpu
        .default_stream()
        .clone_htod(&vec![0xA5u8; 3 << 20])
        .expect("destination");
    let r = 12_345..(2 << 20) + 999;
    let n = (r.end - r.start) as usize;
    loader
        .load_registered_into(&file, r.clone(), &mut dst, 77)
        .expect("into");
    let back = gpu.to_vec(&dst).expect("copy back");
    assert!(
        back[..77].iter().all(|&b| b == 0xA5),
        "bytes before touched"
    );
    assert_eq!(&back[77..77 + n], &data[r.start as usize..r.end as usize]);
    assert!(
        back[77 + n..].iter().all(|&b| b == 0xA5),
        "bytes after touched"
    );
    // Another loader (other options) copies from the same registration.
    let other = Loader::new(&gpu, LoadOptions::one_thread()).expect("second loader");
    let (buf, _) = other
        .load_registered(&file, 0..len as u64)
        .expect("other loader");
    assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), xxh3_64(&data));
    // Errors: past the end, a destination too small; the registration survives them.
    let past = loader.load_registered(&file, len as u64 - 1..len as u64 + 1);
    assert!(
        matches!(past, Err(Error::Os(gpufeed_os::Error::RangePastEof { .. }))),
        "{past:?}"
    );
    let mut small = gpu.alloc_zeroed(16).expect("small");
    assert!(
        loader
            .load_registered_into(&file, 0..17, &mut small, 0)
            .is_err()
    );
    let (buf, _) = loader
        .load_registered(&file, 0..4096)
        .expect("after errors");
    assert_eq!(gpu.to_vec(&buf).expect("back"), &data[..4096]);
    // An empty file registers and loads nothing.
    let empty = dir.path().join("empty.bin");
    std::fs::write(&empty, b"").expect("write");
    let none = RegisteredFile::open(&loader, &empty).expect("register empty");
    assert!(none.is_empty());
    let (buf, _) = loader.load_registered(&none, 0..0).expect("load empty");
    assert_eq!(buf.len(), 0);
}

#[test]
fn a_registered_file_that_changes_is_refused_until_registered_again() {
    let test = "a_registered_file_that_changes_is_refused_until_registered_again";
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("data.bin");
    let seed = gpufeed_testkit::seed(test);
    let first = random_bytes((3 << 20) + 1, seed);
    std::fs::write(&path, &first).expect("write");
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let changes: [(&str, &dyn Fn()); 4] = [
        ("truncated", &|| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(1 << 20))
                .expect("truncate")
        }),
        ("grown", &|| {
            use std::io::Write;
            std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .and_then(|mut f| f.write_all(b"more"))
                .expect("append")
        }),
        ("replaced", &|| {
            let tmp = path.with_extension("new");
            std::fs::write(&tmp, &first).expect("write new");
            std::fs::rename(&tmp, &path).expect("rename");
        }),
        ("removed", &|| std::fs::remove_file(&path).expect("remove")),
    ];
    for (what, change) in changes {
        std::fs::write(&path, &first).expect("rewrite");
        let file = loader.register_file(&path).expect("register");
        let (buf, _) = loader.load_registered(&file, 0..4096).expect("before");
        assert_eq!(gpu.to_vec(&buf).expect("back"), &first[..4096]);
        change();
        let err = loader
            .load_registered(&file, 0..4096)
            .expect_err("a changed file must be refused");
        assert!(
            matches!(err, Error::RegisteredFileChanged { .. })
                && err.to_string().contains("register the file again"),
            "{what}: {err}"
        );
        drop(file);
        if what == "removed" {
            std::fs::write(&path, &first[..1000]).expect("write anew");
        }
        // Registered again, it loads what the file holds now.
        let now = std::fs::read(&path).expect("read");
        let file = loader.register_file(&path).expect("register again");
        let (buf, _) = loader
            .load_registered(&file, 0..now.len() as u64)
            .expect("after registering again");
        assert_eq!(
            xxh3_64(&gpu.to_vec(&buf).expect("back")),
            xxh3_64(&now),
            "{what}"
        );
    }
}
