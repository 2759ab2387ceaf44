//! The harness runs end to end at a tiny size and writes a report whose numbers are real.

use std::process::Command;

#[test]
fn harness_runs_and_reports() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed-bench"))
        .args([
            "--size",
            "4MiB",
            "--batch",
            "1MiB",
            "--reps",
            "1",
            "--gpu-bytes",
            "64MiB",
            "--gpu-file",
            "64MiB",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .expect("run gpufeed-bench");
    assert!(
        out.status.success(),
        "gpufeed-bench failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let handoff = report["handoff"].as_array().expect("handoff rows");
    assert_eq!(handoff.len(), 2);
    for row in handoff {
        assert_eq!(row["verified_reps"], 1, "{row}");
        assert!(
            row["gbps"]["median"].as_f64().expect("number") > 0.0,
            "{row}"
        );
    }
    let access = report["access"].as_array().expect("access rows");
    assert_eq!(access.len(), 6, "3 access modes x cold/warm");
    for row in access {
        assert!(
            row["random_ms"]["median"].as_f64().expect("number") > 0.0,
            "{row}"
        );
    }
    assert!(
        report["limits"]["memcpy_1_thread_gbps"]["median"]
            .as_f64()
            .expect("number")
            > 0.0
    );
    let reads = &report["reads"];
    assert_eq!(
        reads["direct"].as_array().expect("rows").len(),
        4,
        "queue depths 1/8/32/64"
    );
    assert!(reads["warm_uring_gbps"]["median"].as_f64().expect("number") > 0.0);
    assert!(
        reads["warm_threads_gbps"]["median"]
            .as_f64()
            .expect("number")
            > 0.0
    );
    let ipc = &report["ipc"];
    assert!(
        ipc["ring_gbps"]["median"].as_f64().expect("number") > 0.0,
        "{ipc}"
    );
    assert!(
        ipc["latency_p50_us"].as_f64().expect("number") > 0.0,
        "{ipc}"
    );
    assert!(
        report["batch_loader"]["host_gbps"]["median"]
            .as_f64()
            .expect("number")
            > 0.0
    );
    let md = std::fs::read_to_string(dir.path().join("report.md")).expect("report.md");
    assert!(
        md.contains("Table 1")
            && md.contains("Table 2")
            && md.contains("Table 3")
            && md.contains("120.5 / 4.2")
            && (md.contains("Table 4") || md.contains("Tables 4, 6, 8 and 9"))
            && md.contains("Table 5")
            && md.contains("Table 7"),
        "every table (Table 4 measured, or saying there is no GPU)"
    );
    let order: Vec<usize> = md
        .lines()
        .filter_map(|l| {
            l.strip_prefix("## Table")?
                .trim_start_matches('s')
                .trim()
                .split([' ', ','])
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "tables in their numbers' order: {order:?}"
    );
    assert_no_unflagged_share_above_100(&md);
    let disk = &report["limits"]["disk"];
    assert!(
        disk.as_array().is_some_and(|ways| ways.len() >= 2),
        "the disk's limit is the best of several ways: {disk}"
    );
}

/// Every "N% of <limit>" cell of the report with N above 100 says the limit is suspect.
fn assert_no_unflagged_share_above_100(md: &str) {
    for line in md.lines() {
        for cell in line.split('|') {
            let mut rest = cell;
            while let Some(at) = rest.find("% of") {
                let digits: String = rest[..at]
                    .chars()
                    .rev()
                    .take_while(|c| c.is_ascii_digit())
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                if let Ok(p) = digits.parse::<u64>() {
                    assert!(
                        p <= 100 || cell.contains("suspect"),
                        "a share above 100% without saying the limit is suspect: {line}"
                    );
                }
                rest = &rest[at + 4..];
            }
        }
    }
}

#[test]
fn the_share_rule_catches_an_unflagged_share() {
    let caught = std::panic::catch_unwind(|| {
        assert_no_unflagged_share_above_100("| cold | 113% of the disk |");
    });
    assert!(caught.is_err(), "113% without a word passed");
    assert_no_unflagged_share_above_100("| cold | 113% of the disk: above 100%, so suspect |");
    assert_no_unflagged_share_above_100("| warm | 87% of the pinned limit |");
}

/// The selection flags say what they did: a table not selected is listed as left out (never
/// "not measured: no GPU"), a selection that leaves nothing fails, and `--gpu` checks the GPU
/// itself whichever tables are selected.
#[test]
fn selection_flags_say_what_ran_and_what_was_left_out() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let bench = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gpufeed-bench"))
            .args(["--size", "4MiB", "--batch", "1MiB", "--reps", "1"])
            .args(args)
            .arg("--dir")
            .arg(dir.path())
            .env_remove("RUST_BACKTRACE")
            .output()
            .expect("run gpufeed-bench")
    };
    let out = bench(&["--only", "limits"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = String::from_utf8_lossy(&out.stdout);
    assert!(!md.contains("Not measured: no GPU"), "{md}");
    assert!(
        md.contains("Left out of this run") && md.contains("tables 4, 6 and 8 (gpu)"),
        "{md}"
    );
    let out = bench(&["--only", "limits", "--gpu-only"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no table is selected"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // `--gpu` fails exactly when there is no GPU, before any table runs.
    let out = bench(&["--only", "limits", "--gpu", "--json"]);
    let has_gpu = gpufeed::Gpu::count().is_ok_and(|n| n > 0);
    assert_eq!(
        out.status.success(),
        has_gpu,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if !has_gpu {
        assert!(String::from_utf8_lossy(&out.stderr).contains("--gpu: no GPU is usable here"));
    }
}
