//! Host-to-device copy throughput of many copies of one size from page-locked memory: what
//! the copy engines give to batches of that size, and what it costs them that the CPU wrote
//! the source just before.
//!
//! ```text
//! cargo run --release -p gpufeed-cuda --example copy_rate -- SIZE_KIB STREAMS COPIES SRC THREADS
//! ```
//! THREADS threads each issue COPIES / THREADS copies round-robin over STREAMS shared streams,
//! each from a source buffer of its own to a destination of its own (32 of each per thread,
//! taken in turn; an event recorded after each copy is waited for before its buffers are used
//! again; every buffer made before the clock). SRC is where the sources come from, `alloc`
//! (`cuMemHostAlloc`) or `reg` (a `PinnedPool`'s registered buffers, as the batch loader's),
//! and how they are written before each copy: nothing (`reg`), a plain copy (`reg+w`),
//! non-temporal stores (`reg+nt`), a plain copy then `cldemote` of every line (`reg+demote`)
//! or `clwb` of every line (`reg+clwb`; off x86_64 every way of writing is a plain copy). GPU runs 201, 203, 205
//! and 207 (docs/benchmarks.md) ran its earlier forms (which made the buffers, and the 64 MiB
//! the sources are written from, inside each timed round).
#![allow(unsafe_code, reason = "raw driver copies and cache-line instructions")]

use std::sync::Arc;
use std::time::Instant;

use gpufeed_cuda::cudarc::driver::{CudaEvent, DevicePtrMut, sys};
use gpufeed_pinned::{PinnedBuffer, PinnedPool, PoolMode, PoolOptions, PooledBuffer};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How each source is written before its copy.
#[derive(Clone, Copy, PartialEq)]
enum Write {
    None,
    Plain,
    NonTemporal,
    Demote,
    Clwb,
}

enum Source {
    Alloc(PinnedBuffer),
    Pooled(PooledBuffer),
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 5 {
        return Err("usage: copy_rate SIZE_KIB STREAMS COPIES SRC THREADS".into());
    }
    let (kib, nstreams, copies): (usize, usize, usize) =
        (args[0].parse()?, args[1].parse()?, args[2].parse()?);
    let (src_kind, threads): (&str, usize) = (&args[3], args[4].parse()?);
    let write = match src_kind.split_once('+').map(|(_, w)| w) {
        None => Write::None,
        Some("w") => Write::Plain,
        Some("nt") => Write::NonTemporal,
        Some("demote") => Write::Demote,
        Some("clwb") => Write::Clwb,
        Some(other) => return Err(format!("unknown way of writing: {other}").into()),
    };
    if kib == 0 || nstreams == 0 || threads == 0 || copies < threads {
        return Err(
            "SIZE_KIB, STREAMS and THREADS must be at least 1, COPIES at least THREADS".into(),
        );
    }
    // `clwb` faults where the CPU lacks it (std cannot detect it; Linux lists it);
    // `cldemote` is a no-op there.
    let has_clwb = std::fs::read_to_string("/proc/cpuinfo")
        .is_ok_and(|c| c.split_whitespace().any(|w| w == "clwb"));
    if write == Write::Clwb && !(cfg!(target_arch = "x86_64") && has_clwb) {
        return Err("this CPU has no clwb".into());
    }
    let (len, ring) = (kib << 10, 32);
    let per_thread = copies / threads;
    let gpu = gpufeed_cuda::Gpu::open(0)?;
    let ctx = gpu.context().clone();
    let streams = Arc::new(
        (0..nstreams)
            .map(|_| ctx.new_stream())
            .collect::<Result<Vec<_>, _>>()?,
    );
    let pool = PinnedPool::new(PoolMode::Cuda(ctx.clone()), PoolOptions::default())?;
    // Each thread's sources and destinations, made before the clock and kept for every round.
    let mut held = (0..threads)
        .map(|_| -> Result<_, BoxError> {
            let srcs = (0..ring)
                .map(|_| -> Result<Source, BoxError> {
                    Ok(if src_kind.starts_with("alloc") {
                        Source::Alloc(PinnedBuffer::new(&ctx, len)?)
                    } else {
                        Source::Pooled(pool.get(len)?)
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let dsts = (0..ring)
                // SAFETY: each destination is written by a copy before it is read (it never
                // is).
                .map(|_| unsafe { streams[0].alloc::<u8>(len) })
                .collect::<Result<Vec<_>, _>>()?;
            // What the sources are written from (64 MiB, faulted in here), where they are.
            let from = vec![
                7u8;
                if write == Write::None {
                    0
                } else {
                    (64 << 20).max(2 * len)
                }
            ];
            Ok((srcs, dsts, from))
        })
        .collect::<Result<Vec<_>, _>>()?;
    streams[0].synchronize()?;
    for round in 0..3 {
        let t = Instant::now();
        std::thread::scope(|s| -> Result<(), BoxError> {
            let handles: Vec<_> = held
                .iter_mut()
                .enumerate()
                .map(|(th, (srcs, dsts, from))| {
                    let (ctx, streams) = (ctx.clone(), streams.clone());
                    s.spawn(move || -> Result<(), BoxError> {
                        ctx.bind_to_thread()?;
                        let mut events: Vec<Option<CudaEvent>> = (0..ring).map(|_| None).collect();
                        let mut at = 0;
                        for i in 0..per_thread {
                            let k = i % ring;
                            if let Some(ev) = events[k].take() {
                                ev.synchronize()?;
                            }
                            let stream = &streams[(i * threads + th) % streams.len()];
                            let src: &mut [u8] = match &mut srcs[k] {
                                Source::Alloc(b) => b,
                                Source::Pooled(b) => b,
                            };
                            if write != Write::None {
                                at = (at + len) % (from.len() - len);
                                write_source(write, src, &from[at..at + len]);
                            }
                            let (dptr, guard) = dsts[k].device_ptr_mut(stream);
                            // SAFETY: `src` is page-locked and holds `len` bytes, not written
                            // again before this copy's event completed; `dptr` holds `len`.
                            unsafe {
                                sys::cuMemcpyHtoDAsync_v2(
                                    dptr,
                                    src.as_ptr().cast(),
                                    len,
                                    stream.cu_stream(),
                                )
                                .result()?;
                            }
                            drop(guard);
                            events[k] = Some(stream.record_event(None)?);
                        }
                        for ev in events.into_iter().flatten() {
                            ev.synchronize()?;
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in handles {
                h.join().map_err(|_| "a copying thread panicked")??;
            }
            Ok(())
        })?;
        let secs = t.elapsed().as_secs_f64();
        if round > 0 {
            let n = per_thread * threads;
            println!(
                "{kib} KiB x {n} from {src_kind}, {threads} threads, {nstreams} streams: {:.1} GB/s, {:.1} us per copy",
                (len * n) as f64 / secs / 1e9,
                secs * 1e6 / n as f64
            );
        }
    }
    Ok(())
}

/// Writes `from` into `dst` as `write` says (plain copies only, off x86_64).
#[cfg(not(target_arch = "x86_64"))]
fn write_source(write: Write, dst: &mut [u8], from: &[u8]) {
    if write != Write::None {
        dst.copy_from_slice(from);
    }
}

/// Writes `from` into `dst` as `write` says.
#[cfg(target_arch = "x86_64")]
fn write_source(write: Write, dst: &mut [u8], from: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    match write {
        Write::None => return,
        Write::NonTemporal => {
            for (d, s) in dst.chunks_exact_mut(16).zip(from.chunks_exact(16)) {
                // SAFETY: 16 bytes each; pooled and cuMemHostAlloc buffers are page-aligned,
                // so every `d` is 16-byte aligned.
                unsafe {
                    _mm_stream_si128(
                        d.as_mut_ptr().cast::<__m128i>(),
                        _mm_loadu_si128(s.as_ptr().cast::<__m128i>()),
                    );
                }
            }
        }
        Write::Plain | Write::Demote | Write::Clwb => dst.copy_from_slice(from),
    }
    for line in dst.chunks(64) {
        match write {
            // SAFETY: cache-line hints on mapped memory of `dst`; they change no value.
            Write::Demote => unsafe {
                std::arch::asm!("cldemote [{0}]", in(reg) line.as_ptr(), options(nostack, preserves_flags));
            },
            // SAFETY: as above.
            Write::Clwb => unsafe {
                std::arch::asm!("clwb [{0}]", in(reg) line.as_ptr(), options(nostack, preserves_flags));
            },
            _ => break,
        }
    }
    // SAFETY: a fence has no operands; SSE is part of x86_64's baseline.
    unsafe { _mm_sfence() };
}
