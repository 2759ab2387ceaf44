//! One process per GPU: [`RankLoader`] (the rendezvous, collective sharded, tensor-parallel
//! and replicated loads) and how its replicated loads copy between ranks ([`Replication`]).

use std::path::Path;
use std::time::Instant;

use gpufeed_cuda::{ContextGuard, DeviceAlloc, Gpu};
use gpufeed_load::{DeviceBuffer, LoadOptions, LoadReport, Loader};
use gpufeed_safetensors::{self as safetensors, Checkpoint, TensorParallel};

use gpufeed_load::internal::check_unchanged;
use gpufeed_os::OpenedFile;

use crate::error::{Error, Result};
use crate::multi_loader::load_rank;
use crate::plan::{ShardPlan, check_ranks};

/// Bytes each GPU of a replicated load reads per round before sending them to its peers: the
/// peer copies of a round overlap the reads of the next, and the last round's (a few ms over
/// NVLink) is all that is left after the reads. Each round costs about a millisecond more than
/// its bytes (16 GiB on two H200s: 0.32 s in rounds of 64 MiB, 0.21 s of 256 MiB, 0.19 s of
/// 1 GiB and of 4 GiB; docs/benchmarks.md, GPU run 45).
pub(crate) const ROUND_BYTES: u64 = 1 << 30;

/// How long a dropped [`RankLoader`] with shared staging waits for the other ranks to let go
/// of its slots (see its `Drop`).
pub(crate) const LET_GO_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The most bytes of one staging slot of [`RankLoader`]'s replicated loads: the most another
/// process maps of a shared pool ([`gpufeed_cuda::SHARED_MAP_MAX_BYTES`], 4 GiB: larger ones
/// crashed the driver). So the ranks never map each other's copies, only slots.
pub const SHARED_SLOT_MAX_BYTES: u64 = gpufeed_cuda::SHARED_MAP_MAX_BYTES as u64;

/// How a [`RankLoader`]'s replicated loads copy each rank's share into the other ranks' copies
/// (`GPUFEED_REPLICATE=staging|ipc|nccl` for [`RankLoader::from_env`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Replication {
    /// Through staging slots in a memory pool that each rank keeps and the others map once
    /// ([`RankLoader::with_shared_staging`]); where some rank's driver cannot share pools,
    /// through IPC handles instead. The default.
    #[default]
    Staging,
    /// Through CUDA IPC handles of each rank's copy (`cuMemAlloc` memory the others open and
    /// write into, per load).
    Ipc,
    /// Through NCCL broadcasts, each rank the root of its share ([`RankLoader::with_nccl`]).
    Nccl,
}

impl Replication {
    /// The name the ranks of a job agree on before a replicated load (keep these strings: ranks
    /// of two gpufeed versions compare them).
    pub(crate) fn wire_name(self) -> &'static str {
        match self {
            Replication::Staging => "shared staging",
            Replication::Ipc => "IPC handles",
            Replication::Nccl => "NCCL",
        }
    }
}

impl std::fmt::Display for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.wire_name())
    }
}

/// A [`RankLoader`]'s replication and what its two older switches said: `with_nccl(false)`
/// goes back to what `with_shared_staging` chose last, as the two booleans they set did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Switches {
    /// The replication the next replicated load uses.
    pub(crate) now: Replication,
    /// Whether staging slots are wanted when NCCL is off.
    pub(crate) shared_staging: bool,
}

impl Default for Switches {
    fn default() -> Self {
        Switches {
            now: Replication::Staging,
            shared_staging: true,
        }
    }
}

impl Switches {
    fn off_nccl(&self) -> Replication {
        if self.shared_staging {
            Replication::Staging
        } else {
            Replication::Ipc
        }
    }

    /// `with_shared_staging`.
    pub(crate) fn shared_staging(&mut self, shared: bool) {
        self.shared_staging = shared;
        if self.now != Replication::Nccl {
            self.now = self.off_nccl();
        }
    }

    /// `with_nccl`.
    pub(crate) fn nccl(&mut self, nccl: bool) {
        self.now = if nccl {
            Replication::Nccl
        } else {
            self.off_nccl()
        };
    }

    /// `with_replication`.
    pub(crate) fn set(&mut self, r: Replication) {
        self.now = r;
        match r {
            Replication::Staging => self.shared_staging = true,
            Replication::Ipc => self.shared_staging = false,
            Replication::Nccl => {}
        }
    }
}

impl std::str::FromStr for Replication {
    type Err = Error;

    /// `staging`, `ipc` or `nccl` (as `GPUFEED_REPLICATE` takes them).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "staging" => Ok(Replication::Staging),
            "ipc" => Ok(Replication::Ipc),
            "nccl" => Ok(Replication::Nccl),
            other => Err(Error::invalid(format!(
                "GPUFEED_REPLICATE={other:?}: use staging (the default), ipc or nccl"
            ))),
        }
    }
}

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
/// let rank = gpufeed_multi::RankLoader::from_env()?;
/// let (weights, report) = rank.load_replicated("model.bin")?;
/// println!("rank {}: {} bytes in {:.0} ms", rank.rank(), weights.len(), report.seconds * 1e3);
/// # Ok::<(), gpufeed_multi::Error>(())
/// ```
pub struct RankLoader {
    pub(crate) loader: Loader,
    pub(crate) rdv: gpufeed_ipc::Rendezvous,
    pub(crate) round_bytes: u64,
    /// How replicated loads copy between the ranks.
    pub(crate) replication: Switches,
    /// The staging slots, made by the first replicated load of several ranks.
    pub(crate) pools: parking_lot::Mutex<Staging>,
    /// Where the current collective call's time went (reset by each).
    pub(crate) timings: parking_lot::Mutex<Timings>,
}

/// The parts of a collective call that [`RankReport`] breaks out.
#[derive(Debug, Clone, Default)]
pub(crate) struct Timings {
    pub(crate) exchange: f64,
    pub(crate) alloc: f64,
    pub(crate) peer_open: f64,
    pub(crate) peer_close: f64,
}

/// Replicated loads' staging between the ranks.
#[derive(Debug)]
pub(crate) enum Staging {
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
pub(crate) struct RankPools {
    /// The other ranks' two slots, in rank order; `None` in this rank's place.
    pub(crate) peer_slots: Vec<Option<[gpufeed_cuda::IpcMemory; 2]>>,
    /// This rank's two slots (`slot_bytes` each; none before the first load).
    pub(crate) slots: Vec<DeviceBuffer>,
    pub(crate) slot_bytes: usize,
    /// The other ranks' pools, imported here; `None` in this rank's place.
    pub(crate) peer_pools: Vec<Option<std::sync::Arc<gpufeed_cuda::ImportedPool>>>,
    pub(crate) own: gpufeed_cuda::SharedPool,
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
    /// the ranks as a [`MultiLoader`](crate::MultiLoader) does); returns once every rank has its GPU open.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for a job name that cannot name shared memory;
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
            return Err(Error::invalid(format!(
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
            replication: Switches::default(),
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
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) when neither `GPUFEED_JOB`, `TORCHELASTIC_RUN_ID` nor
    /// `MASTER_ADDR` and `MASTER_PORT` are set.
    pub fn job_from_env() -> Result<String> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let job = match var("GPUFEED_JOB") {
            Some(job) => job,
            None => {
                let run = var("TORCHELASTIC_RUN_ID");
                let master = var("MASTER_ADDR").zip(var("MASTER_PORT"));
                if run.is_none() && master.is_none() {
                    return Err(Error::invalid(
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
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) naming a missing or malformed variable; [`RankLoader::join`]'s.
    pub fn from_env() -> Result<Self> {
        let num = |name: &str| -> Result<usize> {
            let v = std::env::var(name).map_err(|_| {
                Error::invalid(format!(
                    "{name} is not set: start the processes with torchrun (or set LOCAL_RANK and LOCAL_WORLD_SIZE)"
                ))
            })?;
            v.trim()
                .parse()
                .map_err(|_| Error::invalid(format!("{name}={v:?} is not a number")))
        };
        let (rank, world) = (num("LOCAL_RANK")?, num("LOCAL_WORLD_SIZE")?);
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let replication = match var("GPUFEED_REPLICATE") {
            None => Replication::default(),
            Some(v) => v.parse()?,
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
        Ok(joined?.with_replication(replication))
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
    ///
    /// The same as [`RankLoader::with_replication`]`(Replication::Staging)` (`true`) or
    /// `(Replication::Ipc)` (`false`); it leaves [`Replication::Nccl`], once chosen, as it is.
    pub fn with_shared_staging(mut self, shared: bool) -> Self {
        self.replication.shared_staging(shared);
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
    ///
    /// The same as [`RankLoader::with_replication`]`(Replication::Nccl)` (`true`); `false`
    /// turns NCCL off again, back to what [`RankLoader::with_shared_staging`] chose (staging
    /// slots by default), as the two switches did before [`Replication`].
    pub fn with_nccl(mut self, nccl: bool) -> Self {
        self.replication.nccl(nccl);
        self
    }

    /// How replicated loads copy between the ranks ([`Replication`]; default
    /// [`Replication::Staging`]): choose it before the first replicated load; every rank must
    /// pass the same one (checked with the file).
    pub fn with_replication(mut self, replication: Replication) -> Self {
        self.replication.set(replication);
        self
    }

    /// How replicated loads copy between the ranks.
    pub fn replication(&self) -> Replication {
        self.replication.now
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

    /// Whether every rank says `yes` (collective).
    pub(crate) fn all_ranks(&self, yes: bool) -> Result<bool> {
        let all = self.exchange(&[u8::from(yes)])?;
        Ok(all.iter().all(|s| s.first() == Some(&1)))
    }

    /// Loads this rank's spans of `plan` (the same plan on every rank: checked) into one
    /// device buffer.
    ///
    /// # Errors
    /// [`Error::RanksDisagree`]; [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for a plan of another number of
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
    /// rendezvous errors naming a rank that died or left; [`Error::FileChangedDuringLoad`](gpufeed_load::Error::FileChangedDuringLoad);
    /// this rank's load and CUDA errors (IPC refused: GPUs that cannot be peers).
    pub fn load_replicated(&self, path: impl AsRef<Path>) -> Result<(DeviceBuffer, RankReport)> {
        let path = path.as_ref();
        self.collective(|| {
            let started = Instant::now();
            // Opened once: every round of every transport reads through this descriptor.
            let file = OpenedFile::open(path)?;
            let identity = *file.identity();
            let via = self.replication.now.wire_name();
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
            let nccl = self.replication.now == Replication::Nccl;
            if nccl && len > 0 {
                match &*staging {
                    Staging::Nccl(c) if !c.is_broken() => {}
                    // Aborted after an earlier failure: a new one.
                    Staging::Nccl(_) | Staging::NotYet => {
                        *staging = Staging::NotYet;
                        *staging = self.make_comm()?;
                    }
                    Staging::Shared(_) | Staging::Unshared => {
                        return Err(Error::invalid(
                            "RankLoader::with_nccl(true) came after replicated loads without \
                             NCCL: choose it before the first replicated load"
                                .into(),
                        ));
                    }
                }
            } else if self.replication.now == Replication::Staging
                && n > 1
                && len > 0
                && matches!(*staging, Staging::NotYet)
            {
                *staging = self.make_pools()?;
            }
            let (shared, comm) = match &mut *staging {
                Staging::Nccl(c) if len > 0 && nccl => (None, Some(c)),
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
            let alone = self.replication.now != Replication::Ipc && n == 1 && comm.is_none();
            let alloc = match shared.is_some() || comm.is_some() || alone {
                true => DeviceAlloc::Pool,
                false => DeviceAlloc::Unpooled,
            };
            let t = Instant::now();
            let (buf, loads) = gpu.alloc_filled(len as usize, alloc, |dst| {
                self.timings.lock().alloc = t.elapsed().as_secs_f64();
                match (shared, comm) {
                    (_, Some(c)) => self.replicate_nccl(dst, &file, &shares, c),
                    (Some(p), None) => self.replicate_staged(dst, &file, &shares, p),
                    (None, None) if alone => {
                        let whole = 0..len;
                        let spans = std::slice::from_ref(&whole);
                        Ok(vec![self.loader.load_spans_to(&file, spans, dst, None)?])
                    }
                    (None, None) => self.replicate_into(dst, &file, &shares),
                }
            })?;
            drop(staging);
            check_unchanged(&file)?;
            let read = mine.end - mine.start;
            let report = self.report(started, read, len - read, loads);
            Ok((buf, report))
        })
    }

    /// Runs a collective step; on an error this rank leaves the rendezvous, so that the other
    /// ranks do not wait for it.
    pub(crate) fn collective<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let _keep = ContextGuard::new();
        *self.timings.lock() = Timings::default();
        let out = f();
        if out.is_err() {
            self.rdv.leave();
        }
        out
    }

    /// Checks that every rank passes the same `bytes` for `what`.
    pub(crate) fn agree(&self, what: &'static str, bytes: Vec<u8>) -> Result<()> {
        let digest = xxhash_rust::xxh3::xxh3_64(&bytes).to_le_bytes();
        let all = self.exchange(&digest)?;
        match all.iter().position(|d| d.as_slice() != all[0].as_slice()) {
            Some(rank) => Err(Error::RanksDisagree { rank, what }),
            None => Ok(()),
        }
    }

    pub(crate) fn report(
        &self,
        started: Instant,
        read: u64,
        peer: u64,
        loads: Vec<LoadReport>,
    ) -> RankReport {
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
    pub(crate) fn exchange(&self, payload: &[u8]) -> Result<Vec<Vec<u8>>> {
        let t = Instant::now();
        let out = self.rdv.exchange(payload);
        self.timings.lock().exchange += t.elapsed().as_secs_f64();
        Ok(out?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every sequence of up to four calls of the two older setters gives the replication the
    /// two booleans they set gave (NCCL if `nccl`, else staging slots if `shared_staging`,
    /// else IPC handles), and `with_replication` then overrides both.
    #[test]
    fn the_older_setters_keep_the_two_booleans_meaning() {
        #[derive(Clone, Copy, Debug)]
        enum Op {
            Shared(bool),
            Nccl(bool),
        }
        let ops = [
            Op::Shared(true),
            Op::Shared(false),
            Op::Nccl(true),
            Op::Nccl(false),
        ];
        let seqs: Vec<Vec<Op>> = (0..=4u32)
            .flat_map(|len| {
                (0..4usize.pow(len)).map(move |mut code| {
                    (0..len)
                        .map(|_| {
                            let op = ops[code % 4];
                            code /= 4;
                            op
                        })
                        .collect()
                })
            })
            .collect();
        assert_eq!(seqs.len(), 1 + 4 + 16 + 64 + 256);
        for seq in &seqs {
            let (mut shared, mut nccl) = (true, false);
            let mut s = Switches::default();
            for op in seq {
                match *op {
                    Op::Shared(b) => {
                        shared = b;
                        s.shared_staging(b);
                    }
                    Op::Nccl(b) => {
                        nccl = b;
                        s.nccl(b);
                    }
                }
            }
            let old = match (nccl, shared) {
                (true, _) => Replication::Nccl,
                (false, true) => Replication::Staging,
                (false, false) => Replication::Ipc,
            };
            assert_eq!(s.now, old, "{seq:?}");
            for r in [Replication::Staging, Replication::Ipc, Replication::Nccl] {
                let mut t = s;
                t.set(r);
                assert_eq!(t.now, r);
            }
        }
        let mut s = Switches::default();
        s.set(Replication::Ipc);
        s.nccl(true);
        s.nccl(false);
        assert_eq!(
            s.now,
            Replication::Ipc,
            "NCCL off goes back to the IPC chosen before"
        );
    }

    #[test]
    fn replication_names_parse_and_stay_what_ranks_agree_on() {
        for (text, r, wire) in [
            ("staging", Replication::Staging, "shared staging"),
            ("ipc", Replication::Ipc, "IPC handles"),
            ("nccl", Replication::Nccl, "NCCL"),
        ] {
            assert_eq!(text.parse::<Replication>().expect("parses"), r);
            assert_eq!(r.wire_name(), wire);
        }
        let e = "shm".parse::<Replication>().unwrap_err();
        assert!(e.to_string().contains("GPUFEED_REPLICATE=\"shm\""), "{e}");
    }
}
