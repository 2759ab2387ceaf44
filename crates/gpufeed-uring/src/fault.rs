//! Fault injection: an engine wrapper that makes reads fail or come back short, in a different
//! order and late, driven by a seed. Used by the tests of every backend through the hidden test
//! hook `ReaderBuilder::fault_injection` (not API: it may change without notice).

use std::io;

use crate::engine::{Engine, RawRead, RawResult};

/// Which faults to inject, with what probability (0.0 to 1.0 each).
#[derive(Debug, Clone, PartialEq)]
pub struct FaultPlan {
    /// Seed of the pseudo-random choices: the same seed gives the same faults. Print it when a
    /// test fails.
    pub seed: u64,
    /// A read returns fewer bytes than asked (at least one; alignment kept under O_DIRECT).
    pub short_read: f64,
    /// A read fails with `EINTR` without reading.
    pub eintr: f64,
    /// A read fails with `EAGAIN` without reading.
    pub eagain: f64,
    /// A read fails with `EIO` (a real error: the read must fail).
    pub eio: f64,
    /// Completions are returned in a shuffled order.
    pub reorder: bool,
    /// Each wait sleeps up to this many microseconds first.
    pub max_delay_us: u64,
    /// Opening a file with `O_DIRECT` fails with `EINVAL`, as on file systems that refuse it
    /// at open time (the reader then reads that file buffered, or refuses under `Direct::On`).
    pub direct_open_einval: bool,
}

impl FaultPlan {
    /// No faults at all (a starting point for the builder-style setters).
    pub fn none(seed: u64) -> Self {
        FaultPlan {
            seed,
            short_read: 0.0,
            eintr: 0.0,
            eagain: 0.0,
            eio: 0.0,
            reorder: false,
            max_delay_us: 0,
            direct_open_einval: false,
        }
    }

    /// Short reads, EINTR and EAGAIN (each 20%), reordering and small delays: everything a
    /// correct reader must absorb without an error.
    pub fn recoverable(seed: u64) -> Self {
        FaultPlan {
            seed,
            short_read: 0.2,
            eintr: 0.2,
            eagain: 0.2,
            eio: 0.0,
            reorder: true,
            max_delay_us: 50,
            direct_open_einval: false,
        }
    }
}

pub(crate) struct FaultEngine {
    inner: Box<dyn Engine>,
    plan: FaultPlan,
    rng: u64,
    /// Synthetic completions (injected errors) not yet returned.
    injected: Vec<RawResult>,
}

impl FaultEngine {
    pub(crate) fn new(inner: Box<dyn Engine>, plan: FaultPlan) -> Self {
        let rng = plan.seed ^ 0x5DEE_CE66_D1CE_4E5B;
        FaultEngine {
            inner,
            plan,
            rng,
            injected: Vec::new(),
        }
    }

    fn next(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

impl Engine for FaultEngine {
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.injected.len()
    }

    unsafe fn push(&mut self, mut read: RawRead) -> io::Result<()> {
        for (p, errno) in [
            (self.plan.eio, libc::EIO),
            (self.plan.eintr, libc::EINTR),
            (self.plan.eagain, libc::EAGAIN),
        ] {
            if self.chance(p) {
                self.injected
                    .push((read.tag, Err(io::Error::from_raw_os_error(errno))));
                return Ok(());
            }
        }
        let units = read.len / read.align.max(1);
        if units > 1 && self.chance(self.plan.short_read) {
            read.len = (1 + (self.next() % u64::from(units - 1)) as u32) * read.align.max(1);
        }
        // SAFETY: the caller's promise for `read` is passed on unchanged (a shorter length
        // names a part of the same memory).
        unsafe { self.inner.push(read) }
    }

    fn wait(&mut self, min: usize, out: &mut Vec<RawResult>) -> io::Result<()> {
        if self.plan.max_delay_us > 0 {
            let us = self.next() % (self.plan.max_delay_us + 1);
            std::thread::sleep(std::time::Duration::from_micros(us));
        }
        let start = out.len();
        let from_injected = self.injected.len().min(min);
        out.append(&mut self.injected);
        let need = min
            .saturating_sub(from_injected)
            .min(self.inner.in_flight());
        self.inner.wait(need, out)?;
        if self.plan.reorder {
            let batch = &mut out[start..];
            for i in (1..batch.len()).rev() {
                let j = (self.next() % (i as u64 + 1)) as usize;
                batch.swap(i, j);
            }
        }
        Ok(())
    }

    unsafe fn register_buffers(&mut self, bufs: &[(*mut u8, usize)]) -> io::Result<bool> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.register_buffers(bufs) }
    }

    fn register_file(&mut self, index: u32, fd: std::os::fd::RawFd) -> Option<u32> {
        self.inner.register_file(index, fd)
    }

    fn unregister_file(&mut self, index: u32) {
        self.inner.unregister_file(index)
    }

    fn prefetch(&mut self, fd: std::os::fd::RawFd, offset: u64, len: u64) -> io::Result<()> {
        self.inner.prefetch(fd, offset, len)
    }
}
