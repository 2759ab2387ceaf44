//! `advise`: the source material's selection tree for where data should live, with its
//! reasons and weights, plus the path to the GPU and the settings; `measure` ranks the
//! candidates by short trials on this machine.

use std::path::Path;

use gpufeed_os::units::show_size;

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

impl Workload {
    /// The workload of the file `path`: its size and the share of it in the page cache now
    /// (`None` where the kernel does not show this user the cache: advice without the cache's
    /// state rather than advice from a wrong figure).
    ///
    /// # Errors
    /// The file's (missing, not a regular file, unreadable).
    pub fn of_file(path: &Path, persistent: bool, processes: usize) -> crate::Result<Self> {
        let (size_bytes, resident) = match gpufeed_os::cache::residency(path) {
            Ok(r) => (r.file_bytes, Some(r.fraction())),
            Err(gpufeed_os::Error::ResidencyUnknown { .. }) => {
                (gpufeed_os::file::stat_regular(path)?.size, None)
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Workload {
            persistent,
            processes: processes.max(1),
            size_bytes,
            resident,
        })
    }
}

/// The selection tree of the source material, with its reasons.
pub fn advise(w: &Workload) -> Recommendation {
    let ram = gpufeed_os::SystemInfo::read().mem_total.unwrap_or(0);
    let large = ram > 0 && w.size_bytes > ram / 2;
    let shared = w.processes > 1;
    let mut reasons = vec![
        if w.persistent {
            "the data must outlive the processes that use it"
        } else {
            "the data need not outlive the processes that use it"
        }
        .to_owned(),
    ];
    let storage = if w.persistent {
        reasons.push(if shared {
            format!("{} processes read it at once", w.processes)
        } else {
            "one process reads it".to_owned()
        });
        if shared { OPTIONS[0] } else { OPTIONS[1] }
    } else {
        reasons.push(format!(
            "it is {}, {} half of the RAM ({})",
            show_size(w.size_bytes),
            if large { "more than" } else { "at most" },
            show_size(ram)
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
                // Two decimals: the weights are judgement, not measurement.
                score: ((0.4 * s[0] + 0.3 * s[1] + 0.2 * s[2] + 0.1 * s[3]) * 100.0).round()
                    / 100.0,
            }
        })
        .collect();
    scores.sort_by(|a, b| b.score.total_cmp(&a.score));
    let cached = w.resident.unwrap_or(0.0);
    let transfer = if cached >= 0.9 {
        format!(
            "staged (what `Auto` picks): {:.0}% of it is in the page cache; copies out of the cache into pinned staging on every core",
            cached * 100.0
        )
    } else if cached < 0.1 || large {
        "direct (what `Auto` picks): not in the page cache (or larger than half the RAM); O_DIRECT reads into pinned staging".to_owned()
    } else {
        format!(
            "staged (what `Auto` picks): {:.0}% of it is in the page cache; buffered reads",
            cached * 100.0
        )
    };
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let settings = vec![
        format!(
            "pinned staging budget: {} (a quarter of the RAM, the pool's default)",
            show_size(ram / 4)
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
    /// The load strategy tried (`None` for the host-side reads measured without a GPU).
    pub strategy: Option<crate::Strategy>,
    /// Median GB/s of the measured loads, when it ran.
    pub gbps: Option<f64>,
    /// Why it could not run.
    pub error: Option<String>,
}

impl Trial {
    fn of(name: String, strategy: Option<crate::Strategy>, result: crate::Result<f64>) -> Self {
        Trial {
            name,
            strategy,
            gbps: result.as_ref().ok().copied(),
            error: result.err().map(|e| e.to_string()),
        }
    }
}

/// What [`measure`] found: the trials best first, and whether the best is what `Auto` runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Measurement {
    /// Bytes each trial loaded (the start of the file).
    pub bytes: u64,
    /// Loads per trial: one discarded warm-up, then [`MEASURED_LOADS`] measured.
    pub loads_per_trial: usize,
    /// The trials, best first.
    pub trials: Vec<Trial>,
    /// What `Strategy::Auto` picks for these bytes, and why.
    pub auto: crate::Strategy,
    /// `Auto`'s reason.
    pub auto_reason: String,
    /// Whether the best trial is `Auto`'s choice (or within [`SAME_WITHIN`] of it); `None`
    /// without a GPU.
    pub agrees: Option<bool>,
    /// One sentence on the ranking against `Auto`.
    pub verdict: String,
}

/// Measured loads per trial (after one discarded warm-up); the median is reported.
pub const MEASURED_LOADS: usize = 3;

/// Trials within this share of each other rank as the same (run-to-run noise on the H200
/// machine's warm loads was 1-3%).
pub const SAME_WITHIN: f64 = 0.05;

/// The strategies a GPU trial runs, each with the facade's default options: what `Auto` would
/// run is one of them, configured the way `Auto` runs it; and cuFile (`Gds`), peer-to-peer or
/// through its compatibility mode, whichever this machine has (a trial whose loads cuFile
/// refused fails with the reason, rather than measuring the path that ran instead).
pub fn trial_options() -> Vec<crate::LoadOptions> {
    [
        crate::Strategy::Staged,
        crate::Strategy::Registered,
        crate::Strategy::Direct,
        crate::Strategy::Gds,
    ]
    .into_iter()
    .map(|strategy| crate::LoadOptions::default().with_strategy(strategy))
    .collect()
}

/// Says whether the best of `trials` (best first) agrees with `auto`, and why.
pub fn verdict(trials: &[Trial], auto: crate::Strategy) -> (Option<bool>, String) {
    let Some(best) = trials.first().filter(|t| t.strategy.is_some()) else {
        return (
            None,
            format!("no GPU trial ran: `Auto` would pick {auto} (see its reason)"),
        );
    };
    let (Some(best_s), Some(best_g)) = (best.strategy, best.gbps) else {
        return (
            Some(false),
            format!("no trial completed; `Auto` would pick {auto}"),
        );
    };
    if best_s == auto {
        return (
            Some(true),
            format!("the fastest here is {auto}, which `Auto` picks"),
        );
    }
    match trials
        .iter()
        .find(|t| t.strategy == Some(auto))
        .and_then(|t| t.gbps)
    {
        Some(g) if g >= best_g * (1.0 - SAME_WITHIN) => (
            Some(true),
            format!(
                "{best_s} measured {best_g:.1} GB/s and {auto}, `Auto`'s pick, {g:.1}: the same within the {:.0}% the trials move by",
                SAME_WITHIN * 100.0
            ),
        ),
        Some(g) => (
            Some(false),
            format!(
                "{best_s} measured {best_g:.1} GB/s, faster here than {auto} ({g:.1}), which `Auto` picks: \
                 pass `--strategy {best_s}` (LoadOptions::strategy) for this file on this machine"
            ),
        ),
        None => (
            Some(false),
            format!("{auto}, `Auto`'s pick, did not complete; {best_s} was fastest"),
        ),
    }
}

/// Trials of the ways to move the first `limit` bytes of `path` to GPU 0 on this machine, best
/// first, run as `Auto` runs them: for each strategy of [`trial_options`] a new [`crate::Loader`]
/// with the facade's default options (its staging reserved), one warm-up load discarded, then
/// [`MEASURED_LOADS`] loads whose median counts. Without a GPU, host-side reads instead. The
/// result says what `Auto` picks for the same bytes and whether the best trial agrees.
///
/// # Errors
/// A missing file, or one `Auto` cannot judge.
pub fn measure(path: &Path, limit: u64) -> crate::Result<Measurement> {
    let file = gpufeed_os::OpenedFile::open(path)?;
    let len = file.len().min(limit);
    // Judged before any trial moves the file through the page cache.
    let (auto, auto_reason) = gpufeed_load::internal::auto_choice(&file, 0..len);
    let mut trials = Vec::new();
    let mut loads_per_trial = 1 + MEASURED_LOADS;
    let mut no_gpu_reason = None;
    match gpufeed_cuda::Gpu::open(0) {
        Ok(gpu) => {
            for opts in trial_options() {
                let strategy = opts.strategy;
                let mut backend = String::new();
                // Why cuFile did not load the file, where a Gds trial's load fell back.
                let mut refused: Option<String> = None;
                let result = crate::Loader::new(&gpu, opts).and_then(|loader| {
                    let mut rates = Vec::with_capacity(MEASURED_LOADS);
                    for i in 0..=MEASURED_LOADS {
                        let (_, r) = loader.load_range(path, 0..len)?;
                        // Registered loads unregister in the background: not while the next
                        // load (or trial) runs.
                        loader.wait_for_cleanup();
                        if strategy == crate::Strategy::Gds && r.strategy != strategy {
                            let why = r
                                .fallbacks
                                .iter()
                                .find(|f| f.refused == crate::Refused::Gds)
                                .map_or_else(String::new, ToString::to_string);
                            let kind = r
                                .gds_refused
                                .map_or("refused".to_owned(), |k| format!("{k:?}").to_lowercase());
                            refused = Some(format!("cuFile did not load the file ({kind}): {why}"));
                            return Ok(0.0);
                        }
                        if let Some(b) = r.io_backend.as_ref().filter(|_| i == MEASURED_LOADS) {
                            backend = b.clone();
                        }
                        if i > 0 {
                            rates.push(r.gbps());
                        }
                    }
                    rates.sort_by(f64::total_cmp);
                    Ok(rates[rates.len() / 2])
                });
                let name = if strategy == crate::Strategy::Gds && !backend.is_empty() {
                    format!("load, gds ({backend})")
                } else {
                    format!("load, {strategy} (default options, warm loader)")
                };
                let mut trial = Trial::of(name, Some(strategy), result.map_err(crate::Error::from));
                if let Some(why) = refused {
                    trial.gbps = None;
                    trial.error = Some(why);
                }
                trials.push(trial);
            }
        }
        Err(e) => {
            loads_per_trial = 1;
            let no_gpu = e.to_string();
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
                let result = host_read(path, len, backend, direct);
                trials.push(Trial::of(name.to_owned(), None, result));
            }
            no_gpu_reason = Some(no_gpu);
        }
    }
    sort_best_first(&mut trials);
    let (agrees, verdict) = match no_gpu_reason {
        None => verdict(&trials, auto),
        Some(no_gpu) => (
            None,
            format!("no GPU ({no_gpu}): host-side reads only; `Auto` would pick {auto}"),
        ),
    };
    Ok(Measurement {
        bytes: len,
        loads_per_trial,
        trials,
        auto,
        auto_reason,
        agrees,
        verdict,
    })
}

/// Completed trials first, fastest first.
fn sort_best_first(trials: &mut [Trial]) {
    trials.sort_by(|a, b| match (a.gbps, b.gbps) {
        (Some(x), Some(y)) => y.total_cmp(&x),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        _ => std::cmp::Ordering::Equal,
    });
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
    Ok(gpufeed_os::gbps(len, t.elapsed().as_secs_f64()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Strategy;

    fn trial(strategy: Strategy, gbps: Option<f64>) -> Trial {
        Trial {
            name: strategy.to_string(),
            strategy: Some(strategy),
            gbps,
            error: gbps.is_none().then(|| "failed".to_owned()),
        }
    }

    #[test]
    fn trials_run_with_the_facade_defaults_and_cover_every_auto_choice() {
        let defaults = crate::LoadOptions::default();
        let trials = trial_options();
        for t in &trials {
            // Everything but the strategy is what a default `Loader` (and so `Auto`) uses.
            assert_eq!(
                format!("{:?}", t.clone().with_strategy(defaults.strategy)),
                format!("{defaults:?}")
            );
        }
        let strategies: Vec<Strategy> = trials.iter().map(|t| t.strategy).collect();
        // Whatever Auto picks, for any residency, is among the trials.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.bin");
        std::fs::write(&path, vec![1u8; 1 << 20]).expect("write");
        for residency in [None, Some(0.0), Some(0.5), Some(0.95), Some(1.0)] {
            let file = gpufeed_os::OpenedFile::open(&path).expect("open");
            let (auto, reason) = gpufeed_load::internal::auto_choice_at(&file, residency);
            assert!(strategies.contains(&auto), "{auto} ({reason}) not tried");
        }
        assert_eq!(
            MEASURED_LOADS % 2,
            1,
            "a median of an odd count is a measured value"
        );
    }

    #[test]
    fn the_verdict_agrees_only_when_autos_pick_is_the_best_or_as_good() {
        let ranked = |v: Vec<Trial>| {
            let mut v = v;
            sort_best_first(&mut v);
            v
        };
        let t = ranked(vec![
            trial(Strategy::Registered, Some(33.8)),
            trial(Strategy::Staged, Some(50.8)),
            trial(Strategy::Direct, Some(2.0)),
        ]);
        assert_eq!(t[0].strategy, Some(Strategy::Staged), "best first");
        assert_eq!(verdict(&t, Strategy::Staged).0, Some(true));
        let (agrees, why) = verdict(&t, Strategy::Registered);
        assert_eq!(agrees, Some(false));
        assert!(why.contains("--strategy staged"), "{why}");
        // Within the noise: the same.
        let t = ranked(vec![
            trial(Strategy::Registered, Some(51.0)),
            trial(Strategy::Staged, Some(50.0)),
        ]);
        let (agrees, why) = verdict(&t, Strategy::Staged);
        assert_eq!(agrees, Some(true), "{why}");
        // Auto's pick failed.
        let t = ranked(vec![
            trial(Strategy::Staged, None),
            trial(Strategy::Registered, Some(30.0)),
        ]);
        assert_eq!(t[0].strategy, Some(Strategy::Registered), "failures last");
        assert_eq!(verdict(&t, Strategy::Staged).0, Some(false));
        // No GPU trial at all.
        assert_eq!(verdict(&[], Strategy::Direct).0, None);
    }

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
