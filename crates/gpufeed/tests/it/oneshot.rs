//! The one-shot API on any machine: the file's errors come before the GPU's, a missing GPU or
//! device is a clear error, and no thread is left behind (the thread opening the GPU is always
//! joined). Run in a child process, whose thread count no other test moves.

use gpufeed::load::Error;
use gpufeed::safetensors::Error as CkptError;

const DISPATCHER: &str = "oneshot::child_dispatcher";

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

/// The thread count once it is back at `want`, or after 2 s. A joined thread can still be
/// listed for a moment: `join` returns when the kernel clears its tid, before the thread is
/// removed from /proc/self/task (on a loaded machine that moment grows). A thread truly left
/// behind stays.
fn threads_settled(want: usize) -> usize {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let n = threads();
        if n == want || std::time::Instant::now() > until {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn one_shot_errors_are_clear_and_leave_no_thread() {
    let out = gpufeed_testkit::run_child(DISPATCHER, "one-shot-errors", &[]);
    assert!(out.contains("one-shot-errors: ok"), "{out}");
}

/// Runs only as the child of the test above (returns at once otherwise).
#[test]
fn child_dispatcher() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok("one-shot-errors") {
        return;
    }
    // The driver (where there is one) starts threads of its own the first time: let it, and
    // keep its context, before counting.
    let _held = gpufeed::Gpu::open(0).ok();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let file = dir.path().join("data.bin");
    std::fs::write(&file, gpufeed_testkit::random_bytes(100_003, 1)).expect("write");
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}").expect("write");
    let missing = dir.path().join("missing.safetensors");
    let before = threads();

    // GPU absent: no driver here, or no device 99 on the GPU machine.
    let err = gpufeed::load_file_on(99, &file).map(|_| ()).unwrap_err();
    assert!(err.is_no_gpu(), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("CUDA") || text.contains("GPU") || text.contains("device"),
        "{text}"
    );
    let err = gpufeed::safetensors::load_on(99, &file)
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(err, CkptError::Safetensors { .. }),
        "a file that is no checkpoint is said so first: {err:?}"
    );
    assert_eq!(
        threads_settled(before),
        before,
        "a thread was left behind after a GPU error"
    );

    // The file's errors come first, whatever the GPU.
    for ordinal in [0, 99] {
        let err = gpufeed::load_file_on(ordinal, &missing)
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(err, Error::Os(gpufeed::os::Error::NotFound { .. })),
            "{err:?}"
        );
        let err = gpufeed::load_file_on(ordinal, dir.path())
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(err, Error::Os(gpufeed::os::Error::IsDirectory { .. })),
            "{err:?}"
        );
        let err = gpufeed::safetensors::load_on(ordinal, &bad)
            .map(|_| ())
            .unwrap_err();
        match &err {
            CkptError::Safetensors { path, reason } => {
                assert_eq!(path, &bad);
                assert!(
                    matches!(reason, gpufeed::safetensors::HeaderError::NotTensors { .. }),
                    "{reason:?}"
                );
                assert!(reason.to_string().contains("header"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let err = gpufeed::safetensors::load_on(ordinal, &missing)
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(
                err,
                CkptError::Load(Error::Os(gpufeed::os::Error::NotFound { .. }))
            ),
            "{err:?}"
        );
        assert_eq!(
            threads_settled(before),
            before,
            "a thread was left behind (ordinal {ordinal})"
        );
    }
    // Loader::open alone: the GPU's error, joined.
    let err = gpufeed::Loader::open(99, gpufeed::LoadOptions::default()).unwrap_err();
    assert!(err.is_no_gpu(), "{err:?}");
    assert_eq!(threads_settled(before), before);
    println!("one-shot-errors: ok");
}
