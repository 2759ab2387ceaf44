//! Project tasks, run as `cargo xtask <task>`:
//!
//! - `bench [ARGS]` — builds the harness in release mode and runs it (the main job); ARGS go to
//!   `gpufeed-bench` (`--size`, `--batch`, `--reps`, `--json`, `--dir`; see `--help`).
//! - `ci` — runs `.ci/run`, exactly what CI runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let task = args.next();
    let rest: Vec<String> = args.collect();
    let root = workspace_root();
    match task.as_deref() {
        Some("bench") => bench(&root, &rest),
        Some("ci") => run(Command::new("bash")
            .arg(root.join(".ci/run"))
            .current_dir(&root)),
        Some("-h" | "--help") | None => {
            println!(
                "usage: cargo xtask <task>\n\n  bench [ARGS]  build and run the benchmark harness (ARGS: see `cargo xtask bench --help`)\n  ci            run .ci/run, exactly what CI runs"
            );
            Ok(())
        }
        Some(other) => bail!("unknown task {other:?}; try `cargo xtask --help`"),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn bench(root: &Path, args: &[String]) -> Result<()> {
    run(cargo()
        .args([
            "build",
            "--release",
            "--package",
            "gpufeed-benches",
            "--bin",
            "gpufeed-bench",
        ])
        .current_dir(root))?;
    let target = target_dir(root);
    let mut cmd = Command::new(target.join("release/gpufeed-bench"));
    if !args.iter().any(|a| a == "--dir" || a.starts_with("--dir=")) {
        cmd.arg("--dir").arg(target.join("gpufeed-bench"));
    }
    run(cmd.args(args).current_dir(root))
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("could not start {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{:?} failed: {status}", cmd.get_program());
    }
    Ok(())
}
