//! Several GPUs at once: one host budget shared out between them, sharded loads (each GPU its
//! own bytes: a share of the files, or its slice of every tensor) and replicated loads (each
//! GPU reads 1/N of a file over its own PCIe link and gets the rest from the other GPUs over
//! their peer links, NVLink where there is one, while it reads) — in one process
//! ([`MultiLoader`]) or one process per GPU as `torchrun` starts them ([`RankLoader`]).
//!
//! # Example
//! ```no_run
//! use gpufeed::multi::{MultiLoader, ShardPlan};
//! let multi = MultiLoader::open(&[0, 1], gpufeed::LoadOptions::for_gpus(2))?;
//! // Every GPU gets the whole file; each reads half of it.
//! let (copies, report) = multi.load_replicated("model.bin")?;
//! println!("{} copies in {:.0} ms", copies.len(), report.seconds * 1e3);
//! // Each GPU gets its share of the shards.
//! let plan = ShardPlan::file_per_rank(&["a.bin", "b.bin", "c.bin"], multi.len())?;
//! let (shares, report) = multi.load_sharded(&plan)?;
//! println!("{:.1} GB/s in all", report.read_gbps());
//! # Ok::<(), gpufeed::Error>(())
//! ```

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use gpufeed_cuda::cudarc::driver::CudaViewMut;
use gpufeed_cuda::{ContextGuard, DeviceAlloc, Gpu, PeerFanout, PeerLink};

use crate::error::{Error, Result};
use crate::load::{
    DeviceBuffer, LoadOptions, LoadReport, Loader, Strategy, check_unchanged, file_len,
};
use crate::safetensors::{self, Checkpoint, TensorParallel};

/// Rank boundaries of a split fall on multiples of this (so `O_DIRECT` reads of a share stay
/// aligned and no two GPUs read the same page).
const ALIGN: u64 = 4096;

/// Bytes each GPU of a replicated load reads per round before sending them to its peers: the
/// peer copies of a round overlap the reads of the next, and the last round's (a few ms over
/// NVLink) is all that is left after the reads. Each round costs about a millisecond more than
/// its bytes (16 GiB on two H200s: 0.32 s in rounds of 64 MiB, 0.21 s of 256 MiB, 0.19 s of
/// 1 GiB and of 4 GiB; docs/benchmarks.md, GPU run 45).
const ROUND_BYTES: u64 = 1 << 30;
/// How long a dropped [`RankLoader`] with shared staging waits for the other ranks to let go
/// of its slots (see its `Drop`).
const LET_GO_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long the ranks' NCCL communicator may take to come up while every rank lives.
const NCCL_SETUP_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// A piece of a sharded load: bytes `range` of file `file` of the plan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Span {
    /// Index into [`ShardPlan::files`].
    pub file: usize,
    /// Byte range in that file.
    pub range: Range<u64>,
}

/// Which bytes each GPU (rank) of a sharded load gets: for every rank a list of [`Span`]s,
/// loaded back to back in that order into one device buffer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShardPlan {
    files: Vec<PathBuf>,
    lens: Vec<u64>,
    ranks: Vec<Vec<Span>>,
}

impl ShardPlan {
    /// The files read one after another as one stream of bytes, cut into `ranks` contiguous
    /// shares of nearly equal size (boundaries on 4 KiB multiples of the stream): for one
    /// large file or a set of shards that every GPU should share evenly.
    ///
    /// # Errors
    /// A missing or unreadable file; [`Error::InvalidSetting`] for no ranks.
    pub fn split_bytes(files: &[impl AsRef<Path>], ranks: usize) -> Result<Self> {
        let (files, lens) = stat_all(files, ranks)?;
        let total: u64 = lens.iter().sum();
        let shares = Self::split_len(total, ranks);
        let bounds: Vec<u64> = std::iter::once(0)
            .chain(shares.iter().map(|s| s.end))
            .collect();
        let mut plan = Vec::with_capacity(ranks);
        for w in bounds.windows(2) {
            let (lo, hi) = (w[0], w[1]);
            let mut spans = Vec::new();
            let mut at = 0u64;
            for (file, &len) in lens.iter().enumerate() {
                let (a, b) = (lo.max(at), hi.min(at + len));
                if a < b {
                    spans.push(Span {
                        file,
                        range: a - at..b - at,
                    });
                }
                at += len;
            }
            plan.push(spans);
        }
        Ok(ShardPlan {
            files,
            lens,
            ranks: plan,
        })
    }

    /// Whole files shared out between `ranks`: the largest first, each to the rank with the
    /// fewest bytes so far (the lowest rank on a tie), each rank's files in the given order.
    /// For data stored a file per rank, or many shards.
    ///
    /// # Errors
    /// As [`ShardPlan::split_bytes`].
    pub fn file_per_rank(files: &[impl AsRef<Path>], ranks: usize) -> Result<Self> {
        let (files, lens) = stat_all(files, ranks)?;
        let mut order: Vec<usize> = (0..files.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
        let mut load = vec![0u64; ranks];
        let mut owner = vec![0usize; files.len()];
        for i in order {
            let r = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            load[r] += lens[i];
            owner[i] = r;
        }
        let ranks = (0..ranks)
            .map(|r| {
                (0..files.len())
                    .filter(|&i| owner[i] == r && lens[i] > 0)
                    .map(|i| Span {
                        file: i,
                        range: 0..lens[i],
                    })
                    .collect()
            })
            .collect();
        Ok(ShardPlan { files, lens, ranks })
    }

    /// A plan of your own: `ranks[r]` is rank r's spans of `files`.
    ///
    /// # Errors
    /// A missing file; [`Error::InvalidSetting`] for a span naming no file, or past the end of
    /// its file, and for no ranks.
    pub fn from_spans(files: &[impl AsRef<Path>], ranks: Vec<Vec<Span>>) -> Result<Self> {
        let (files, lens) = stat_all(files, ranks.len())?;
        for (r, spans) in ranks.iter().enumerate() {
            for s in spans {
                let Some(&len) = lens.get(s.file) else {
                    return Err(Error::InvalidSetting(format!(
                        "rank {r}: a span of file {} of {}",
                        s.file,
                        files.len()
                    )));
                };
                if s.range.start > s.range.end || s.range.end > len {
                    return Err(Error::InvalidSetting(format!(
                        "rank {r}: span {:?} of {} ({len} bytes) is not inside the file",
                        s.range,
                        files[s.file].display()
                    )));
                }
            }
        }
        Ok(ShardPlan { files, lens, ranks })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The files.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The files' lengths when the plan was made.
    pub fn file_lens(&self) -> &[u64] {
        &self.lens
    }

    /// Rank `rank`'s spans (empty past the last rank).
    pub fn spans(&self, rank: usize) -> &[Span] {
        self.ranks.get(rank).map_or(&[], Vec::as_slice)
    }

    /// Bytes rank `rank` loads.
    pub fn bytes(&self, rank: usize) -> u64 {
        self.spans(rank)
            .iter()
            .map(|s| s.range.end - s.range.start)
            .sum()
    }
}

/// The files' lengths, checking that there is at least one rank.
fn stat_all(files: &[impl AsRef<Path>], ranks: usize) -> Result<(Vec<PathBuf>, Vec<u64>)> {
    if ranks == 0 {
        return Err(Error::InvalidSetting(
            "a shard plan needs at least one rank".into(),
        ));
    }
    let paths: Vec<PathBuf> = files.iter().map(|f| f.as_ref().to_path_buf()).collect();
    let lens = paths.iter().map(|p| file_len(p)).collect::<Result<_>>()?;
    Ok((paths, lens))
}

/// What a load onto several GPUs did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MultiReport {
    /// The GPUs' ordinals, in the loader's order.
    pub gpus: Vec<usize>,
    /// Bytes each GPU read from the host over its own PCIe link.
    pub read_bytes: Vec<u64>,
    /// Bytes each GPU received from the other GPUs (replicated loads).
    pub peer_bytes: Vec<u64>,
    /// Wall seconds from the call until every GPU held its bytes.
    pub seconds: f64,
    /// Seconds each GPU's part took (its reads, and for a replicated load the peer copies it
    /// sent).
    pub gpu_seconds: Vec<f64>,
    /// Each GPU's load reports.
    pub loads: Vec<Vec<LoadReport>>,
}

impl MultiReport {
    /// GB/s read from the host, all GPUs together.
    pub fn read_gbps(&self) -> f64 {
        gpufeed_os::gbps(self.read_bytes.iter().sum(), self.seconds)
    }

    /// GB/s arriving on the GPUs, all together (reads and peer copies): for a replicated load,
    /// N times the file's bytes over the time.
    pub fn delivered_gbps(&self) -> f64 {
        let delivered = self.read_bytes.iter().sum::<u64>() + self.peer_bytes.iter().sum::<u64>();
        gpufeed_os::gbps(delivered, self.seconds)
    }
}

/// Loads onto several GPUs at once: one [`Loader`] per GPU, sized together from one host
/// budget ([`LoadOptions::for_gpus`]), with peer access enabled between every pair of GPUs that
/// allows it.
pub struct MultiLoader {
    loaders: Vec<Loader>,
    links: Vec<PeerLink>,
    notes: Vec<String>,
    round_bytes: u64,
    /// Test hook, not API: replicated loads skip their peer copies (each GPU then holds only
    /// its own share), to time the reads of a replicated load alone.
    skip_peer_copies: bool,
}

impl std::fmt::Debug for MultiLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiLoader")
            .field("gpus", &self.ordinals())
            .field("links", &self.links)
            .finish()
    }
}

impl MultiLoader {
    /// A loader over `gpus` (distinct GPUs), each GPU's [`Loader`] made with `opts` (their
    /// staging reserved in parallel). Give it [`LoadOptions::for_gpus`]`(gpus.len())`: the
    /// host's cores shared out between the GPUs; [`LoadOptions::default`] on each of several
    /// GPUs sizes every loader for the whole host, and they fight over its cores and memory
    /// bandwidth.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] for no GPU or a GPU given twice; [`Loader::new`]'s.
    pub fn new(gpus: &[Gpu], opts: LoadOptions) -> Result<Self> {
        let _keep = ContextGuard::new();
        let ordinals: Vec<usize> = gpus.iter().map(|g| g.info().ordinal).collect();
        check_ordinals(&ordinals)?;
        let strategy = opts.strategy;
        let loaders = in_parallel(gpus, "a thread setting up a GPU's loader", |_, g: &Gpu| {
            Loader::new(g, opts.clone())
        })?;
        Self::with_loaders(loaders, strategy)
    }

    /// Opens GPUs `ordinals` (their contexts created in parallel: 120-580 ms each on the H200
    /// machine) and makes a loader over them, as [`MultiLoader::new`].
    ///
    /// # Errors
    /// [`MultiLoader::new`]'s and [`Gpu::open`]'s (no driver, no such device).
    pub fn open(ordinals: &[usize], opts: LoadOptions) -> Result<Self> {
        let _keep = ContextGuard::new();
        check_ordinals(ordinals)?;
        let strategy = opts.strategy;
        let loaders = in_parallel(ordinals, "a thread opening a GPU", |_, &o: &usize| {
            Loader::open(o, opts.clone())
        })?;
        Self::with_loaders(loaders, strategy)
    }

    /// Enables peer access between every pair that allows it and notes what will be slow.
    fn with_loaders(loaders: Vec<Loader>, strategy: Strategy) -> Result<Self> {
        let mut notes = Vec::new();
        let links = if loaders.len() > 1 {
            Gpu::peer_links()?
                .into_iter()
                .filter(|l| {
                    loaders.iter().any(|x| x.gpu().info().ordinal == l.from)
                        && loaders.iter().any(|x| x.gpu().info().ordinal == l.to)
                })
                .collect()
        } else {
            Vec::new()
        };
        for a in &loaders {
            for b in &loaders {
                let (x, y) = (a.gpu().info().ordinal, b.gpu().info().ordinal);
                if x == y {
                    continue;
                }
                match a.gpu().enable_peer_access(b.gpu()) {
                    Ok(true) => {}
                    Ok(false) => notes.push(format!(
                        "GPU {x} cannot reach GPU {y} as a peer: copies between them go through host memory"
                    )),
                    Err(e) => notes.push(format!(
                        "enabling peer access from GPU {x} to GPU {y} failed ({e}): copies between them go through host memory"
                    )),
                }
            }
        }
        if strategy == Strategy::Registered && loaders.len() > 1 {
            notes.push(
                "Strategy::Registered on several GPUs: the driver serializes cuMemHostRegister \
                 across GPUs (22 GB/s in all on two H200s, against 85 staged); Auto stages"
                    .to_owned(),
            );
        }
        Ok(MultiLoader {
            loaders,
            links,
            notes,
            round_bytes: ROUND_BYTES,
            skip_peer_copies: false,
        })
    }

    /// Test hook, not API: replicated loads without their peer copies (the bench times the
    /// reads of a replicated load alone with it). The buffers then hold only each GPU's share.
    #[doc(hidden)]
    pub fn testing_skip_peer_copies(mut self, skip: bool) -> Self {
        self.skip_peer_copies = skip;
        self
    }

    /// This loader with replicated loads sending their shares to the other GPUs every `bytes`
    /// read (default 1 GiB, at least 1 MiB): smaller rounds start the peer copies sooner and
    /// leave less to copy after the last read, at a fixed cost per round.
    pub fn with_round_bytes(mut self, bytes: u64) -> Self {
        self.round_bytes = bytes.max(1 << 20);
        self
    }

    /// The loaders, one per GPU, in order.
    pub fn loaders(&self) -> &[Loader] {
        &self.loaders
    }

    /// The number of GPUs.
    pub fn len(&self) -> usize {
        self.loaders.len()
    }

    /// Whether it has no GPU (never: [`MultiLoader::new`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.loaders.is_empty()
    }

    /// The GPUs' ordinals, in order.
    pub fn ordinals(&self) -> Vec<usize> {
        self.loaders
            .iter()
            .map(|l| l.gpu().info().ordinal)
            .collect()
    }

    /// The links between its GPUs, as the driver reports them.
    pub fn links(&self) -> &[PeerLink] {
        &self.links
    }

    /// What will run slower than it could (GPUs that are not peers, registration on several
    /// GPUs).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Loads each rank's spans of `plan` onto GPU `rank` of this loader, all GPUs at once: one
    /// device buffer per GPU, its spans back to back.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] when the plan's ranks are not this loader's GPUs; the error of
    /// [`Loader::load_spans`] of the first GPU (in order) that failed.
    pub fn load_sharded(&self, plan: &ShardPlan) -> Result<(Vec<DeviceBuffer>, MultiReport)> {
        check_ranks(plan.ranks(), self.len(), "on a loader of")?;
        let started = Instant::now();
        let parts = self.each(|rank, loader| {
            let t = Instant::now();
            let (buf, reports) = load_rank(loader, plan, rank)?;
            Ok((buf, reports, t.elapsed().as_secs_f64()))
        })?;
        let mut report = self.report(started);
        let mut bufs = Vec::with_capacity(parts.len());
        for (rank, (buf, reports, secs)) in parts.into_iter().enumerate() {
            report.read_bytes[rank] = buf.len() as u64;
            report.gpu_seconds[rank] = secs;
            report.loads[rank] = reports;
            bufs.push(buf);
        }
        Ok((bufs, report))
    }

    /// Loads a tensor-parallel plan of a checkpoint, rank `r` onto GPU `r` of this loader, all
    /// GPUs at once ([`safetensors::load_shard`] on each).
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] when the plan's ranks are not this loader's GPUs; the first
    /// GPU's error of [`safetensors::load_shard`].
    pub fn load_tensor_parallel(
        &self,
        plan: &TensorParallel,
    ) -> Result<(Vec<Checkpoint>, MultiReport)> {
        check_ranks(plan.ranks(), self.len(), "on a loader of")?;
        let started = Instant::now();
        let parts = self.each(|rank, loader| {
            let t = Instant::now();
            let ckpt = safetensors::load_shard(loader, plan, rank)?;
            Ok((ckpt, t.elapsed().as_secs_f64()))
        })?;
        let mut report = self.report(started);
        let mut ckpts = Vec::with_capacity(parts.len());
        for (rank, (ckpt, secs)) in parts.into_iter().enumerate() {
            report.read_bytes[rank] = ckpt.bytes();
            report.gpu_seconds[rank] = secs;
            report.loads[rank] = ckpt.reports().to_vec();
            ckpts.push(ckpt);
        }
        Ok((ckpts, report))
    }

    /// Loads all of `path` onto every GPU: GPU `g` reads the `g`-th of N contiguous shares of
    /// the file over its own PCIe link, in rounds of 1 GiB ([`MultiLoader::with_round_bytes`]),
    /// and after each round copies what it read to every other GPU over their peer link
    /// (NVLink where there is one), overlapped with its next round. The file's identity is
    /// checked at the end (a file changed meanwhile is an error). On two H200s a warm 16 GiB
    /// file took 0.19-0.21 s, 0.59-0.62x one GPU's load of it (docs/benchmarks.md, GPU runs
    /// 45-46).
    ///
    /// # Errors
    /// A missing file, [`Error::FileChangedDuringLoad`], and the loads' and copies' errors.
    pub fn load_replicated(
        &self,
        path: impl AsRef<Path>,
    ) -> Result<(Vec<DeviceBuffer>, MultiReport)> {
        let path = path.as_ref();
        let (_, identity) = gpufeed_os::file::open_regular(path, false)?;
        let len = identity.size;
        let out = self.replicate(path, 0..len)?;
        check_unchanged(path, &identity)?;
        Ok(out)
    }

    /// Loads a safetensors checkpoint (a file or an index) whole onto every GPU, each file's
    /// data section as [`MultiLoader::load_replicated`] does: one [`Checkpoint`] per GPU.
    ///
    /// # Errors
    /// [`safetensors::load`]'s and [`MultiLoader::load_replicated`]'s.
    pub fn load_replicated_safetensors(
        &self,
        path: impl AsRef<Path>,
    ) -> Result<(Vec<Checkpoint>, MultiReport)> {
        let path = path.as_ref();
        let started = Instant::now();
        let layouts = safetensors::inspect(path)?;
        let mut per_gpu: Vec<Vec<DeviceBuffer>> = (0..self.len()).map(|_| Vec::new()).collect();
        let mut report = self.report(started);
        for layout in &layouts {
            let range = layout.data_start..layout.data_start + layout.data_bytes;
            let (_, identity) = gpufeed_os::file::open_regular(&layout.path, false)?;
            let (bufs, r) = self.replicate(&layout.path, range)?;
            check_unchanged(&layout.path, &identity)?;
            for (g, buf) in bufs.into_iter().enumerate() {
                per_gpu[g].push(buf);
                report.read_bytes[g] += r.read_bytes[g];
                report.peer_bytes[g] += r.peer_bytes[g];
                report.gpu_seconds[g] += r.gpu_seconds[g];
                report.loads[g].extend(r.loads[g].iter().cloned());
            }
        }
        let ckpts = per_gpu
            .into_iter()
            .zip(&self.loaders)
            .map(|(buffers, loader)| {
                Checkpoint::from_layouts(path, loader.gpu().clone(), &layouts, buffers)
            })
            .collect::<Result<Vec<_>>>()?;
        report.seconds = started.elapsed().as_secs_f64();
        Ok((ckpts, report))
    }

    /// Bytes `range` of `path` onto every GPU (see [`MultiLoader::load_replicated`]).
    fn replicate(
        &self,
        path: &Path,
        range: Range<u64>,
    ) -> Result<(Vec<DeviceBuffer>, MultiReport)> {
        let _keep = ContextGuard::new();
        let started = Instant::now();
        let n = self.len();
        let len = range.end - range.start;
        let shares = ShardPlan::split_len(len, n);
        let gpus: Vec<Gpu> = self.loaders.iter().map(|l| l.gpu().clone()).collect();
        // As a Loader does: the first large load's memory from cuMemAlloc, later ones from the
        // contexts' pools (a replicated buffer freed and loaded again costs no cuMemFree and
        // cuMemAlloc of its whole size).
        // Every loader is asked, so that each counts this as a load.
        let asked: Vec<DeviceAlloc> = self
            .loaders
            .iter()
            .map(|l| l.device_alloc(len as usize))
            .collect();
        let from = if asked.contains(&DeviceAlloc::Unpooled) {
            DeviceAlloc::Unpooled
        } else {
            DeviceAlloc::Pool
        };
        let (bufs, parts) = Gpu::alloc_filled_each(&gpus, len as usize, from, |dsts| {
            // views[h][g]: GPU h's copy of share g. Thread g fills its own share on its GPU
            // (views[g][g]) and copies it into views[h][g] on every other GPU h.
            let cut: Vec<usize> = shares[1..n].iter().map(|s| s.start as usize).collect();
            let mut own: Vec<Option<CudaViewMut<'_, u8>>> = (0..n).map(|_| None).collect();
            let mut to_peers: Vec<Vec<CudaViewMut<'_, u8>>> = (0..n).map(|_| Vec::new()).collect();
            for (h, dst) in dsts.iter_mut().enumerate() {
                let views = gpufeed_cuda::split_mut(dst, &cut)
                    .ok_or_else(|| Error::InvalidSetting("replicated shares overflow".into()))?;
                for (g, v) in views.into_iter().enumerate() {
                    if g == h {
                        own[g] = Some(v);
                    } else {
                        to_peers[g].push(v);
                    }
                }
            }
            let failed = AtomicBool::new(false);
            let peers = to_peers
                .into_iter()
                .map(|p| if self.skip_peer_copies { Vec::new() } else { p });
            in_parallel(
                own.into_iter().zip(peers),
                "a thread of a replicated load",
                |g, (own, peers)| {
                    let out = share_out(
                        &self.loaders[g],
                        (path, range.start),
                        shares[g].clone(),
                        self.round_bytes,
                        own,
                        peers,
                        &failed,
                    );
                    if out.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    out
                },
            )
        })?;
        let mut report = self.report(started);
        for (g, (reports, secs)) in parts.into_iter().enumerate() {
            let share = shares[g].end - shares[g].start;
            report.read_bytes[g] = share;
            report.peer_bytes[g] = len - share;
            report.gpu_seconds[g] = secs;
            report.loads[g] = reports;
        }
        Ok((bufs, report))
    }

    /// Runs `f(rank, loader)` for every GPU at once, on a thread each; the first error wins.
    fn each<T: Send>(&self, f: impl Fn(usize, &Loader) -> Result<T> + Sync) -> Result<Vec<T>> {
        let _keep = ContextGuard::new();
        in_parallel(&self.loaders, "a thread loading onto one GPU", f)
    }

    fn report(&self, started: Instant) -> MultiReport {
        let n = self.len();
        MultiReport {
            gpus: self.ordinals(),
            read_bytes: vec![0; n],
            peer_bytes: vec![0; n],
            seconds: started.elapsed().as_secs_f64(),
            gpu_seconds: vec![0.0; n],
            loads: vec![Vec::new(); n],
        }
    }
}

/// The most bytes of one staging slot of [`RankLoader`]'s replicated loads: the most another
/// process maps of a shared pool ([`gpufeed_cuda::SHARED_MAP_MAX_BYTES`], 4 GiB: larger ones
/// crashed the driver). So the ranks never map each other's copies, only slots.
pub const SHARED_SLOT_MAX_BYTES: u64 = gpufeed_cuda::SHARED_MAP_MAX_BYTES as u64;

/// One process per GPU, as `torchrun` starts them: this process's rank of the job's ranks on
/// this machine, its GPU's [`Loader`], and a [`gpufeed_ipc::Rendezvous`] with the other ranks
/// (shared memory; no PyTorch or NCCL needed). Sharded and tensor-parallel loads check that
/// every rank was given the same plan and load this rank's part; a replicated load has each
/// rank read 1/N of the file, round by round, into a staging slot of a memory pool that the
/// other ranks mapped once, out of which every rank copies it into its own copy (CUDA IPC, over
/// NVLink where there is one; [`RankLoader::with_shared_staging`]), or, opted into, straight
/// into its own copy, from which NCCL broadcasts it to the others
/// ([`RankLoader::with_nccl`]). A rank that dies, leaves
/// after an error, or never arrives makes the others fail with an error naming it (within the
/// rendezvous's lease or join timeout).
///
/// Every rank must make the same calls in the same order (they are collective). After an
/// error a rank leaves the rendezvous: its later calls fail, and the other ranks' current
/// or next call fails naming it. Across machines each machine's ranks meet on their own;
/// each loads from its own storage.
///
/// # Example
/// ```no_run
/// // In each process torchrun starts (LOCAL_RANK, LOCAL_WORLD_SIZE and TORCHELASTIC_RUN_ID set):
/// let rank = gpufeed::multi::RankLoader::from_env()?;
/// let (weights, report) = rank.load_replicated("model.bin")?;
/// println!("rank {}: {} bytes in {:.0} ms", rank.rank(), weights.len(), report.seconds * 1e3);
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub struct RankLoader {
    loader: Loader,
    rdv: gpufeed_ipc::Rendezvous,
    round_bytes: u64,
    /// Whether replicated loads go through staging slots the ranks share.
    shared_staging: bool,
    /// Whether replicated loads go through NCCL broadcasts instead.
    nccl: bool,
    /// The staging slots, made by the first replicated load of several ranks.
    pools: parking_lot::Mutex<Staging>,
    /// Where the current collective call's time went (reset by each).
    timings: parking_lot::Mutex<Timings>,
}

/// The parts of a collective call that [`RankReport`] breaks out.
#[derive(Debug, Clone, Default)]
struct Timings {
    exchange: f64,
    alloc: f64,
    peer_open: f64,
    peer_close: f64,
}

/// Replicated loads' staging between the ranks.
#[derive(Debug)]
enum Staging {
    /// No replicated load of several ranks yet.
    NotYet,
    /// Some rank cannot share a memory pool: copies through CUDA IPC handles.
    Unshared,
    /// Every rank shares one.
    Shared(Box<RankPools>),
    /// Replicated loads go through NCCL ([`RankLoader::with_nccl`]): the ranks' communicator.
    Nccl(Box<gpufeed_cuda::NcclComm>),
}

/// Staging when every rank shares a memory pool: this rank's pool and two slots in it that
/// each round is read into in turn, and every other rank's pool and slots mapped here (made
/// once; the slots again when a load needs larger ones). Fields drop in order: the mappings
/// go before this rank's own slots.
#[derive(Debug)]
struct RankPools {
    /// The other ranks' two slots, in rank order; `None` in this rank's place.
    peer_slots: Vec<Option<[gpufeed_cuda::IpcMemory; 2]>>,
    /// This rank's two slots (`slot_bytes` each; none before the first load).
    slots: Vec<DeviceBuffer>,
    slot_bytes: usize,
    /// The other ranks' pools, imported here; `None` in this rank's place.
    peer_pools: Vec<Option<std::sync::Arc<gpufeed_cuda::ImportedPool>>>,
    own: gpufeed_cuda::SharedPool,
}

impl Drop for RankLoader {
    /// With shared staging, CUDA wants memory imported from a pool freed in every process that
    /// imported it before the process that owns it frees it. So a rank unmaps the other ranks'
    /// slots, departs from the rendezvous (the others' next collective call fails naming this
    /// rank), and frees its own slots once every other rank has departed or died — waiting at
    /// most 10 s for a rank that keeps its loader longer, then freeing them anyway, with a
    /// warning.
    fn drop(&mut self) {
        let Staging::Shared(p) = self.pools.get_mut() else {
            return;
        };
        let _keep = ContextGuard::new();
        p.peer_slots.clear();
        p.peer_pools.clear();
        self.rdv.depart();
        if !self.rdv.wait_until_departed(LET_GO_WAIT) {
            tracing::warn!(
                "rank {}: freeing staging slots that another rank still maps (it kept its \
                 RankLoader {} s longer): drop every rank's loader at about the same time",
                self.rank(),
                LET_GO_WAIT.as_secs()
            );
        }
    }
}

impl std::fmt::Debug for RankLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankLoader")
            .field("rank", &self.rank())
            .field("world", &self.world())
            .field("gpu", &self.loader.gpu().info().ordinal)
            .finish()
    }
}

/// What one rank's part of a collective load did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RankReport {
    /// This rank.
    pub rank: usize,
    /// Bytes this rank read from the host over its own PCIe link.
    pub read_bytes: u64,
    /// Bytes this rank received from the other ranks (replicated loads).
    pub peer_bytes: u64,
    /// Wall seconds from the call until every rank held its bytes.
    pub seconds: f64,
    /// Seconds this rank waited for the others at the rendezvous (agreeing on the plan,
    /// passing handles, and for replicated loads the final outcome: the slowest rank's part).
    pub exchange_seconds: f64,
    /// Replicated loads: seconds getting this rank's device memory (from the GPU's
    /// stream-ordered pool; or `cuMemAlloc`, which CUDA IPC handles need:
    /// [`RankLoader::with_shared_staging`]); 0 otherwise.
    pub alloc_seconds: f64,
    /// Replicated loads through CUDA IPC handles: seconds opening the other ranks' copies
    /// (`cuIpcOpenMemHandle`, on a thread of its own while this rank reads its first round);
    /// through NCCL: seconds making the ranks' communicator that the load's reads did not hide
    /// (the first such load only, its checks included); 0 otherwise (shared staging maps the
    /// other ranks' slots once).
    pub peer_open_seconds: f64,
    /// Replicated loads through CUDA IPC handles: seconds closing them again
    /// (`cuIpcCloseMemHandle`); 0 otherwise.
    pub peer_close_seconds: f64,
    /// This rank's load reports.
    pub loads: Vec<LoadReport>,
}

impl RankLoader {
    /// Joins job `job`'s rendezvous as `rank` of `world` ranks on this machine and opens GPU
    /// `ordinal` with `opts` ([`LoadOptions::for_gpus`]`(world)` shares the host between
    /// the ranks as a [`MultiLoader`] does); returns once every rank has its GPU open.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] for a job name that cannot name shared memory;
    /// [`gpufeed_ipc::Rendezvous::join`]'s (a rank that never arrives or dies is named);
    /// [`Loader::open`]'s; a rank whose GPU failed to open is named by the others.
    pub fn join(
        job: &str,
        rank: usize,
        world: usize,
        ordinal: usize,
        opts: LoadOptions,
        rendezvous: gpufeed_ipc::RendezvousOptions,
    ) -> Result<Self> {
        if job.is_empty() || job.len() > 200 || job.contains(['/', '\0']) {
            return Err(Error::InvalidSetting(format!(
                "job name {job:?}: use 1 to 200 characters, no '/'"
            )));
        }
        let rdv =
            gpufeed_ipc::Rendezvous::join(&format!("gpufeed-rdv-{job}"), rank, world, rendezvous)?;
        let loader = Gpu::keeping_current_context(|| Loader::open(ordinal, opts))?;
        rdv.barrier()?;
        Ok(RankLoader {
            loader,
            rdv,
            round_bytes: ROUND_BYTES,
            shared_staging: true,
            nccl: false,
            pools: parking_lot::Mutex::new(Staging::NotYet),
            timings: parking_lot::Mutex::new(Timings::default()),
        })
    }

    /// The job name [`RankLoader::from_env`] meets the other ranks under: `GPUFEED_JOB` as it
    /// is where set (the same for every rank of the job, different for every other job on the
    /// machine); else what concurrent jobs on one machine differ in: `TORCHELASTIC_RUN_ID`
    /// (torchrun's `--rdzv-id`, whose default is the string `none`, the same for every job),
    /// `MASTER_ADDR` and `MASTER_PORT`, the launcher's pid (the parent process: torchrun's
    /// agent starts every local rank itself) and the launcher's restart count
    /// (`TORCHELASTIC_RESTART_COUNT`: a restarted attempt never meets the remains of the one
    /// before). Characters a shared-memory name cannot hold become `_`.
    ///
    /// Ranks of one job started by different parent processes (a launcher that is not
    /// torchrun's agent) must set `GPUFEED_JOB`.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] when neither `GPUFEED_JOB`, `TORCHELASTIC_RUN_ID` nor
    /// `MASTER_ADDR` and `MASTER_PORT` are set.
    pub fn job_from_env() -> Result<String> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let job = match var("GPUFEED_JOB") {
            Some(job) => job,
            None => {
                let run = var("TORCHELASTIC_RUN_ID");
                let master = var("MASTER_ADDR").zip(var("MASTER_PORT"));
                if run.is_none() && master.is_none() {
                    return Err(Error::InvalidSetting(
                        "no job name: set GPUFEED_JOB (the same for every rank of the job), or \
                         start the processes with torchrun (TORCHELASTIC_RUN_ID)"
                            .into(),
                    ));
                }
                let launcher = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
                let mut parts: Vec<String> = run.into_iter().collect();
                if let Some((addr, port)) = master {
                    parts.extend([addr, port]);
                }
                parts.push(format!("launcher{launcher}"));
                parts.push(format!(
                    "attempt{}",
                    var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into())
                ));
                parts.join("-")
            }
        };
        Ok(job
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect())
    }

    /// [`RankLoader::join`] from the variables `torchrun` sets: `LOCAL_RANK` of
    /// `LOCAL_WORLD_SIZE`, the job [`RankLoader::job_from_env`] names; options [`LoadOptions::for_gpus`]`(LOCAL_WORLD_SIZE)`.
    /// `GPUFEED_REPLICATE` picks how replicated loads copy between the ranks: `staging` (the
    /// default: [`RankLoader::with_shared_staging`]), `ipc` (CUDA IPC handles:
    /// `with_shared_staging(false)`) or `nccl` ([`RankLoader::with_nccl`]), so that a launch
    /// script chooses without a change to the code (Python's `load_replicated_rank` too).
    /// The GPU is `LOCAL_RANK` of the GPUs this process sees, modulo their number (as
    /// `torch.cuda.set_device(local_rank % torch.cuda.device_count())`): a launcher that gives
    /// each rank one GPU through `CUDA_VISIBLE_DEVICES` makes it GPU 0 of each, and more ranks
    /// than GPUs share them.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] naming a missing or malformed variable; [`RankLoader::join`]'s.
    pub fn from_env() -> Result<Self> {
        let num = |name: &str| -> Result<usize> {
            let v = std::env::var(name).map_err(|_| {
                Error::InvalidSetting(format!(
                    "{name} is not set: start the processes with torchrun (or set LOCAL_RANK and LOCAL_WORLD_SIZE)"
                ))
            })?;
            v.trim()
                .parse()
                .map_err(|_| Error::InvalidSetting(format!("{name}={v:?} is not a number")))
        };
        let (rank, world) = (num("LOCAL_RANK")?, num("LOCAL_WORLD_SIZE")?);
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let (staging, nccl) = match var("GPUFEED_REPLICATE").as_deref() {
            None | Some("staging") => (true, false),
            Some("ipc") => (false, false),
            Some("nccl") => (true, true),
            Some(other) => {
                return Err(Error::InvalidSetting(format!(
                    "GPUFEED_REPLICATE={other:?}: use staging (the default), ipc or nccl"
                )));
            }
        };
        let job = Self::job_from_env()?;
        // Without a driver, `join` names the problem when it opens the GPU.
        let ordinal = match Gpu::count() {
            Ok(count) if count > 0 => rank % count,
            _ => rank,
        };
        let joined = Self::join(
            &job,
            rank,
            world,
            ordinal,
            LoadOptions::for_gpus(world),
            gpufeed_ipc::RendezvousOptions::default(),
        );
        if let Err(Error::Ipc(gpufeed_ipc::Error::RankNeverArrived { .. })) = &joined
            && std::env::var_os("GPUFEED_JOB").is_none()
        {
            tracing::warn!(
                job = %job,
                "this rank waited under a job name made from torchrun's variables and this \
                 process's parent (RankLoader::job_from_env): ranks started by different parent \
                 processes (e.g. `torchrun bash train.sh`) never meet; set GPUFEED_JOB to the \
                 same value in every rank of the job"
            );
        }
        Ok(joined?.with_shared_staging(staging).with_nccl(nccl))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rdv.rank()
    }

    /// The number of ranks on this machine.
    pub fn world(&self) -> usize {
        self.rdv.world()
    }

    /// This rank's loader (for loads of its own).
    pub fn loader(&self) -> &Loader {
        &self.loader
    }

    /// The rendezvous with the other ranks.
    pub fn rendezvous(&self) -> &gpufeed_ipc::Rendezvous {
        &self.rdv
    }

    /// This loader with replicated loads in rounds of `bytes` (default 1 GiB, at least 1
    /// MiB); with shared staging a round is at most a staging slot (the largest share, whole
    /// MiB, at most [`SHARED_SLOT_MAX_BYTES`]).
    pub fn with_round_bytes(mut self, bytes: u64) -> Self {
        self.round_bytes = bytes.max(1 << 20);
        self
    }

    /// Whether replicated loads go through staging slots in a memory pool that each rank keeps
    /// and the other ranks map once (default `true`): each rank reads its share round by
    /// round into its slots, and every rank copies each round from there (over NVLink where
    /// there is one) into its own copy, which comes from the GPU's stream-ordered pool like
    /// every other load's. Each rank keeps two slots of up to the round size (1 GiB by
    /// default, [`RankLoader::with_round_bytes`]; at most [`SHARED_SLOT_MAX_BYTES`]) until the
    /// loader is dropped, and frees them once every other rank has dropped its loader (which
    /// maps them), waiting up to 10 s for that: drop the ranks' loaders at about the same
    /// time. `false`, or where some rank's driver cannot share pools through file
    /// descriptors: each copy is new `cuMemAlloc` memory (20% slower to fill on the H200
    /// machine, GPU run 54) that the others open through CUDA IPC handles
    /// (`cuIpcOpenMemHandle`, per load) and write into. Every rank must pass the same value.
    pub fn with_shared_staging(mut self, shared: bool) -> Self {
        self.shared_staging = shared;
        self
    }

    /// Whether replicated loads go through NCCL (default `false`): each rank reads its share
    /// round by round straight into its own copy, and one group of NCCL broadcasts per round
    /// (each rank the root of its part, in place) sends it into every other rank's copy
    /// while the rank reads its next round; no staging slots, no shared pools, no CUDA IPC of
    /// gpufeed's own. The first such load makes the ranks' communicator (rank 0's
    /// `ncclUniqueId` passed through the rendezvous), kept until the loader is dropped; NCCL
    /// sets it up (0.4-0.5 s on the H200 machine, GPU runs 109 and 111) while the load reads,
    /// its first rounds' broadcasts queued until it is up; the part of the setup the reads did
    /// not hide is in the report's `peer_open_seconds`. Every wait on NCCL looks at
    /// the other ranks between polls, so a rank that dies or leaves makes the others abort
    /// the communicator and fail naming it, as on the other paths. Needs NCCL 2.14 or later
    /// at run time (`libnccl.so.2`, or `GPUFEED_NCCL_LIBRARY`) and a GPU per rank (NCCL
    /// refuses two ranks on one GPU); without either, the load fails saying so. Even a
    /// job of one rank goes through NCCL (as the job's larger runs do). Choose it before the
    /// first replicated load; every rank must pass the same value (checked with the file).
    pub fn with_nccl(mut self, nccl: bool) -> Self {
        self.nccl = nccl;
        self
    }

    /// Whether replicated loads go through staging slots the ranks share: known after the
    /// first replicated load of several ranks (`None` before, and with shared staging off);
    /// `Some(false)` through NCCL.
    pub fn shares_staging(&self) -> Option<bool> {
        match &*self.pools.lock() {
            Staging::NotYet => None,
            Staging::Unshared | Staging::Nccl(_) => Some(false),
            Staging::Shared(_) => Some(true),
        }
    }

    /// Makes the ranks' NCCL communicator (collective: the first replicated load through
    /// NCCL). Every rank first learns that every other rank has a GPU of its own and NCCL,
    /// so that all fail alike, each saying why.
    fn make_comm(&self) -> Result<Staging> {
        let t = Instant::now();
        let (n, me) = (self.world(), self.rank());
        let gpu = self.loader.gpu();
        let bus = &gpu.info().pci_bus_id;
        let all = self.exchange(bus.as_bytes())?;
        for (b, theirs) in all.iter().enumerate() {
            if let Some(a) = all[..b].iter().position(|x| x == theirs) {
                return Err(Error::InvalidSetting(format!(
                    "replicated loads through NCCL need a GPU per rank, and ranks {a} and {b} \
                     both use GPU {}: give each rank its own GPU (LOCAL_RANK < the GPUs it \
                     sees), or replicate without NCCL (RankLoader::with_nccl(false), the \
                     default)",
                    String::from_utf8_lossy(theirs)
                )));
            }
        }
        let mine = gpufeed_cuda::nccl_version();
        let all = self.exchange(&[u8::from(mine.is_ok())])?;
        mine?;
        if let Some(r) = all.iter().position(|s| s.first() != Some(&1)) {
            return Err(Error::InvalidSetting(format!(
                "rank {r} cannot load NCCL (its own error says why): install NCCL where every \
                 rank runs, or replicate without NCCL (RankLoader::with_nccl(false))"
            )));
        }
        let id = match me {
            0 => Some(gpufeed_cuda::NcclId::new()?),
            _ => None,
        };
        let ids = self.exchange(id.as_ref().map_or(&[][..], |id| &id.0[..]))?;
        let id: [u8; 128] = ids[0]
            .as_slice()
            .try_into()
            .map_err(|_| Error::RankFailed { rank: 0 })?;
        // Its setup (0.4-0.5 s) runs while this load reads: the first rounds' broadcasts wait
        // for it in `replicate_nccl`.
        let comm =
            gpufeed_cuda::NcclComm::start(gpu, &gpufeed_cuda::NcclId(id), me, n, NCCL_SETUP_WAIT)?;
        self.timings.lock().peer_open = t.elapsed().as_secs_f64();
        Ok(Staging::Nccl(Box::new(comm)))
    }

    /// Makes the ranks' shared pools (collective: every rank's first replicated load of
    /// several ranks). Every rank decides alike from what all of them report: `Unshared` when
    /// some rank cannot make or import a shareable pool (said once, in its own output).
    fn make_pools(&self) -> Result<Staging> {
        use std::os::fd::AsFd;
        let gpu = self.loader.gpu();
        let own = gpufeed_cuda::SharedPool::new(gpu)
            .inspect_err(|e| {
                tracing::warn!(
                    "replicated loads copy through CUDA IPC handles: no shareable memory pool ({e})"
                )
            })
            .ok();
        let all = self.all_ranks(own.is_some())?;
        let (true, Some(own)) = (all, own) else {
            return Ok(Staging::Unshared);
        };
        let theirs = self.rdv.share_fd(own.export()?.as_fd())?;
        let imported: std::result::Result<Vec<_>, gpufeed_cuda::Error> = theirs
            .iter()
            .map(|fd| {
                fd.as_ref()
                    .map(|fd| {
                        Gpu::keeping_current_context(|| {
                            gpufeed_cuda::ImportedPool::import(gpu, fd.as_fd())
                        })
                        .map(std::sync::Arc::new)
                    })
                    .transpose()
            })
            .collect();
        let imported = imported
            .inspect_err(|e| {
                tracing::warn!("replicated loads copy through CUDA IPC handles: another rank's pool could not be imported ({e})")
            })
            .ok();
        let all = self.all_ranks(imported.is_some())?;
        let (true, Some(peer_pools)) = (all, imported) else {
            return Ok(Staging::Unshared);
        };
        Ok(Staging::Shared(Box::new(RankPools {
            peer_slots: Vec::new(),
            slots: Vec::new(),
            slot_bytes: 0,
            peer_pools,
            own,
        })))
    }

    /// Makes every rank's slots at least `want` bytes (collective; every rank passes the same
    /// `want`): the old ones unmapped everywhere and freed, new ones made, and the other
    /// ranks' mapped.
    fn grow_slots(&self, p: &mut RankPools, want: usize) -> Result<()> {
        if p.slot_bytes >= want {
            return Ok(());
        }
        p.peer_slots.clear();
        // Every rank has unmapped the old slots before any frees its own.
        self.rdv.barrier()?;
        p.slots.clear();
        p.slot_bytes = 0;
        let made = (0..2)
            .map(|_| p.own.alloc_zeroed(want))
            .collect::<std::result::Result<Vec<_>, _>>();
        let shared = made.as_ref().ok().and_then(|slots| {
            let a = p.own.share(&slots[0]).ok()?;
            let b = p.own.share(&slots[1]).ok()?;
            Some([a.0, b.0].concat())
        });
        let all = self.exchange(shared.as_deref().unwrap_or_default())?;
        if let Some(rank) = all.iter().position(|d| d.len() != 128) {
            made?;
            return Err(Error::RankFailed { rank });
        }
        p.slots = made?;
        let mapped: Result<Vec<_>> = all
            .iter()
            .zip(&p.peer_pools)
            .map(|(data, pool)| {
                let Some(pool) = pool else {
                    return Ok(None);
                };
                let map = |half: &[u8]| -> Result<gpufeed_cuda::IpcMemory> {
                    let data: [u8; 64] = half.try_into().unwrap_or([0; 64]);
                    Ok(Gpu::keeping_current_context(|| {
                        gpufeed_cuda::IpcMemory::import(
                            pool,
                            gpufeed_cuda::SharedPointer(data),
                            want,
                        )
                    })?)
                };
                Ok(Some([map(&data[..64])?, map(&data[64..])?]))
            })
            .collect();
        let ok = mapped.is_ok();
        let status = self.exchange(&[u8::from(ok)])?;
        p.peer_slots = mapped?;
        if let Some(rank) = status.iter().position(|s| s.first() != Some(&1)) {
            return Err(Error::RankFailed { rank });
        }
        p.slot_bytes = want;
        Ok(())
    }

    /// Whether every rank says `yes` (collective).
    fn all_ranks(&self, yes: bool) -> Result<bool> {
        let all = self.exchange(&[u8::from(yes)])?;
        Ok(all.iter().all(|s| s.first() == Some(&1)))
    }

    /// Loads this rank's spans of `plan` (the same plan on every rank: checked) into one
    /// device buffer.
    ///
    /// # Errors
    /// [`Error::RanksDisagree`]; [`Error::InvalidSetting`] for a plan of another number of
    /// ranks; [`Loader::load_spans`]'s.
    pub fn load_sharded(&self, plan: &ShardPlan) -> Result<(DeviceBuffer, RankReport)> {
        self.collective(|| {
            let started = Instant::now();
            check_ranks(plan.ranks(), self.world(), "in a job on this machine of")?;
            self.agree("shard plan", serde_json::to_vec(plan).unwrap_or_default())?;
            let (buf, loads) = load_rank(&self.loader, plan, self.rank())?;
            let report = self.report(started, buf.len() as u64, 0, loads);
            Ok((buf, report))
        })
    }

    /// Loads this rank's shares of a tensor-parallel plan (the same plan on every rank:
    /// checked): [`safetensors::load_shard`].
    ///
    /// # Errors
    /// [`Error::RanksDisagree`]; [`safetensors::load_shard`]'s.
    pub fn load_tensor_parallel(&self, plan: &TensorParallel) -> Result<(Checkpoint, RankReport)> {
        self.collective(|| {
            let started = Instant::now();
            check_ranks(plan.ranks(), self.world(), "in a job on this machine of")?;
            let digest = format!(
                "{:?} {:?} {:?}",
                plan.files(),
                plan.split(),
                (0..plan.ranks()).map(|r| plan.bytes(r)).collect::<Vec<_>>()
            );
            self.agree("tensor-parallel plan", digest.into_bytes())?;
            let ckpt = safetensors::load_shard(&self.loader, plan, self.rank())?;
            let report = self.report(started, ckpt.bytes(), 0, ckpt.reports().to_vec());
            Ok((ckpt, report))
        })
    }

    /// Loads all of `path` onto every rank's GPU (the same file on every rank: checked): each
    /// rank reads its 1/N share over its own PCIe link, in rounds, and every other rank copies
    /// each round out of its staging slot (or, without shared staging, it writes each round
    /// into every other rank's copy: [`RankLoader::with_shared_staging`]); it returns once
    /// every rank's copy is whole.
    ///
    /// # Errors
    /// [`Error::RanksDisagree`]; [`Error::RankFailed`] naming a rank whose part failed;
    /// rendezvous errors naming a rank that died or left; [`Error::FileChangedDuringLoad`];
    /// this rank's load and CUDA errors (IPC refused: GPUs that cannot be peers).
    pub fn load_replicated(&self, path: impl AsRef<Path>) -> Result<(DeviceBuffer, RankReport)> {
        let path = path.as_ref();
        self.collective(|| {
            let started = Instant::now();
            let (_, identity) = gpufeed_os::file::open_regular(path, false)?;
            let via = match (self.nccl, self.shared_staging) {
                (true, _) => "NCCL",
                (false, true) => "shared staging",
                (false, false) => "IPC handles",
            };
            self.agree(
                "replicated file and how it is copied",
                format!(
                    "{} {} {} {via}",
                    path.display(),
                    identity.size,
                    identity.mtime_ns
                )
                .into_bytes(),
            )?;
            let len = identity.size;
            let (n, me) = (self.world(), self.rank());
            let shares = ShardPlan::split_len(len, n);
            let mine = shares[me].clone();
            let gpu = self.loader.gpu();
            let mut staging = self.pools.lock();
            if self.nccl && len > 0 {
                match &*staging {
                    Staging::Nccl(c) if !c.is_broken() => {}
                    // Aborted after an earlier failure: a new one.
                    Staging::Nccl(_) | Staging::NotYet => {
                        *staging = Staging::NotYet;
                        *staging = self.make_comm()?;
                    }
                    Staging::Shared(_) | Staging::Unshared => {
                        return Err(Error::InvalidSetting(
                            "RankLoader::with_nccl(true) came after replicated loads without \
                             NCCL: choose it before the first replicated load"
                                .into(),
                        ));
                    }
                }
            } else if self.shared_staging
                && !self.nccl
                && n > 1
                && len > 0
                && matches!(*staging, Staging::NotYet)
            {
                *staging = self.make_pools()?;
            }
            let (shared, comm) = match &mut *staging {
                Staging::Nccl(c) if len > 0 && self.nccl => (None, Some(c)),
                // Shared only if shared staging was on (set before the first load).
                Staging::Shared(p) if len > 0 => {
                    // Slots of a round, whole MiB (so that loads a little larger than the last
                    // do not make them again), at most the round size and the driver's limit.
                    let largest = shares.iter().map(|s| s.end - s.start).max().unwrap_or(0);
                    let want = largest
                        .next_multiple_of(1 << 20)
                        .min(self.round_bytes.min(SHARED_SLOT_MAX_BYTES));
                    self.grow_slots(p, want as usize)?;
                    (Some(p), None)
                }
                _ => (None, None),
            };
            // One rank alone loads like a plain load; several share staging slots, or go
            // through NCCL, or else write into each other's copies, which CUDA IPC handles
            // need from `cuMemAlloc`.
            let alone = self.shared_staging && n == 1 && comm.is_none();
            let alloc = match shared.is_some() || comm.is_some() || alone {
                true => DeviceAlloc::Pool,
                false => DeviceAlloc::Unpooled,
            };
            let t = Instant::now();
            let (buf, loads) = gpu.alloc_filled(len as usize, alloc, |dst| {
                self.timings.lock().alloc = t.elapsed().as_secs_f64();
                match (shared, comm) {
                    (_, Some(c)) => self.replicate_nccl(dst, path, &shares, c),
                    (Some(p), None) => self.replicate_staged(dst, path, &shares, p),
                    (None, None) if alone => {
                        let whole = 0..len;
                        let spans = std::slice::from_ref(&whole);
                        Ok(vec![self.loader.load_spans_to(path, spans, dst)?])
                    }
                    (None, None) => self.replicate_into(dst, path, &shares),
                }
            })?;
            drop(staging);
            check_unchanged(path, &identity)?;
            let read = mine.end - mine.start;
            let report = self.report(started, read, len - read, loads);
            Ok((buf, report))
        })
    }

    /// The collective part of a replicated load through NCCL, into `dst` (this rank's copy):
    /// round by round, this rank reads its round into place, then one group of broadcasts
    /// (each rank the root of its round) fills the others' rounds while it reads the next.
    /// Every wait on NCCL watches the other ranks: one that fails leaves the rendezvous, and
    /// the others abort the communicator and fail naming it.
    fn replicate_nccl(
        &self,
        dst: &mut DeviceBuffer,
        path: &Path,
        shares: &[Range<u64>],
        comm: &mut gpufeed_cuda::NcclComm,
    ) -> Result<Vec<LoadReport>> {
        let me = self.rank();
        let round = self.round_bytes;
        let rounds = rounds_of(shares, round);
        let mut watch = self.rdv.watch();
        let mut alive = || watch.check().map_err(Error::from);
        let mut loads = Vec::new();
        let waited = comm.setup_waited();
        let outcome = comm
            .broadcasts(dst.as_view_mut())
            .map_err(Error::from)
            .and_then(|mut bc| {
                for i in 0..rounds {
                    if let Some(r) = round_part(&shares[me], i, round) {
                        let mut view = bc.dst_mut(r.start as usize..r.end as usize)?;
                        loads.push(self.loader.load_spans_to(
                            path,
                            std::slice::from_ref(&r),
                            &mut view,
                        )?);
                    }
                    let parts: Vec<(usize, Range<usize>)> = shares
                        .iter()
                        .enumerate()
                        .filter_map(|(r, s)| {
                            round_part(s, i, round).map(|p| (r, p.start as usize..p.end as usize))
                        })
                        .collect();
                    bc.round(&parts, &mut alive)?;
                }
                bc.wait(&mut alive)
            });
        // The communicator's setup that the reads did not hide.
        self.timings.lock().peer_open += (comm.setup_waited() - waited).as_secs_f64();
        // A rank whose part failed returns now and leaves the rendezvous (`collective`), so
        // that the others, waiting in NCCL for its broadcasts, see it gone and fail naming it
        // (an exchange here would wait for them while they wait for it).
        outcome?;
        // Every rank holds every byte once all are here.
        self.exchange(&[])?;
        Ok(loads)
    }

    /// The collective part of a replicated load through the ranks' staging slots, into `dst`
    /// (this rank's copy). In lock step, round by round: each rank reads its round into slot
    /// `i % 2` and copies it into place; all meet (saying whether their part went well, and
    /// having finished their copies out of the other slot); each copies every other rank's
    /// round out of that rank's slot while it reads its next round.
    fn replicate_staged(
        &self,
        dst: &mut DeviceBuffer,
        path: &Path,
        shares: &[Range<u64>],
        p: &mut RankPools,
    ) -> Result<Vec<LoadReport>> {
        let me = self.rank();
        let round = p.slot_bytes as u64;
        let rounds = rounds_of(shares, round);
        let part = |share: &Range<u64>, i: u64| round_part(share, i, round);
        let cuda = |op| {
            move |e: gpufeed_cuda::cudarc::driver::DriverError| {
                Error::from(gpufeed_cuda::Error::Cuda { op, result: e.0 })
            }
        };
        let RankPools {
            peer_slots, slots, ..
        } = p;
        // Sources: the other ranks' slots, two each, in rank order.
        let ranks: Vec<usize> = (0..peer_slots.len())
            .filter(|&r| peer_slots[r].is_some())
            .collect();
        let sources = peer_slots.iter().flatten().flat_map(|s| s.iter()).collect();
        // A stream per slot for this rank's copies out of it: a round's copy is waited for
        // only before its slot is read into again, two rounds later.
        let ctx = self.loader.gpu().context();
        let local = [
            ctx.new_stream().map_err(cuda("cuStreamCreate"))?,
            ctx.new_stream().map_err(cuda("cuStreamCreate"))?,
        ];
        let sync_local = || -> Result<()> {
            for s in &local {
                s.synchronize().map_err(cuda("cuStreamSynchronize"))?;
            }
            Ok(())
        };
        let mut gather = gpufeed_cuda::PeerGather::new(dst.as_view_mut(), sources)?;
        let mut loads = Vec::new();
        let mut run = |gather: &mut gpufeed_cuda::PeerGather<'_>| -> Result<()> {
            for i in 0..rounds {
                let slot = (i % 2) as usize;
                // This rank's round into its slot (once its copy out of it two rounds ago
                // has finished), and from there into place; then every copy out of the other
                // ranks' other slots (last round's) finished.
                let mine = (|| -> Result<()> {
                    if let Some(r) = part(&shares[me], i) {
                        local[slot]
                            .synchronize()
                            .map_err(cuda("cuStreamSynchronize"))?;
                        let len = (r.end - r.start) as usize;
                        let mut view = slots[slot].slice_mut(..len);
                        loads.push(self.loader.load_spans_to(
                            path,
                            std::slice::from_ref(&r),
                            &mut view,
                        )?);
                        let mut into = gather.dst_mut(r.start as usize..r.end as usize)?;
                        local[slot]
                            .memcpy_dtod(&slots[slot].slice(..len), &mut into)
                            .map_err(cuda("cuMemcpyDtoDAsync"))?;
                    }
                    Ok(gather.wait()?)
                })();
                let status = self.exchange(&[u8::from(mine.is_ok())])?;
                mine?;
                if let Some(rank) = status.iter().position(|s| s.first() != Some(&1)) {
                    return Err(Error::RankFailed { rank });
                }
                // Every rank's round `i` is in its slot: copy the others' here (rank `r`
                // writes that slot again only after the next meeting, which this rank reaches
                // once these copies are done).
                for (k, &r) in ranks.iter().enumerate() {
                    if let Some(range) = part(&shares[r], i) {
                        let len = (range.end - range.start) as usize;
                        gather.copy(2 * k + slot, 0, range.start as usize, len)?;
                    }
                }
            }
            gather.wait()?;
            sync_local()
        };
        let outcome = run(&mut gather);
        // Whatever happened, nothing still copies into `dst` or out of a slot after this.
        let outcome = outcome
            .and(gather.wait().map_err(Error::from))
            .and(sync_local());
        drop(gather);
        // Every rank's copies out of every other rank's slots have completed once all have
        // said how their part went (each finished its copies first): the slots are free again.
        let status = self.exchange(&[u8::from(outcome.is_ok())])?;
        outcome?;
        if let Some(rank) = status.iter().position(|s| s.first() != Some(&1)) {
            return Err(Error::RankFailed { rank });
        }
        Ok(loads)
    }

    /// The collective part of a replicated load into `dst` (this rank's copy, `cuMemAlloc`
    /// memory) through CUDA IPC handles: each rank writes its share into every other's copy.
    fn replicate_into(
        &self,
        dst: &mut DeviceBuffer,
        path: &Path,
        shares: &[Range<u64>],
    ) -> Result<Vec<LoadReport>> {
        let (n, me) = (self.world(), self.rank());
        let len = dst.len();
        if len == 0 {
            // Every rank agreed on the file, so every rank skips the exchanges alike.
            return Ok(Vec::new());
        }
        let gpu = self.loader.gpu();
        let handle = gpufeed_cuda::IpcHandle::of(dst)?;
        let handles = self.exchange(&handle.0)?;
        // Open every other rank's copy; then this rank's part, sent to each of them.
        // Opening the others' copies (a mapping of all their bytes each) runs on a thread
        // while this one reads its first round; the round is sent once they are open.
        let open_peers = || -> Result<Vec<gpufeed_cuda::IpcMemory>> {
            handles
                .iter()
                .enumerate()
                .filter(|(r, _)| *r != me)
                .map(|(r, h)| {
                    let h: [u8; 64] = h.as_slice().try_into().map_err(|_| {
                        Error::InvalidSetting(format!(
                            "rank {r} passed a handle of {} bytes",
                            h.len()
                        ))
                    })?;
                    Ok(gpufeed_cuda::IpcMemory::open(
                        gpu,
                        gpufeed_cuda::IpcHandle(h),
                        len,
                    )?)
                })
                .collect()
        };
        let share = shares[me].clone();
        let part = share.end - share.start;
        let first = self.round_bytes.min(part);
        let read = |view: &mut gpufeed_cuda::cudarc::driver::CudaViewMut<'_, u8>, at: u64| {
            let file = share.start + at..share.start + at + view.len() as u64;
            self.loader
                .load_spans_to(path, std::slice::from_ref(&file), view)
        };
        let cut: Vec<usize> = shares[1..n].iter().map(|s| s.start as usize).collect();
        let outcome = gpufeed_cuda::split_mut(dst, &cut)
            .and_then(|v| v.into_iter().nth(me))
            .ok_or_else(|| Error::InvalidSetting("replicated shares overflow".into()))
            .and_then(|mut own| {
                let (peers, first_load) = std::thread::scope(|s| {
                    let opener = s.spawn(|| {
                        let t = Instant::now();
                        let opened = Gpu::keeping_current_context(open_peers);
                        if n > 1 {
                            self.timings.lock().peer_open = t.elapsed().as_secs_f64();
                        }
                        opened
                    });
                    let first_load = read(&mut own.slice_mut(..first as usize), 0);
                    let peers = opener.join().map_err(|_| Error::ThreadPanicked {
                        what: "the thread opening the other ranks' memory",
                    });
                    (peers, first_load)
                });
                let peers = peers??;
                let mut loads = vec![first_load?];
                let targets = peers.iter().map(|m| (m, share.start as usize)).collect();
                let mut fanout = PeerFanout::to_ipc(own, targets)?;
                fanout.send(0..first as usize)?;
                let mut at = first;
                while at < part {
                    let step = self.round_bytes.min(part - at);
                    let (a, b) = (at as usize, (at + step) as usize);
                    loads.push(read(&mut fanout.own_mut(a..b)?, at)?);
                    fanout.send(a..b)?;
                    at += step;
                }
                fanout.finish()?;
                let t = Instant::now();
                drop(peers);
                self.timings.lock().peer_close = t.elapsed().as_secs_f64();
                Ok(loads)
            });
        // Every rank's copies into every other rank's memory have completed once all have
        // said how their part went: only then may any of them give its memory back.
        let status = self.exchange(&[u8::from(outcome.is_ok())])?;
        let loads = outcome?;
        if let Some(rank) = status.iter().position(|s| s.first() != Some(&1)) {
            return Err(Error::RankFailed { rank });
        }
        Ok(loads)
    }

    /// Runs a collective step; on an error this rank leaves the rendezvous, so that the other
    /// ranks do not wait for it.
    fn collective<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _keep = ContextGuard::new();
        *self.timings.lock() = Timings::default();
        let out = f();
        if out.is_err() {
            self.rdv.leave();
        }
        out
    }

    /// Checks that every rank passes the same `bytes` for `what`.
    fn agree(&self, what: &'static str, bytes: Vec<u8>) -> Result<()> {
        let digest = xxhash_rust::xxh3::xxh3_64(&bytes).to_le_bytes();
        let all = self.exchange(&digest)?;
        match all.iter().position(|d| d.as_slice() != all[0].as_slice()) {
            Some(rank) => Err(Error::RanksDisagree { rank, what }),
            None => Ok(()),
        }
    }

    fn report(&self, started: Instant, read: u64, peer: u64, loads: Vec<LoadReport>) -> RankReport {
        let t = self.timings.lock().clone();
        RankReport {
            rank: self.rank(),
            read_bytes: read,
            peer_bytes: peer,
            seconds: started.elapsed().as_secs_f64(),
            exchange_seconds: t.exchange,
            alloc_seconds: t.alloc,
            peer_open_seconds: t.peer_open,
            peer_close_seconds: t.peer_close,
            loads,
        }
    }

    /// Waits until every rank of the job has called `barrier` (as many times): ranks that
    /// time their loads start them together this way.
    ///
    /// # Errors
    /// The rendezvous's: a rank that died, left or never arrived, named.
    pub fn barrier(&self) -> Result<()> {
        Ok(self.rdv.barrier()?)
    }

    /// [`gpufeed_ipc::Rendezvous::exchange`], its wait counted in this call's timings.
    fn exchange(&self, payload: &[u8]) -> Result<Vec<Vec<u8>>> {
        let t = Instant::now();
        let out = self.rdv.exchange(payload);
        self.timings.lock().exchange += t.elapsed().as_secs_f64();
        Ok(out?)
    }
}

impl ShardPlan {
    /// `len` bytes cut into `ranks` contiguous shares, each boundary the 4 KiB multiple
    /// nearest to an even cut (so a share is within 4 KiB of `len / ranks`).
    fn split_len(len: u64, ranks: usize) -> Vec<Range<u64>> {
        let at = |r: usize| {
            if r == ranks {
                len
            } else {
                let even = u128::from(len) * r as u128 / ranks as u128;
                let nearest =
                    (even + u128::from(ALIGN) / 2) / u128::from(ALIGN) * u128::from(ALIGN);
                nearest.min(u128::from(len)) as u64
            }
        };
        (0..ranks).map(|r| at(r)..at(r + 1)).collect()
    }
}

/// How many rounds of `round` bytes the largest of `shares` takes.
fn rounds_of(shares: &[Range<u64>], round: u64) -> u64 {
    shares
        .iter()
        .map(|s| (s.end - s.start).div_ceil(round))
        .max()
        .unwrap_or(0)
}

/// Round `i` (of `round` bytes) of `share`, if it has one.
fn round_part(share: &Range<u64>, i: u64, round: u64) -> Option<Range<u64>> {
    let start = share.start + i * round;
    (start < share.end).then(|| start..share.end.min(start + round))
}

/// GPU `g`'s part of a replicated load: reads its share (bytes `share` of the range starting at
/// `base` in `path`) into `own`, `round` bytes at a time, copying each round to every peer's
/// view while it reads the next.
#[allow(clippy::too_many_arguments, reason = "the parts of one thread's work")]
fn share_out(
    loader: &Loader,
    (path, base): (&Path, u64),
    share: Range<u64>,
    round: u64,
    own: Option<CudaViewMut<'_, u8>>,
    peers: Vec<CudaViewMut<'_, u8>>,
    failed: &AtomicBool,
) -> Result<(Vec<LoadReport>, f64)> {
    let t = Instant::now();
    let Some(own) = own else {
        return Ok((Vec::new(), 0.0));
    };
    let mut fanout = PeerFanout::new(own, peers)?;
    let mut reports = Vec::new();
    let len = share.end - share.start;
    let mut at = 0u64;
    while at < len {
        if failed.load(Ordering::Relaxed) {
            break;
        }
        let n = round.min(len - at);
        let (a, b) = (at as usize, (at + n) as usize);
        let file = base + share.start + at..base + share.start + at + n;
        {
            let mut part = fanout.own_mut(a..b)?;
            reports.push(loader.load_spans_to(path, std::slice::from_ref(&file), &mut part)?);
        }
        fanout.send(a..b)?;
        at += n;
    }
    fanout.finish()?;
    Ok((reports, t.elapsed().as_secs_f64()))
}

/// Rank `rank`'s spans of `plan` with `loader`, into one new device buffer: one load per run of
/// spans of the same file, each into its part.
fn load_rank(
    loader: &Loader,
    plan: &ShardPlan,
    rank: usize,
) -> Result<(DeviceBuffer, Vec<LoadReport>)> {
    let spans = plan.spans(rank);
    let len = plan.bytes(rank) as usize;
    loader
        .gpu()
        .alloc_filled(len, loader.device_alloc(len), |dst| {
            let runs = runs(spans);
            let bounds: Vec<usize> = runs
                .iter()
                .scan(0usize, |at, r| {
                    *at +=
                        r.1.iter()
                            .map(|s| (s.end - s.start) as usize)
                            .sum::<usize>();
                    Some(*at)
                })
                .collect();
            let cut = &bounds[..bounds.len().saturating_sub(1)];
            let views = gpufeed_cuda::split_mut(dst, cut)
                .ok_or_else(|| Error::InvalidSetting("a shard plan's spans overflow".into()))?;
            let mut reports = Vec::with_capacity(runs.len());
            for ((file, spans), mut view) in runs.into_iter().zip(views) {
                reports.push(loader.load_spans_to(&plan.files[file], &spans, &mut view)?);
            }
            Ok::<_, Error>(reports)
        })
}

/// Consecutive spans of the same file, grouped: `(file, ranges)`.
fn runs(spans: &[Span]) -> Vec<(usize, Vec<Range<u64>>)> {
    let mut out: Vec<(usize, Vec<Range<u64>>)> = Vec::new();
    for s in spans {
        match out.last_mut() {
            Some((f, ranges)) if *f == s.file => ranges.push(s.range.clone()),
            _ => out.push((s.file, vec![s.range.clone()])),
        }
    }
    out
}

/// `f(i, item)` for every item at once, on a thread each (the items move into their
/// threads); the first error (in item order) wins, after every thread has ended.
fn in_parallel<I: Send, T: Send>(
    items: impl IntoIterator<Item = I>,
    what: &'static str,
    f: impl Fn(usize, I) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                let f = &f;
                s.spawn(move || f(i, item))
            })
            .collect();
        let results: Vec<Result<T>> = handles
            .into_iter()
            .map(|h| h.join().map_err(|_| Error::ThreadPanicked { what })?)
            .collect();
        results.into_iter().collect()
    })
}

/// [`Error::InvalidSetting`] unless a plan of `ranks` ranks fits `have` GPUs (`on`: where
/// they are, "on a loader of", "in a job on this machine of").
fn check_ranks(ranks: usize, have: usize, on: &str) -> Result<()> {
    if ranks != have {
        return Err(Error::InvalidSetting(format!(
            "a plan for {ranks} ranks {on} {have} GPUs; plan for {have}"
        )));
    }
    Ok(())
}

fn check_ordinals(ordinals: &[usize]) -> Result<()> {
    if ordinals.is_empty() {
        return Err(Error::InvalidSetting(
            "a multi-GPU loader needs at least one GPU".into(),
        ));
    }
    for (i, o) in ordinals.iter().enumerate() {
        if ordinals[..i].contains(o) {
            return Err(Error::InvalidSetting(format!(
                "GPU {o} is given twice; give each GPU once"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_len_covers_in_aligned_shares() {
        let s = ShardPlan::split_len(10 * 4096 + 3, 3);
        assert_eq!(s, vec![0..12288, 12288..28672, 28672..40963]);
        assert_eq!(ShardPlan::split_len(100, 2), vec![0..0, 0..100]);
        assert_eq!(ShardPlan::split_len(6000, 2), vec![0..4096, 4096..6000]);
    }
}
