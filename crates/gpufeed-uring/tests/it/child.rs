//! Child processes: the test binary re-runs itself with `GPUFEED_IT_CHILD=<role>` and only the
//! `child::entry` test. Without the variable `entry` returns at once (a dispatcher, not a test).

use gpufeed_uring::{Backend, BackendKind, Error, Probe, Reader, Refused, UringUnavailable};

use crate::disk_file;

const ROLE: &str = gpufeed_testkit::CHILD_ROLE;

pub fn run(role: &str) -> String {
    gpufeed_testkit::run_child("child::entry", role, &[])
}

/// Installs a seccomp filter on this thread (and the threads it starts) that makes
/// `io_uring_setup` fail with EPERM, as Docker's default profile does.
fn refuse_io_uring_setup() {
    const IO_URING_SETUP: u32 = 425; // the same number on every architecture
    let filter = [
        // A = seccomp_data.nr
        libc::sock_filter {
            code: 0x20,
            jt: 0,
            jf: 0,
            k: 0,
        },
        // if A == io_uring_setup, fall through to ERRNO, else skip to ALLOW
        libc::sock_filter {
            code: 0x15,
            jt: 0,
            jf: 1,
            k: IO_URING_SETUP,
        },
        libc::sock_filter {
            code: 0x06,
            jt: 0,
            jf: 0,
            k: 0x0005_0000 | libc::EPERM as u32,
        },
        libc::sock_filter {
            code: 0x06,
            jt: 0,
            jf: 0,
            k: 0x7fff_0000,
        },
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: plain prctl calls; `prog` points to a valid filter for the duration of the call.
    unsafe {
        assert_eq!(
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
            0,
            "no_new_privs"
        );
        let rc = libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &prog as *const _,
        );
        assert_eq!(rc, 0, "seccomp: {}", std::io::Error::last_os_error());
    }
}

#[test]
fn entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        "probe-override" => {
            let (_dir, path, data) = disk_file(200_000, 4);
            let mut r = Reader::builder()
                .probe_override(Probe::uring_unavailable("test: pretend seccomp"))
                .build()
                .expect("Auto falls back");
            assert!(matches!(
                r.backend(),
                gpufeed_uring::BackendKind::Threads(_)
            ));
            assert!(
                r.stats()
                    .fallbacks
                    .iter()
                    .any(|f| f.refused == Refused::IoUring && f.reason.contains("pretend seccomp")),
                "{:?}",
                r.stats().fallbacks
            );
            let file = r.open(&path).expect("open");
            let mut buf = vec![0u8; 100_000];
            r.read_exact_at(file, 1, &mut buf).expect("read");
            assert!(buf[..] == data[1..100_001]);

            let err = Reader::builder()
                .backend(Backend::IoUring)
                .probe_override(Probe::uring_unavailable("test"))
                .build()
                .unwrap_err();
            assert!(matches!(err, Error::BackendUnavailable { .. }), "{err:?}");
            println!("CHILD-OK");
        }
        "seccomp" => {
            refuse_io_uring_setup();
            let probe = Backend::probe();
            let sysctl =
                std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").unwrap_or_default();
            if sysctl.trim() == "0" || sysctl.is_empty() {
                assert_eq!(probe.io_uring, Err(UringUnavailable::Seccomp(libc::EPERM)));
            }
            let why = probe.io_uring.expect_err("refused").to_string();
            let mut r = Reader::builder()
                .build()
                .expect("Auto falls back to threads");
            assert!(matches!(r.backend(), BackendKind::Threads(_)));
            assert!(
                r.stats()
                    .fallbacks
                    .iter()
                    .any(|f| f.refused == Refused::IoUring && f.reason == why),
                "{:?}",
                r.stats().fallbacks
            );
            let (_dir, path, data) = crate::disk_file(300_000, 5);
            let file = r.open(&path).expect("open");
            let mut buf = vec![0u8; 250_000];
            r.read_exact_at(file, 3, &mut buf)
                .expect("read with threads");
            assert!(buf[..] == data[3..250_003]);
            let err = Reader::builder()
                .backend(Backend::IoUring)
                .build()
                .unwrap_err();
            assert!(err.to_string().contains("seccomp"), "{err}");
            println!("CHILD-OK {why}");
        }
        other => panic!("unknown role {other}"),
    }
}
