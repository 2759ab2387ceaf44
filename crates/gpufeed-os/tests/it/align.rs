use std::os::unix::fs::{FileExt, OpenOptionsExt};

use gpufeed_os::Error;
use gpufeed_os::align::{self, AlignedBuf, DioAlignmentSource, is_aligned_ptr};

use crate::random_bytes;

#[test]
fn buffers_have_the_alignment_asked_for() {
    for align in [1, 8, 64, 256, 4096, 64 * 1024, 2 * 1024 * 1024] {
        for len in [1, 1000, 4096, 300_001, 3 * 1024 * 1024 + 1] {
            let mut buf = AlignedBuf::new(len, align).expect("alloc");
            assert!(
                is_aligned_ptr(buf.as_ptr(), align),
                "len {len} align {align}"
            );
            assert_eq!((buf.len(), buf.align()), (len, align));
            assert!(
                buf.iter().all(|&b| b == 0),
                "not zeroed: len {len} align {align}"
            );
            let data = random_bytes(len, (len ^ align) as u64);
            buf.copy_from_slice(&data);
            assert!(buf[..] == data[..]);
        }
    }
}

#[test]
fn uninit_buffers_filled_by_a_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f");
    let data = random_bytes(70_000, 9);
    std::fs::write(&path, &data).expect("write");
    // SAFETY: the read below writes every byte before any is read.
    let mut buf = unsafe { AlignedBuf::new_uninit(70_000, 512) }.expect("alloc");
    std::fs::File::open(&path)
        .expect("open")
        .read_exact_at(&mut buf, 0)
        .expect("read");
    assert!(buf[..] == data[..]);
}

#[test]
fn bad_sizes_and_alignments() {
    assert!(matches!(
        AlignedBuf::new(0, 64),
        Err(Error::ZeroLength { .. })
    ));
    let err = AlignedBuf::new(64, 48).unwrap_err();
    assert!(
        matches!(err, Error::InvalidAlignment { align: 48 }),
        "{err:?}"
    );
    assert!(err.to_string().contains("power of two"));
    assert!(matches!(
        AlignedBuf::new(64, 0),
        Err(Error::InvalidAlignment { .. })
    ));
    assert!(matches!(
        AlignedBuf::new(usize::MAX - 10, 4096),
        Err(Error::OutOfMemory { .. })
    ));
}

#[test]
fn dio_alignment_is_what_o_direct_accepts() {
    // A temporary directory on a disk file system (not tmpfs), next to the build.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("direct.bin");
    let data = random_bytes(1 << 20, 11);
    std::fs::write(&path, &data).expect("write");
    let file = std::fs::File::open(&path).expect("open");
    let dio = align::dio_alignment(&file).expect("dio alignment");
    eprintln!("dio alignment here: {dio:?}");
    if !dio.supported() {
        gpufeed_testkit::skip(
            "the O_DIRECT read",
            &format_args!("the file system under {} refuses O_DIRECT", path.display()),
        );
        return;
    }
    assert!(dio.mem_align.is_power_of_two() && dio.offset_align.is_power_of_two());
    if dio.source != DioAlignmentSource::Statx {
        eprintln!("note: statx DIOALIGN unavailable, used {:?}", dio.source);
    }
    let direct = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) => panic!("dio_alignment said supported but O_DIRECT open failed: {e}"),
    };
    let off = dio.offset_align as usize;
    let len = 16 * off;
    let mut buf = AlignedBuf::new(len, dio.mem_align as usize).expect("alloc");
    direct
        .read_exact_at(&mut buf, off as u64)
        .expect("an O_DIRECT read at the reported alignment works");
    assert!(buf[..] == data[off..off + len]);
}
