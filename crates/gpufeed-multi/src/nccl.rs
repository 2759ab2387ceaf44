//! Replication through NCCL: each rank reads its share into its own copy, one group of
//! broadcasts per round fills the others' ([`Replication::Nccl`]).

use std::ops::Range;
use std::time::Instant;

use gpufeed_load::{DeviceBuffer, LoadReport};

use gpufeed_os::OpenedFile;

use crate::error::{Error, Result};
use crate::plan::{round_part, rounds_of};
use crate::rank::{RankLoader, Staging};

/// How long the ranks' NCCL communicator may take to come up while every rank lives.
pub(crate) const NCCL_SETUP_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl RankLoader {
    /// Makes the ranks' NCCL communicator (collective: the first replicated load through
    /// NCCL). Every rank first learns that every other rank has a GPU of its own and NCCL,
    /// so that all fail alike, each saying why.
    pub(crate) fn make_comm(&self) -> Result<Staging> {
        let t = Instant::now();
        let (n, me) = (self.world(), self.rank());
        let gpu = self.loader.gpu();
        let bus = &gpu.info().pci_bus_id;
        let all = self.exchange(bus.as_bytes())?;
        for (b, theirs) in all.iter().enumerate() {
            if let Some(a) = all[..b].iter().position(|x| x == theirs) {
                return Err(Error::invalid(format!(
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
            return Err(Error::invalid(format!(
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

    /// The collective part of a replicated load through NCCL, into `dst` (this rank's copy):
    /// round by round, this rank reads its round into place, then one group of broadcasts
    /// (each rank the root of its round) fills the others' rounds while it reads the next.
    /// Every wait on NCCL watches the other ranks: one that fails leaves the rendezvous, and
    /// the others abort the communicator and fail naming it.
    pub(crate) fn replicate_nccl(
        &self,
        dst: &mut DeviceBuffer,
        file: &OpenedFile,
        shares: &[Range<u64>],
        comm: &mut gpufeed_cuda::NcclComm,
    ) -> Result<Vec<LoadReport>> {
        let me = self.rank();
        // One route for every round of this rank's share, chosen once.
        let choice = self.loader.choose_route(file, shares[me].clone());
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
                        loads.push(self.loader.load_round(file, r, &mut view, &choice)?);
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
}
