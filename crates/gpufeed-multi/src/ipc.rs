//! Replication through CUDA IPC handles: each rank's copy from `cuMemAlloc`, opened by the
//! others, who write their shares into it ([`Replication::Ipc`]).

use std::ops::Range;
use std::time::Instant;

use gpufeed_cuda::{Gpu, PeerFanout};
use gpufeed_load::{DeviceBuffer, LoadReport};

use gpufeed_os::OpenedFile;

use crate::error::{Error, Result};
use crate::rank::RankLoader;

impl RankLoader {
    /// The collective part of a replicated load into `dst` (this rank's copy, `cuMemAlloc`
    /// memory) through CUDA IPC handles: each rank writes its share into every other's copy.
    pub(crate) fn replicate_into(
        &self,
        dst: &mut DeviceBuffer,
        file: &OpenedFile,
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
                        Error::invalid(format!("rank {r} passed a handle of {} bytes", h.len()))
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
        // One route for every round of this rank's share, chosen once.
        let choice = self.loader.choose_route(file, share.clone());
        let read = |view: &mut gpufeed_cuda::cudarc::driver::CudaViewMut<'_, u8>, at: u64| {
            let span = share.start + at..share.start + at + view.len() as u64;
            self.loader.load_round(file, span, view, &choice)
        };
        let cut: Vec<usize> = shares[1..n].iter().map(|s| s.start as usize).collect();
        let outcome = gpufeed_cuda::split_mut(dst, &cut)
            .and_then(|v| v.into_iter().nth(me))
            .ok_or_else(|| Error::invalid("replicated shares overflow".into()))
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
                    let peers = opener
                        .join()
                        .map_err(|_| gpufeed_load::Error::ThreadPanicked {
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
}
