//! Several GPUs in one process: [`MultiLoader`], a loader per GPU sized together, sharded and
//! replicated loads with peer copies.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use gpufeed_cuda::cudarc::driver::CudaViewMut;
use gpufeed_cuda::{ContextGuard, DeviceAlloc, Gpu, PeerFanout, PeerLink};
use gpufeed_load::{DeviceBuffer, LoadOptions, LoadReport, Loader, Strategy};
use gpufeed_safetensors::{self as safetensors, Checkpoint, TensorParallel};

use gpufeed_load::internal::check_unchanged;
use gpufeed_os::OpenedFile;

use crate::error::{Error, Result};
use crate::plan::{ShardPlan, check_ranks, runs};
use crate::rank::ROUND_BYTES;

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
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for no GPU or a GPU given twice; [`Loader::new`]'s.
    pub fn new(gpus: &[Gpu], opts: LoadOptions) -> Result<Self> {
        let _keep = ContextGuard::new();
        let ordinals: Vec<usize> = gpus.iter().map(|g| g.info().ordinal).collect();
        check_ordinals(&ordinals)?;
        let strategy = opts.strategy;
        let loaders = in_parallel(gpus, "a thread setting up a GPU's loader", |_, g: &Gpu| {
            Loader::new(g, opts.clone()).map_err(Error::from)
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
            Loader::open(o, opts.clone()).map_err(Error::from)
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
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) when the plan's ranks are not this loader's GPUs; the error of
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
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) when the plan's ranks are not this loader's GPUs; the first
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
    /// A missing file, [`Error::FileChangedDuringLoad`](gpufeed_load::Error::FileChangedDuringLoad), and the loads' and copies' errors.
    pub fn load_replicated(
        &self,
        path: impl AsRef<Path>,
    ) -> Result<(Vec<DeviceBuffer>, MultiReport)> {
        let path = path.as_ref();
        let file = OpenedFile::open(path)?;
        let out = self.replicate(&file, 0..file.len())?;
        check_unchanged(&file)?;
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
        // Each file's data through the descriptor its header was read on.
        let (layouts, files): (Vec<_>, Vec<_>) =
            safetensors::inspect_opened(path)?.into_iter().unzip();
        let mut per_gpu: Vec<Vec<DeviceBuffer>> = (0..self.len()).map(|_| Vec::new()).collect();
        let mut report = self.report(started);
        for (layout, file) in layouts.iter().zip(&files) {
            let range = layout.data_start..layout.data_start + layout.data_bytes;
            let (bufs, r) = self.replicate(file, range)?;
            check_unchanged(file)?;
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
            .collect::<Result<Vec<_>, _>>()?;
        report.seconds = started.elapsed().as_secs_f64();
        Ok((ckpts, report))
    }

    /// Bytes `range` of `path` onto every GPU (see [`MultiLoader::load_replicated`]).
    fn replicate(
        &self,
        file: &OpenedFile,
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
                    .ok_or_else(|| Error::invalid("replicated shares overflow".into()))?;
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
                        (file, range.start),
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

/// GPU `g`'s part of a replicated load: reads its share (bytes `share` of the range starting at
/// `base` in `path`) into `own`, `round` bytes at a time, copying each round to every peer's
/// view while it reads the next.
#[allow(clippy::too_many_arguments, reason = "the parts of one thread's work")]
pub(crate) fn share_out(
    loader: &Loader,
    (file, base): (&OpenedFile, u64),
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
    // One route for every round of this GPU's share, chosen once.
    let choice = loader.choose_route(file, base + share.start..base + share.end);
    let mut reports = Vec::new();
    let len = share.end - share.start;
    let mut at = 0u64;
    while at < len {
        if failed.load(Ordering::Relaxed) {
            break;
        }
        let n = round.min(len - at);
        let (a, b) = (at as usize, (at + n) as usize);
        let span = base + share.start + at..base + share.start + at + n;
        {
            let mut part = fanout.own_mut(a..b)?;
            reports.push(loader.load_round(file, span, &mut part, &choice)?);
        }
        fanout.send(a..b)?;
        at += n;
    }
    fanout.finish()?;
    Ok((reports, t.elapsed().as_secs_f64()))
}

/// Rank `rank`'s spans of `plan` with `loader`, into one new device buffer: one load per run of
/// spans of the same file, each into its part.
pub(crate) fn load_rank(
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
                .ok_or_else(|| Error::invalid("a shard plan's spans overflow".into()))?;
            let mut reports = Vec::with_capacity(runs.len());
            // Each file of the plan opened once, whatever the runs of spans in it.
            let mut opened: Vec<(usize, OpenedFile)> = Vec::new();
            for ((file, spans), mut view) in runs.into_iter().zip(views) {
                let opened = match opened.iter().position(|(f, _)| *f == file) {
                    Some(i) => &opened[i].1,
                    None => {
                        let f = OpenedFile::open(&plan.files[file])?;
                        if f.len() != plan.lens[file] {
                            return Err(gpufeed_load::Error::FileChangedDuringLoad {
                                path: plan.files[file].clone(),
                                what: format!(
                                    "{} bytes where the plan saw {}",
                                    f.len(),
                                    plan.lens[file]
                                ),
                            }
                            .into());
                        }
                        opened.push((file, f));
                        &opened[opened.len() - 1].1
                    }
                };
                reports.push(loader.load_spans_to(opened, &spans, &mut view, None)?);
            }
            Ok::<_, Error>(reports)
        })
}

/// `f(i, item)` for every item at once, on a thread each (the items move into their
/// threads); the first error (in item order) wins, after every thread has ended.
pub(crate) fn in_parallel<I: Send, T: Send>(
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
            .map(|h| {
                h.join()
                    .map_err(|_| gpufeed_load::Error::ThreadPanicked { what })?
            })
            .collect();
        results.into_iter().collect()
    })
}

pub(crate) fn check_ordinals(ordinals: &[usize]) -> Result<()> {
    if ordinals.is_empty() {
        return Err(Error::invalid(
            "a multi-GPU loader needs at least one GPU".into(),
        ));
    }
    for (i, o) in ordinals.iter().enumerate() {
        if ordinals[..i].contains(o) {
            return Err(Error::invalid(format!(
                "GPU {o} is given twice; give each GPU once"
            )));
        }
    }
    Ok(())
}
