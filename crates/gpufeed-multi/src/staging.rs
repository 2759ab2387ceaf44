//! Replication through staging slots the ranks share: a memory pool per rank that the others
//! map once, each round read into a slot and copied out of it by every rank
//! ([`Replication::Staging`]).

use std::ops::Range;

use gpufeed_cuda::Gpu;
use gpufeed_load::{DeviceBuffer, LoadReport};

use gpufeed_os::OpenedFile;

use crate::error::{Error, Result};
use crate::plan::{round_part, rounds_of};
use crate::rank::{RankLoader, RankPools, Staging};

impl RankLoader {
    /// Makes the ranks' shared pools (collective: every rank's first replicated load of
    /// several ranks). Every rank decides alike from what all of them report: `Unshared` when
    /// some rank cannot make or import a shareable pool (said once, in its own output).
    pub(crate) fn make_pools(&self) -> Result<Staging> {
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
    pub(crate) fn grow_slots(&self, p: &mut RankPools, want: usize) -> Result<()> {
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

    /// The collective part of a replicated load through the ranks' staging slots, into `dst`
    /// (this rank's copy). In lock step, round by round: each rank reads its round into slot
    /// `i % 2` and copies it into place; all meet (saying whether their part went well, and
    /// having finished their copies out of the other slot); each copies every other rank's
    /// round out of that rank's slot while it reads its next round.
    pub(crate) fn replicate_staged(
        &self,
        dst: &mut DeviceBuffer,
        file: &OpenedFile,
        shares: &[Range<u64>],
        p: &mut RankPools,
    ) -> Result<Vec<LoadReport>> {
        let me = self.rank();
        // One route for every round of this rank's share, chosen once.
        let choice = self.loader.choose_route(file, shares[me].clone());
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
                        loads.push(
                            self.loader
                                .load_round(file, r.clone(), &mut view, &choice)?,
                        );
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
}
