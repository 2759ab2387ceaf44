//! The workspace's written contracts, checked against `cargo metadata`:
//!
//! - every gpufeed crate's root file (lib.rs; main.rs for the CLI) opens with
//!   `//! # <crate> — layer <n> of gpufeed`, has a paragraph starting `//! Depends on` that names
//!   (in code spans) exactly the gpufeed crates its `[dependencies]` hold, and shows an example
//!   (`# Example` followed by a code block);
//! - a crate depends only on gpufeed crates of its own layer or lower (within layer 2,
//!   `gpufeed-cuda` builds on `gpufeed-pinned`; within layer 3, `gpufeed-multi` builds on
//!   `gpufeed-safetensors` and `gpufeed-frames` on `gpufeed-data`);
//! - no crate but the bindings ([`FACADE_USERS`]: the CLI and the Python package) depends on
//!   the facade `gpufeed`: a capability crate names the crates it uses, so that a user of one
//!   capability compiles only what it needs;
//! - the workspace's `rust-version` is at least every dependency's (the features our own code
//!   uses are checked by clippy's `incompatible_msrv` lint, which reads `rust-version`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

/// What `cargo metadata --format-version 1` says (the parts used here).
#[derive(Debug, Deserialize)]
pub struct Metadata {
    pub packages: Vec<Package>,
    pub workspace_members: Vec<String>,
}

#[derive(Debug, Deserialize)]
pub struct Package {
    pub id: String,
    pub name: String,
    pub rust_version: Option<String>,
    pub manifest_path: PathBuf,
    pub dependencies: Vec<Dependency>,
    pub targets: Vec<Target>,
}

#[derive(Debug, Deserialize)]
pub struct Dependency {
    pub name: String,
    /// `None` for normal dependencies, `"dev"` or `"build"` otherwise.
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Target {
    pub kind: Vec<String>,
    pub src_path: PathBuf,
}

/// `cargo metadata` of the workspace at `root`, every feature's dependencies included.
pub fn metadata(root: &Path) -> Result<Metadata> {
    let out = crate::cargo()
        .args(["metadata", "--format-version", "1", "--all-features"])
        .current_dir(root)
        .output()
        .context("run cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("read cargo metadata's JSON")
}

/// One crate's root file, read: its layer and the gpufeed crates its `Depends on` paragraph names.
#[derive(Debug)]
struct Header {
    layer: u32,
    depends_on: BTreeSet<String>,
}

/// Reads the header of `name`'s root file `text`, or says what is missing.
fn header(name: &str, text: &str) -> std::result::Result<Header, String> {
    let first = text.lines().next().unwrap_or("");
    let prefix = format!("//! # {name} — layer ");
    let layer = first
        .strip_prefix(&prefix)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("does not open with `{prefix}<n> of gpufeed`: {first:?}"))?;
    if !first.contains(&format!("layer {layer} of gpufeed")) {
        return Err(format!("first line does not say `of gpufeed`: {first:?}"));
    }
    let docs: Vec<&str> = text
        .lines()
        .take_while(|l| l.starts_with("//!"))
        .map(|l| l.trim_start_matches("//!").trim())
        .collect();
    let start = docs
        .iter()
        .position(|l| l.starts_with("Depends on"))
        .ok_or("has no paragraph starting `Depends on`")?;
    let paragraph: Vec<&str> = docs[start..]
        .iter()
        .take_while(|l| !l.is_empty())
        .copied()
        .collect();
    // The crates named in code spans (`gpufeed-os`, `gpufeed`), every other one.
    let depends_on = paragraph
        .join(" ")
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| (*w == "gpufeed" || w.starts_with("gpufeed-")) && *w != name)
        .map(str::to_owned)
        .collect();
    let example = docs
        .iter()
        .position(|l| *l == "# Example" || *l == "# Examples")
        .ok_or("has no `# Example` section")?;
    if !docs[example..].iter().any(|l| l.starts_with("```")) {
        return Err("its `# Example` section has no code block".into());
    }
    Ok(Header { layer, depends_on })
}

/// The crates that may depend on the facade `gpufeed` (the bench harness is not checked).
pub const FACADE_USERS: [&str; 2] = ["gpufeed-cli", "gpufeed-py"];

/// A crate of the workspace depending on the facade that should not (see [`FACADE_USERS`]).
fn facade_problem(name: &str, deps: &BTreeSet<String>) -> Option<String> {
    (deps.contains("gpufeed") && !FACADE_USERS.contains(&name)).then(|| {
        format!(
            "{name} depends on the facade gpufeed: depend on the capability crates it uses \
             (gpufeed-load, gpufeed-safetensors, ...) instead"
        )
    })
}

/// Every problem with the workspace's written contracts (empty: all hold).
pub fn problems(meta: &Metadata) -> Result<Vec<String>> {
    let members: BTreeSet<&str> = meta.workspace_members.iter().map(String::as_str).collect();
    let crates: Vec<&Package> = meta
        .packages
        .iter()
        .filter(|p| members.contains(p.id.as_str()))
        .filter(|p| p.name.starts_with("gpufeed") && p.name != "gpufeed-testkit")
        .filter(|p| p.name != "gpufeed-benches")
        .collect();
    let mut problems = Vec::new();
    let mut headers = BTreeMap::new();
    for p in &crates {
        let root = p
            .targets
            .iter()
            .find(|t| {
                t.kind
                    .iter()
                    .any(|k| ["lib", "rlib", "cdylib"].contains(&k.as_str()))
            })
            .or_else(|| p.targets.iter().find(|t| t.kind.iter().any(|k| k == "bin")))
            .with_context(|| format!("{} has no lib or bin target", p.name))?;
        let text = std::fs::read_to_string(&root.src_path)
            .with_context(|| format!("read {}", root.src_path.display()))?;
        match header(&p.name, &text) {
            Ok(h) => {
                headers.insert(p.name.clone(), h);
            }
            Err(why) => problems.push(format!("{}: {why}", root.src_path.display())),
        }
    }
    for p in &crates {
        let Some(h) = headers.get(&p.name) else {
            continue;
        };
        let deps: BTreeSet<String> = p
            .dependencies
            .iter()
            .filter(|d| d.kind.is_none() && d.name.starts_with("gpufeed"))
            .map(|d| d.name.clone())
            .collect();
        if deps != h.depends_on {
            problems.push(format!(
                "{}: its docs say it depends on {:?}, its manifest {:?}",
                p.name, h.depends_on, deps
            ));
        }
        problems.extend(facade_problem(&p.name, &deps));
        for d in &deps {
            if let Some(dh) = headers.get(d)
                && dh.layer > h.layer
            {
                problems.push(format!(
                    "{} (layer {}) depends on {d} of a higher layer ({})",
                    p.name, h.layer, dh.layer
                ));
            }
        }
    }
    Ok(problems)
}

/// The workspace's `rust-version` against every package's (a dependency that needs a newer Rust
/// makes the declared minimum false).
pub fn msrv_problems(meta: &Metadata, declared: &str) -> Vec<String> {
    // "1.88" and "1.88.0" are the same version.
    let parse = |v: &str| -> Vec<u32> {
        let mut parts: Vec<u32> = v.split('.').filter_map(|x| x.parse().ok()).collect();
        parts.resize(3, 0);
        parts
    };
    let ours = parse(declared);
    meta.packages
        .iter()
        .filter_map(|p| {
            let theirs = p.rust_version.as_deref()?;
            (parse(theirs) > ours).then(|| {
                format!(
                    "{} {} needs Rust {theirs}, above rust-version {declared}",
                    p.name,
                    p.manifest_path.display()
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Metadata {
        metadata(&crate::workspace_root()).expect("cargo metadata")
    }

    #[test]
    fn every_crate_root_states_its_layer_its_dependencies_and_an_example() {
        let problems = problems(&meta()).expect("read the crates");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn rust_version_covers_every_dependency() {
        let meta = meta();
        let declared = meta
            .packages
            .iter()
            .find(|p| p.name == "gpufeed")
            .and_then(|p| p.rust_version.clone())
            .expect("the facade declares rust-version");
        let problems = msrv_problems(&meta, &declared);
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        // And the check can fail: a declared version below the newest dependency's.
        assert!(!msrv_problems(&meta, "1.60").is_empty());
    }

    #[test]
    fn only_the_bindings_depend_on_the_facade() {
        let deps = BTreeSet::from(["gpufeed".to_owned(), "gpufeed-load".to_owned()]);
        assert!(facade_problem("gpufeed-cli", &deps).is_none());
        assert!(facade_problem("gpufeed-py", &deps).is_none());
        let p = facade_problem("gpufeed-data", &deps).expect("a capability crate on the facade");
        assert!(p.contains("gpufeed-data depends on the facade"), "{p}");
        let own = BTreeSet::from(["gpufeed-load".to_owned()]);
        assert!(facade_problem("gpufeed-data", &own).is_none());
    }

    #[test]
    fn a_header_without_layer_dependencies_or_example_is_a_problem() {
        let good = "//! # gpufeed-x — layer 1 of gpufeed: x\n//!\n//! Depends on `gpufeed-os` only.\n//!\n//! # Example\n//! ```\n//! ```\n";
        let h = header("gpufeed-x", good).expect("good header");
        assert_eq!(h.layer, 1);
        assert_eq!(h.depends_on, BTreeSet::from(["gpufeed-os".to_owned()]));
        assert!(header("gpufeed-x", "//! # gpufeed-x: x\n").is_err());
        assert!(header("gpufeed-x", &good.replace("Depends on", "Uses")).is_err());
        assert!(header("gpufeed-x", &good.replace("# Example", "Example")).is_err());
    }
}
