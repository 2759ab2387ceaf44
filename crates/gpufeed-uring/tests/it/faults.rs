//! Injected faults: every recoverable one is absorbed; EIO is reported; bytes stay exact.

use gpufeed_uring::{Backend, Direct, Error, FaultPlan, ReadOp, Reader};

use crate::{backends, disk_file, read_odd_requests, seed};

fn faulty(backend: Backend, direct: Direct, plan: FaultPlan) -> Reader {
    Reader::builder()
        .backend(backend)
        .direct(direct)
        .queue_depth(8)
        .block_bytes(64 * 1024)
        .fault_injection(plan)
        .build()
        .expect("build")
}

#[test]
fn short_reads_eintr_eagain_reordering_are_absorbed() {
    let seed = seed("recoverable faults");
    let (_dir, path, data) = disk_file(3 * 1024 * 1024 + 17, seed);
    for backend in backends() {
        for direct in [Direct::On, Direct::Off] {
            let mut r = faulty(backend, direct, FaultPlan::recoverable(seed));
            let file = r.open(&path).expect("open");
            let what = format!("seed {seed} {backend:?} {direct:?}");
            read_odd_requests(&mut r, file, &data, 10_000, 40, &what);
            let s = r.stats();
            assert!(
                s.retries > 0,
                "seed {seed}: no EINTR/EAGAIN was injected: {s:?}"
            );
            assert!(
                s.short_reads > 0,
                "seed {seed}: no short read was injected: {s:?}"
            );
        }
    }
}

#[test]
fn eio_fails_the_request_and_only_it() {
    let seed = seed("eio");
    let (_dir, path, data) = disk_file(1 << 20, seed);
    for backend in backends() {
        let plan = FaultPlan {
            eio: 0.3,
            ..FaultPlan::none(seed)
        };
        let mut r = faulty(backend, Direct::Off, plan);
        let file = r.open(&path).expect("open");
        let (mut failed, mut ok) = (0, 0);
        let ops = (0..50u64).map(|i| ReadOp::new(file, i * 20_000, vec![0u8; 4096]));
        r.read_all(ops, |c| match &c.result {
            Ok(n) => {
                let off = c.offset as usize;
                assert!(c.buf[..*n] == data[off..off + n]);
                ok += 1;
            }
            Err(Error::Read { source, offset, .. }) => {
                assert_eq!(source.raw_os_error(), Some(libc::EIO));
                assert!(*offset >= c.offset && *offset < c.offset + 4096);
                failed += 1;
            }
            Err(other) => panic!("seed {seed}: unexpected {other}"),
        })
        .expect("the backend itself works");
        assert!(
            failed > 0 && ok > 0,
            "seed {seed}: {failed} failed, {ok} ok"
        );
        let msg = Error::Read {
            path: path.clone(),
            offset: 0,
            source: std::io::Error::from_raw_os_error(libc::EIO),
        }
        .to_string();
        assert!(
            msg.contains("data.bin") && msg.contains("offset 0"),
            "{msg}"
        );
    }
}

/// `O_DIRECT` refused with `EINVAL` at open (some file systems accept `O_DIRECT` in statx but
/// not at open; this kernel's ext4 and tmpfs never take that path, so it is injected):
/// `Direct::Auto` reads the file buffered and records why; `Direct::On` refuses the file.
#[test]
fn o_direct_refused_at_open_reads_buffered_with_the_reason() {
    let seed = seed("direct open einval");
    let (_dir, path, data) = disk_file((3 << 20) + 77, seed);
    for backend in backends() {
        let plan = FaultPlan {
            direct_open_einval: true,
            ..FaultPlan::none(seed)
        };
        gpufeed_os::cache::evict(&path).expect("evict: Auto would choose O_DIRECT");
        let mut r = faulty(backend, Direct::Auto, plan.clone());
        let file = r.open(&path).expect("open");
        let report = &r.stats().files[0];
        assert!(!report.direct, "{backend:?}: {report:?}");
        assert_eq!(
            report.reason.as_deref(),
            Some("open with O_DIRECT returned EINVAL (the file system refuses it)"),
            "{backend:?}"
        );
        let mut buf = vec![0u8; data.len() - 5];
        r.read_exact_at(file, 5, &mut buf).expect("buffered read");
        assert!(buf[..] == data[5..], "{backend:?}: bytes differ");

        let mut on = faulty(backend, Direct::On, plan);
        let err = on.open(&path).unwrap_err();
        assert!(
            matches!(&err, Error::DirectUnsupported { reason, .. } if reason.contains("EINVAL")),
            "{backend:?}: {err:?}"
        );
    }
}
