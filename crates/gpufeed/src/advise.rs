//! `advise`: the source material's selection tree for where data should live, with its
//! reasons and weights, plus the path to the GPU and the settings; `measure` ranks the
//! candidates by short trials on this machine.

use std::path::Path;

/// What the data is and how it is used.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Workload {
    /// Must the data outlive the processes (a data set on disk, checkpoints)?
    pub persistent: bool,
    /// Processes that read it at once.
    pub processes: usize,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// Share of it in the page cache now, where known (from a path).
    pub resident: Option<f64>,
}

/// One storage option with its weighted score.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Scored {
    /// The option.
    pub option: &'static str,
    /// Weighted score, 0 to 1.
    pub score: f64,
}

/// What to do.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Recommendation {
    /// Where the data should live.
    pub storage: &'static str,
    /// The tree's path to it.
    pub reasons: Vec<String>,
    /// Every option scored with the weights volatility 40%, sharing 30%, size 20%, development
    /// complexity 10%.
    pub scores: Vec<Scored>,
    /// How it reaches the GPU (a gpufeed strategy) and why.
    pub transfer: String,
    /// Settings to use, each with its reason.
    pub settings: Vec<String>,
}

const OPTIONS: [&str; 4] = [
    "mmap(MAP_SHARED)",
    "file IO + page-cache tuning",
    "mmap(MAP_PRIVATE)",
    "shared memory + synchronization",
];

/// The selection tree of the source material, with its reasons.
pub fn advise(w: &Workload) -> Recommendation {
    let ram = gpufeed_os::SystemInfo::read().mem_total.unwrap_or(0);
    let large = ram > 0 && w.size_bytes > ram / 2;
    let shared = w.processes > 1;
    let mut reasons = vec![format!(
        "must the data persist? {}",
        if w.persistent { "yes" } else { "no" }
    )];
    let storage = if w.persistent {
        reasons.push(format!(
            "shared by several processes? {} ({} process(es))",
            if shared { "yes" } else { "no" },
            w.processes
        ));
        if shared { OPTIONS[0] } else { OPTIONS[1] }
    } else {
        reasons.push(format!(
            "larger than 50% of RAM? {} ({} of {} bytes)",
            if large { "yes" } else { "no" },
            w.size_bytes,
            ram
        ));
        if large { OPTIONS[2] } else { OPTIONS[3] }
    };
    // Suitability of each option per criterion (volatility, sharing, size, simplicity).
    let suit = |o: &str| -> [f64; 4] {
        let persist = if w.persistent { 1.0 } else { 0.3 };
        let volatile = 1.0 - persist + 0.3;
        match o {
            "mmap(MAP_SHARED)" => [
                persist,
                if shared { 1.0 } else { 0.5 },
                if large { 0.8 } else { 0.6 },
                0.7,
            ],
            "file IO + page-cache tuning" => [
                persist,
                if shared { 0.4 } else { 0.9 },
                if large { 0.6 } else { 0.7 },
                1.0,
            ],
            "mmap(MAP_PRIVATE)" => [
                volatile,
                if shared { 0.3 } else { 0.7 },
                if large { 1.0 } else { 0.4 },
                0.8,
            ],
            _ => [
                volatile,
                if shared { 1.0 } else { 0.6 },
                if large { 0.2 } else { 1.0 },
                0.4,
            ],
        }
    };
    let mut scores: Vec<Scored> = OPTIONS
        .iter()
        .map(|&o| {
            let s = suit(o);
            Scored {
                option: o,
                score: 0.4 * s[0] + 0.3 * s[1] + 0.2 * s[2] + 0.1 * s[3],
            }
        })
        .collect();
    scores.sort_by(|a, b| b.score.total_cmp(&a.score));
    let cached = w.resident.unwrap_or(0.0);
    let transfer = if cached >= 0.9 {
        format!(
            "Strategy::Staged (auto): {:.0}% cached; copies out of the page cache into pinned staging on every core",
            cached * 100.0
        )
    } else if cached < 0.1 || large {
        "Strategy::Direct (auto): not cached (or larger than half the RAM): O_DIRECT reads into pinned staging".to_owned()
    } else {
        format!(
            "Strategy::Staged (auto): {:.0}% cached; buffered reads",
            cached * 100.0
        )
    };
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let settings = vec![
        format!(
            "pinned staging budget: {} bytes (a quarter of RAM, the pool's default)",
            ram / 4
        ),
        format!(
            "fill threads: {} (every core, up to 16), 4 MiB chunks",
            cores.clamp(2, 16)
        ),
        "io_uring queue depth 8 per thread, 1 MiB reads; 32 for O_DIRECT scans".to_owned(),
        if shared {
            "several readers: keep the data set in the page cache once (mmap/MAP_SHARED or gpufeed-ipc's BatchRing) instead of one copy per process".to_owned()
        } else {
            "one reader: a BatchLoader with worker threads and prefetch 2 (double buffering)"
                .to_owned()
        },
    ];
    Recommendation {
        storage,
        reasons,
        scores,
        transfer,
        settings,
    }
}

/// A measured candidate.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Trial {
    /// What ran.
    pub name: String,
    /// GB/s, or why it could not run.
    pub gbps: Result<f64, String>,
}

/// Short trials of the ways to move `path` (up to `limit` bytes of it) on this machine, best
/// first: every load strategy when a GPU is present, else the host-side reads.
pub fn measure(path: &Path, limit: u64) -> crate::Result<Vec<Trial>> {
    let len = std::fs::metadata(path)
        .map_err(|_| gpufeed_os::Error::NotFound { path: path.into() })?
        .len()
        .min(limit);
    let mut trials = Vec::new();
    match gpufeed_cuda::Gpu::open(0) {
        Ok(gpu) => {
            for strategy in [
                crate::Strategy::Staged,
                crate::Strategy::Registered,
                crate::Strategy::Direct,
                crate::Strategy::Hybrid,
            ] {
                let opts = crate::LoadOptions {
                    strategy,
                    ..crate::LoadOptions::default()
                };
                let result = crate::Loader::new(&gpu, opts)
                    .and_then(|l| l.load_range(path, 0..len))
                    .map(|(_, r)| r.gbps())
                    .map_err(|e| e.to_string());
                trials.push(Trial {
                    name: format!("load, {strategy}"),
                    gbps: result,
                });
            }
        }
        Err(e) => {
            for (name, backend, direct) in [
                (
                    "host read, io_uring buffered",
                    gpufeed_uring::Backend::IoUring,
                    gpufeed_uring::Direct::Off,
                ),
                (
                    "host read, io_uring O_DIRECT",
                    gpufeed_uring::Backend::IoUring,
                    gpufeed_uring::Direct::On,
                ),
                (
                    "host read, thread pool buffered",
                    gpufeed_uring::Backend::Threads(0),
                    gpufeed_uring::Direct::Off,
                ),
            ] {
                trials.push(Trial {
                    name: format!("{name} (no GPU: {e})"),
                    gbps: host_read(path, len, backend, direct).map_err(|e| e.to_string()),
                });
            }
        }
    }
    trials.sort_by(|a, b| match (&a.gbps, &b.gbps) {
        (Ok(x), Ok(y)) => y.total_cmp(x),
        (Ok(_), Err(_)) => std::cmp::Ordering::Less,
        (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
        _ => std::cmp::Ordering::Equal,
    });
    Ok(trials)
}

fn host_read(
    path: &Path,
    len: u64,
    backend: gpufeed_uring::Backend,
    direct: gpufeed_uring::Direct,
) -> crate::Result<f64> {
    let mut reader = gpufeed_uring::Reader::builder()
        .backend(backend)
        .direct(direct)
        .queue_depth(16)
        .build()?;
    let file = reader.open(path)?;
    let mut buf = gpufeed_os::AlignedBuf::new((len as usize).max(1), 4096)?;
    let t = std::time::Instant::now();
    reader.read_exact_at(file, 0, &mut buf[..len as usize])?;
    Ok(len as f64 / t.elapsed().as_secs_f64() / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree() {
        let w = |persistent, processes, size_bytes| Workload {
            persistent,
            processes,
            size_bytes,
            resident: None,
        };
        assert_eq!(advise(&w(true, 4, 1 << 30)).storage, "mmap(MAP_SHARED)");
        assert_eq!(
            advise(&w(true, 1, 1 << 30)).storage,
            "file IO + page-cache tuning"
        );
        assert_eq!(
            advise(&w(false, 1, u64::MAX / 2)).storage,
            "mmap(MAP_PRIVATE)"
        );
        let r = advise(&w(false, 2, 1 << 20));
        assert_eq!(r.storage, "shared memory + synchronization");
        assert_eq!(
            r.scores[0].option, r.storage,
            "the weighted scores agree with the tree: {:?}",
            r.scores
        );
        assert_eq!(r.reasons.len(), 2);
        for case in [
            w(true, 4, 1 << 30),
            w(true, 1, 1 << 30),
            w(false, 1, u64::MAX / 2),
        ] {
            let r = advise(&case);
            assert_eq!(r.scores[0].option, r.storage, "{case:?}: {:?}", r.scores);
        }
    }
}
