//! The report: markdown for people (stdout and report.md), JSON for scripts (report.json).
//!
//! Each table's module renders its own rows (`limits::table`, `handoff::table`, ...,
//! `objects::table`, `images::table`, `cold::table`); this file holds the report, the machine's header, the
//! tables' order, the line of what was left out and the helpers the tables share ([`share`]).

use std::fmt::Write as _;

use serde::Serialize;

use crate::access::AccessRow;
use crate::gpu::GpuBench;
use crate::handoff::Handoff;
use crate::ipc::IpcBench;
use crate::limits::Limits;
use crate::loader::LoaderBench;
use crate::reads::Reads;
use crate::util::show_size;

#[derive(Debug, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub mem_total_bytes: Option<u64>,
    pub kernel: String,
    pub page_size: usize,
    pub thp_anon: String,
    pub shm_total_bytes: Option<u64>,
    pub dataset_fs: String,
}

impl Machine {
    pub fn read(dataset_dir: &std::path::Path) -> Self {
        let info = gpufeed_os::SystemInfo::read();
        let uname = rustix::system::uname();
        Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mem_total_bytes: info.mem_total.ok(),
            kernel: uname.release().to_string_lossy().into_owned(),
            page_size: info.page_size,
            thp_anon: info
                .thp_anon
                .map_or_else(|e| format!("unreadable: {e}"), |m| m.to_string()),
            shm_total_bytes: info.shm.ok().map(|s| s.total_bytes),
            dataset_fs: fs_type(dataset_dir),
        }
    }
}

fn fs_type(dir: &std::path::Path) -> String {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return "unknown".into();
    };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    mounts
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (dev, mnt, fs) = (w.next()?, w.next()?, w.next()?);
            dir.starts_with(mnt)
                .then(|| (mnt.len(), format!("{fs} ({dev} on {mnt})")))
        })
        .max_by_key(|(n, _)| *n)
        .map_or_else(|| "unknown".into(), |(_, s)| s)
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub tool: &'static str,
    pub machine: Machine,
    pub dataset_bytes: u64,
    pub batch_bytes: u64,
    pub reps: usize,
    pub limits: Option<Limits>,
    pub handoff: Option<Vec<Handoff>>,
    pub access: Option<Vec<AccessRow>>,
    pub reads: Option<Reads>,
    pub ipc: Option<IpcBench>,
    pub batch_loader: Option<LoaderBench>,
    pub gpu: Option<GpuBench>,
    /// Table 9: small loads.
    pub small: Option<crate::small::SmallBench>,
    /// Table 10: the Python package's checkpoint loads.
    pub python: Option<crate::python::PythonBench>,
    /// Table 11: several GPUs at once.
    pub multi: Option<crate::multi::MultiBench>,
    /// Table 12: the frame pipeline (CPU form).
    pub frames: Option<crate::frames::FramesBench>,
    /// Table 13: the hybrid training loader.
    pub hybrid: Option<crate::hybrid::HybridBench>,
    /// Table 14: objects in S3-compatible storage.
    pub objects: Option<crate::objects::ObjectsBench>,
    /// Table 15: decoded, augmented training batches of JPEGs.
    pub images: Option<crate::images::ImagesBench>,
    /// Table 16: cold loads of the GPU file by every route and KvikIO.
    pub cold: Option<crate::cold::ColdBench>,
    /// The tables this run did not select (`--only`, `--gpu-only`; tables 10 and 15 without
    /// `--peers`).
    pub left_out: Vec<&'static str>,
}

impl Report {
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(s, "# gpufeed bench — host memory and page cache\n");
        let _ = writeln!(
            s,
            "Machine: {} CPUs, {} RAM, Linux {}, page {} B, THP {}, /dev/shm {}; data set on {}.",
            m.cpus,
            m.mem_total_bytes.map_or("?".into(), show_size),
            m.kernel,
            m.page_size,
            m.thp_anon,
            m.shm_total_bytes.map_or("?".into(), show_size),
            m.dataset_fs
        );
        let _ = writeln!(
            s,
            "Every figure: median of {} repetitions (min-max in parentheses), measured in this run.\n",
            self.reps
        );

        let _ = writeln!(
            s,
            "Columns headed *source* repeat what the source material (the article gpufeed's design \
             starts from) printed for its own machine and sizes (a 512 MB batch, a 1 GB data set), \
             for comparison; they were not measured here. *x* = times the other figure of the \
             same run; *share of a limit* = a figure divided by one of this machine's limits \
             below.\n"
        );
        let memcpy = self
            .limits
            .as_ref()
            .map_or(f64::NAN, |l| l.memcpy_1_thread_gbps.median);
        if let Some(l) = &self.limits {
            crate::limits::table(&mut s, l);
        }
        if let Some(h) = &self.handoff {
            crate::handoff::table(&mut s, self.batch_bytes, memcpy, h);
        }
        if let Some(a) = &self.access {
            crate::access::table(&mut s, self.dataset_bytes, self.limits.as_ref(), a);
        }
        if let Some(r) = &self.reads {
            crate::reads::table(&mut s, self.dataset_bytes, self.limits.as_ref(), r);
        }
        // The GPU tables (4, 6, 8, 9) need the GPU machine; the host tables (1-3, 5, 7) run
        // everywhere. Printed in their numbers' order.
        let gpu_ran = self.gpu.is_some() || self.small.is_some() || self.python.is_some();
        let gpu_selected = !self.left_out.contains(&crate::Part::Gpu.tables())
            || !self.left_out.contains(&crate::Part::Small.tables());
        match &self.gpu {
            Some(g) => crate::gpu::table(&mut s, g),
            None if !gpu_ran && gpu_selected => {
                let _ = writeln!(
                    s,
                    "\n## Tables 4, 6, 8 and 9 — GPU\n\nNot measured: no GPU on this machine \
                     (they run on the GPU machine: docs/benchmarks.md)."
                );
            }
            None => {}
        }
        if let Some(i) = &self.ipc {
            crate::ipc::table(&mut s, i, memcpy);
        }
        if let Some(g) = &self.gpu {
            crate::facade::table(&mut s, &g.facade, g.pinned_limit_gbps.median);
        }
        if let Some(b) = &self.batch_loader {
            crate::loader::table(&mut s, b, self.limits.as_ref());
        }
        if let Some(g) = &self.gpu {
            crate::save::table(&mut s, &g.save);
            crate::gpu::peers_table(&mut s, g);
        }
        if let Some(v) = &self.small {
            crate::small::table(&mut s, v);
        }
        if let Some(v) = &self.python {
            crate::python::table(&mut s, v);
        }
        if let Some(v) = &self.multi {
            crate::multi::table(&mut s, v);
        }
        if let Some(v) = &self.frames {
            crate::frames::table(&mut s, v);
        }
        if let Some(v) = &self.hybrid {
            crate::hybrid::table(&mut s, v);
        }
        if let Some(v) = &self.objects {
            crate::objects::table(&mut s, v);
        }
        if let Some(v) = &self.images {
            crate::images::table(&mut s, v);
        }
        if let Some(v) = &self.cold {
            crate::cold::table(&mut s, v);
        }
        if !self.left_out.is_empty() {
            let _ = writeln!(
                s,
                "\nLeft out of this run (not selected: `--only`, `--gpu-only`; tables 10 and 15 \
                 run with `--only python` / `--only images` or `--peers`): {}.",
                self.left_out.join(", ")
            );
        }
        s
    }
}

/// `v` as a share of the limit `limit` called `of`: "87% of the disk". Above 100% the cell
/// says the limit is suspect: nothing can pass a true limit, so the limit was measured low.
pub fn share(v: f64, limit: f64, of: &str) -> String {
    let p = 100.0 * v / limit;
    if !p.is_finite() {
        "-".to_owned()
    } else if p > 100.0 {
        format!("{p:.0}% of {of}: above 100%, so {of}'s figure is suspect (measured low)")
    } else {
        format!("{p:.0}% of {of}")
    }
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn a_share_above_100_percent_says_the_limit_is_suspect() {
        assert_eq!(share(8.7, 10.0, "the disk"), "87% of the disk");
        let above = share(11.3, 10.0, "the disk");
        assert!(
            above.starts_with("113% of the disk") && above.contains("suspect"),
            "{above}"
        );
        assert_eq!(share(1.0, f64::NAN, "the disk"), "-");
        assert_eq!(share(1.0, 0.0, "the disk"), "-");
    }
}
