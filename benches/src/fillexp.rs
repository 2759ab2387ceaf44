//! Experiments on the warm page-cache -> GPU path (GPUFEED_BENCH_FILL_EXPERIMENT=1), printed
//! to stderr as `FILLX` lines: how fast cores copy cached pages into pinned memory with and
//! without the GPU reading host memory at the same time, staged pipelines built in different
//! ways, whether a registration blocks copy submission, and hybrids of both.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use gpufeed::Gpu;
use gpufeed_cuda::cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtrMut, sys};
use gpufeed_cuda::{FillSource, HostSource, SourceError, TransferConfig, TransferScheduler};
use gpufeed_os::{FileMap, MapMode, cache};
use gpufeed_pinned::{HostRegistration, PinnedBuffer};
use gpufeed_uring::{Direct, FileId, Reader};

use crate::util::{Samples, gbps, timed};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Method {
    Pread,
    Mmap,
    Uring,
}

/// One thread's way of copying cached file bytes into memory.
struct Filler<'a> {
    file: &'a File,
    map: Option<&'a FileMap>,
    reader: Option<(Reader, FileId)>,
}

impl<'a> Filler<'a> {
    fn new(method: Method, file: &'a File, path: &Path, map: Option<&'a FileMap>) -> Result<Self> {
        let reader = if method == Method::Uring {
            let mut r = Reader::builder()
                .direct(Direct::Off)
                .queue_depth(8)
                .block_bytes(1 << 20)
                .async_buffered(false)
                .build()?;
            let f = r.open(path)?;
            Some((r, f))
        } else {
            None
        };
        Ok(Filler { file, map, reader })
    }

    fn fill(&mut self, off: u64, dst: &mut [u8]) -> Result<()> {
        if let Some((r, f)) = &mut self.reader {
            r.read_exact_at(*f, off, dst)?;
        } else if let Some(m) = self.map {
            let o = off as usize;
            dst.copy_from_slice(&m.as_slice()[o..o + dst.len()]);
        } else {
            self.file.read_exact_at(dst, off)?;
        }
        Ok(())
    }
}

/// A fill thread's own stream, buffers and events.
struct Lane {
    stream: Arc<CudaStream>,
    bufs: Vec<PinnedBuffer>,
    events: Vec<CudaEvent>,
}

fn lanes(
    ctx: &Arc<CudaContext>,
    n: usize,
    per: usize,
    chunk: usize,
    blocking: bool,
) -> Result<Vec<Lane>> {
    let flags = if blocking {
        sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
    } else {
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
    };
    (0..n)
        .map(|_| {
            Ok(Lane {
                stream: ctx.new_stream()?,
                bufs: (0..per)
                    .map(|_| PinnedBuffer::new(ctx, chunk))
                    .collect::<Result<_, _>>()?,
                events: (0..per)
                    .map(|_| {
                        // SAFETY: the value is one of the flag combinations the driver accepts.
                        ctx.new_event(Some(unsafe {
                            std::mem::transmute::<u32, sys::CUevent_flags>(flags)
                        }))
                    })
                    .collect::<Result<_, _>>()?,
            })
        })
        .collect()
}

/// Copies `[range)` of the file to `dptr + off` (or, with `dptr` None, into the lanes' buffers
/// only): each thread fills its own buffers in turn and issues its own copies on its stream.
#[allow(clippy::too_many_arguments)]
fn run_lanes(
    ctx: &Arc<CudaContext>,
    lanes: &mut [Lane],
    dptr: Option<u64>,
    range: std::ops::Range<u64>,
    chunk: usize,
    method: Method,
    file: &File,
    path: &Path,
    map: Option<&FileMap>,
) -> Result<()> {
    let n = (range.end - range.start).div_ceil(chunk as u64) as usize;
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = lanes
            .iter_mut()
            .map(|lane| {
                let (next, range) = (&next, range.clone());
                s.spawn(move || -> Result<()> {
                    ctx.bind_to_thread()?;
                    let mut filler = Filler::new(method, file, path, map)?;
                    let per = lane.bufs.len();
                    let mut used = vec![false; per];
                    let mut k = 0;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        let off = range.start + (i * chunk) as u64;
                        let size = chunk.min((range.end - off) as usize);
                        let b = k % per;
                        if used[b] {
                            lane.events[b].synchronize()?;
                        }
                        filler.fill(off, &mut lane.bufs[b][..size])?;
                        if let Some(d) = dptr {
                            // SAFETY: the buffer is pinned and not refilled before its event
                            // completes; the device range lies inside the allocation.
                            unsafe {
                                sys::cuMemcpyHtoDAsync_v2(
                                    d + off,
                                    lane.bufs[b].as_ptr().cast(),
                                    size,
                                    lane.stream.cu_stream(),
                                )
                            }
                            .result()?;
                            lane.events[b].record(&lane.stream)?;
                            used[b] = true;
                        }
                        k += 1;
                    }
                    lane.stream.synchronize()?;
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow!("lane panicked"))??;
        }
        Ok(())
    })
}

/// Runs `f` while a thread keeps the link busy copying a pinned buffer to the GPU; returns
/// f's result and the background copy's GB/s.
fn with_background_dma<T>(ctx: &Arc<CudaContext>, f: impl FnOnce() -> T) -> Result<(T, f64)> {
    let stop = AtomicBool::new(false);
    let mut pinned = PinnedBuffer::new(ctx, 256 << 20)?;
    pinned.fill(7);
    let stream = ctx.new_stream()?;
    let mut dev = stream.alloc_zeros::<u8>(256 << 20)?;
    std::thread::scope(|s| {
        let h = s.spawn(|| -> Result<f64> {
            ctx.bind_to_thread()?;
            let (dptr, _g) = dev.device_ptr_mut(&stream);
            let t = Instant::now();
            let mut bytes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for off in (0..256usize << 20).step_by(16 << 20) {
                    // SAFETY: both buffers hold 256 MiB and outlive the synchronize below.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            dptr + off as u64,
                            pinned.as_ptr().add(off).cast(),
                            16 << 20,
                            stream.cu_stream(),
                        )
                    }
                    .result()?;
                }
                stream.synchronize()?;
                bytes += 256 << 20;
            }
            Ok(gbps(bytes, t.elapsed().as_secs_f64()))
        });
        std::thread::sleep(Duration::from_millis(50));
        let out = f();
        stop.store(true, Ordering::Relaxed);
        let bg = h.join().map_err(|_| anyhow!("dma thread panicked"))??;
        Ok((out, bg))
    })
}

struct PreadSource<'a>(&'a File);
impl FillSource for PreadSource<'_> {
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        self.0.read_exact_at(dst, offset).map_err(Into::into)
    }
}

struct MmapSource<'a>(&'a FileMap);
impl FillSource for MmapSource<'_> {
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        let o = offset as usize;
        dst.copy_from_slice(&self.0.as_slice()[o..o + dst.len()]);
        Ok(())
    }
}

/// The file mapped read-only for `Method::Mmap`.
fn map_for(m: Method, path: &Path) -> Result<Option<FileMap>> {
    if m != Method::Mmap {
        return Ok(None);
    }
    // SAFETY: the bench's file never changes while mapped.
    Ok(Some(unsafe { FileMap::open(path, MapMode::ReadOnly) }?))
}

/// Stages `range` of the file to `dptr` through the lanes with pread and 4 MiB chunks (the
/// staged half of the hybrids).
fn stage_pread(
    ctx: &Arc<CudaContext>,
    lanes: &mut [Lane],
    dptr: u64,
    range: std::ops::Range<u64>,
    file: &File,
    path: &Path,
) -> Result<()> {
    run_lanes(
        ctx,
        lanes,
        Some(dptr),
        range,
        4 << 20,
        Method::Pread,
        file,
        path,
        None,
    )
}

/// GB/s of one `run_lanes` over the whole file (the mapping of `Method::Mmap` included).
#[allow(clippy::too_many_arguments)]
fn time_lanes(
    ctx: &Arc<CudaContext>,
    lanes: &mut [Lane],
    dptr: Option<u64>,
    len: u64,
    chunk: usize,
    method: Method,
    file: &File,
    path: &Path,
) -> Result<f64> {
    let (s, r) = timed(|| -> Result<()> {
        let map = map_for(method, path)?;
        run_lanes(
            ctx,
            lanes,
            dptr,
            0..len,
            chunk,
            method,
            file,
            path,
            map.as_ref(),
        )
    });
    r?;
    Ok(gbps(len, s))
}

fn shell(cmd: &str) {
    if let Ok(o) = std::process::Command::new("sh").arg("-c").arg(cmd).output() {
        eprintln!(
            "FILLX $ {cmd}\n{}",
            String::from_utf8_lossy(&o.stdout).trim_end()
        );
    }
}

fn median3(mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    f()?; // warm-up
    let v = (0..3).map(|_| f()).collect::<Result<Vec<_>>>()?;
    Ok(Samples::new(v).median)
}

pub fn fill_experiment(gpu: &Gpu, path: &Path) -> Result<()> {
    for cmd in [
        "lscpu | head -30",
        "uname -r",
        "cat /sys/kernel/mm/transparent_hugepage/enabled",
        &format!("stat -f -c %T {}", path.display()),
        "grep -E 'MemTotal|MemAvailable|Cached' /proc/meminfo",
    ] {
        shell(cmd);
    }
    cache::warm(path)?;
    let ctx = Arc::clone(gpu.context());
    let len = path.metadata()?.len();
    let file = File::open(path)?;
    let stream = ctx.new_stream()?;
    let mut dev = gpu.alloc_zeroed(len as usize)?;
    let (dptr, guard) = dev.device_ptr_mut(&stream);
    let methods = [Method::Pread, Method::Mmap, Method::Uring];

    // 1. Cores only: cached pages into pinned buffers, with and without the link busy.
    for threads in [8usize, 16] {
        for chunk in [1usize << 20, 4 << 20] {
            let mut l = lanes(&ctx, threads, 2, chunk, false)?;
            for m in methods {
                let mut one = || time_lanes(&ctx, &mut l, None, len, chunk, m, &file, path);
                let alone = median3(&mut one)?;
                let (busy, bg) = with_background_dma(&ctx, || median3(&mut one))?;
                eprintln!(
                    "FILLX cpu-only {m:?} threads {threads} chunk {} MiB: {alone:.1} GB/s alone, {:.1} GB/s while the link copies at {bg:.1}",
                    chunk >> 20,
                    busy?
                );
            }
        }
    }

    // 2. Staged pipelines: own lanes (each thread issues its copies) by method and settings.
    for threads in [8usize, 12, 16] {
        for chunk in [1usize << 20, 2 << 20, 4 << 20] {
            for per in [2usize, 3] {
                let mut l = lanes(&ctx, threads, per, chunk, false)?;
                for m in methods {
                    let r = median3(|| {
                        time_lanes(&ctx, &mut l, Some(dptr), len, chunk, m, &file, path)
                    })?;
                    eprintln!(
                        "FILLX lanes {m:?} threads {threads} chunk {} MiB x{per}: {r:.1} GB/s",
                        chunk >> 20
                    );
                }
            }
        }
    }
    // Blocking-sync events for the lanes.
    for threads in [12usize, 16] {
        let mut l = lanes(&ctx, threads, 2, 4 << 20, true)?;
        let r = median3(|| {
            time_lanes(
                &ctx,
                &mut l,
                Some(dptr),
                len,
                4 << 20,
                Method::Pread,
                &file,
                path,
            )
        })?;
        eprintln!(
            "FILLX lanes Pread threads {threads} chunk 4 MiB x2 blocking-sync events: {r:.1} GB/s"
        );
    }
    drop(guard);

    // 3. The scheduler with plain pread and mmap sources (io_uring is the facade's Staged row).
    for threads in [12usize, 16] {
        for chunk in [2usize << 20, 4 << 20] {
            let sched = TransferScheduler::new(
                gpu,
                TransferConfig {
                    streams: 4,
                    chunk_bytes: chunk,
                    staging_buffers: 2 * threads,
                    fill_threads: threads,
                },
            )?;
            let p = median3(|| {
                let src = PreadSource(&file);
                Ok(sched
                    .upload(HostSource::Fill { source: &src, len }, &mut dev, 0)?
                    .gbps())
            })?;
            let mm = median3(|| {
                let (s, r) = timed(|| -> Result<()> {
                    // SAFETY: as above.
                    let map = unsafe { FileMap::open(path, MapMode::ReadOnly) }?;
                    let src = MmapSource(&map);
                    sched.upload(HostSource::Fill { source: &src, len }, &mut dev, 0)?;
                    Ok(())
                });
                r?;
                Ok(gbps(len, s))
            })?;
            let def = {
                let mut opts = gpufeed::LoadOptions {
                    strategy: gpufeed::Strategy::Staged,
                    ..gpufeed::LoadOptions::default()
                };
                opts.transfer = sched.config();
                let loader = gpufeed::Loader::new(gpu, opts)?;
                median3(|| Ok(loader.load_file(path)?.1.gbps()))?
            };
            eprintln!(
                "FILLX scheduler threads {threads} chunk {} MiB: pread {p:.1}, mmap {mm:.1}, facade io_uring {def:.1} GB/s",
                chunk >> 20
            );
        }
    }

    // 4. Does a registration block copy submission from another thread?
    {
        // SAFETY: as above.
        let map = unsafe { FileMap::open(path, MapMode::ReadOnly) }?;
        let mut pinned = PinnedBuffer::new(&ctx, 1 << 20)?;
        pinned.fill(1);
        let mut small = stream.alloc_zeros::<u8>(64 << 20)?;
        for with_reg in [false, true] {
            let stop = AtomicBool::new(false);
            let regs = AtomicUsize::new(0);
            let lat = std::thread::scope(|s| -> Result<Vec<f64>> {
                if with_reg {
                    s.spawn(|| {
                        let base = map.as_ptr() as usize;
                        let mut off = 0usize;
                        while !stop.load(Ordering::Relaxed) {
                            // SAFETY: inside the mapping, which outlives the registration.
                            let r = unsafe {
                                HostRegistration::register(
                                    &ctx,
                                    (base + off) as *const u8,
                                    64 << 20,
                                    true,
                                )
                            };
                            drop(r);
                            regs.fetch_add(1, Ordering::Relaxed);
                            off = (off + (64 << 20)) % (len as usize - (64 << 20));
                        }
                    });
                    std::thread::sleep(Duration::from_millis(20));
                }
                let (d, _g) = small.device_ptr_mut(&stream);
                let mut lat = Vec::new();
                for j in 0..2000u64 {
                    let t = Instant::now();
                    // SAFETY: 1 MiB pinned into a 64 MiB device buffer.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            d + (j % 64) * (1 << 20),
                            pinned.as_ptr().cast(),
                            1 << 20,
                            stream.cu_stream(),
                        )
                    }
                    .result()?;
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                    if j % 32 == 31 {
                        stream.synchronize()?;
                    }
                }
                stop.store(true, Ordering::Relaxed);
                Ok(lat)
            })?;
            let mut sorted = lat.clone();
            sorted.sort_by(f64::total_cmp);
            eprintln!(
                "FILLX submit latency (registering on another thread: {with_reg}, {} registrations): p50 {:.1} us, p99 {:.1} us, max {:.1} us, total {:.1} ms",
                regs.load(Ordering::Relaxed),
                sorted[sorted.len() / 2],
                sorted[sorted.len() * 99 / 100],
                sorted[sorted.len() - 1],
                lat.iter().sum::<f64>() / 1e3
            );
        }
    }

    // 5. Hybrids built from lanes: one thread registers the head in 64 MiB pieces and copies
    // each as soon as it is registered, the lanes stage the tail.
    let (dptr, guard) = dev.device_ptr_mut(&stream);
    for threads in [12usize, 16] {
        let mut l = lanes(&ctx, threads, 2, 4 << 20, false)?;
        for share in [0.15f64, 0.3, 0.45] {
            let head = ((len as f64 * share) as u64) / (64 << 20) * (64 << 20);
            let (mut v, mut with_unreg) = (Vec::new(), Vec::new());
            for rep in 0..4 {
                let mut regs = Vec::new();
                let started = Instant::now();
                let mut copied_s = 0.0;
                let (s, r) = timed(|| -> Result<()> {
                    // SAFETY: as above.
                    let map = unsafe { FileMap::open(path, MapMode::ReadOnly) }?;
                    let base = map.as_ptr() as usize;
                    std::thread::scope(|s| -> Result<()> {
                        let h = s.spawn(|| -> Result<Vec<HostRegistration<'static>>> {
                            ctx.bind_to_thread()?;
                            let rs = ctx.new_stream()?;
                            let mut out = Vec::new();
                            for off in (0..head).step_by(64 << 20) {
                                // SAFETY: inside the mapping; dropped (below) before it.
                                let reg = unsafe {
                                    HostRegistration::register(
                                        &ctx,
                                        (base + off as usize) as *const u8,
                                        64 << 20,
                                        true,
                                    )
                                }?;
                                // SAFETY: registered range into the device buffer.
                                unsafe {
                                    sys::cuMemcpyHtoDAsync_v2(
                                        dptr + off,
                                        (base + off as usize) as *const std::ffi::c_void,
                                        64 << 20,
                                        rs.cu_stream(),
                                    )
                                }
                                .result()?;
                                out.push(reg);
                            }
                            rs.synchronize()?;
                            Ok(out)
                        });
                        stage_pread(&ctx, &mut l, dptr, head..len, &file, path)?;
                        regs = h
                            .join()
                            .map_err(|_| anyhow!("register thread panicked"))??;
                        Ok(())
                    })?;
                    copied_s = started.elapsed().as_secs_f64();
                    drop(std::mem::take(&mut regs));
                    drop(map);
                    Ok(())
                });
                r?;
                if rep > 0 {
                    v.push(gbps(len, copied_s));
                    with_unreg.push(gbps(len, s));
                }
            }
            eprintln!(
                "FILLX hybrid lanes threads {threads} share {share}: {:.1} GB/s, {:.1} counting the unregistration",
                Samples::new(v).median,
                Samples::new(with_unreg).median
            );
        }
    }
    drop(guard);
    Ok(())
}

/// A CUDA context of its own (not the primary one) for registering host memory on a thread.
struct OwnContext(sys::CUcontext);

impl OwnContext {
    /// Creates a context on `dev` and makes it current on the calling thread.
    fn create(dev: sys::CUdevice) -> Result<Self> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the context is destroyed on drop.
        unsafe { sys::cuCtxCreate_v2(&mut ctx, 0, dev) }.result()?;
        Ok(OwnContext(ctx))
    }
}

impl Drop for OwnContext {
    fn drop(&mut self) {
        // SAFETY: created by cuCtxCreate and not used after this.
        let _ = unsafe { sys::cuCtxDestroy_v2(self.0) };
    }
}

/// Registers `[p, p + n)` portable and read-only in the current context.
///
/// # Safety
/// The range must be mapped for as long as it stays registered.
unsafe fn register_raw(p: usize, n: usize) -> Result<()> {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_READ_ONLY;
    // SAFETY: the caller's promise.
    unsafe { sys::cuMemHostRegister_v2(p as *mut _, n, flags) }.result()?;
    Ok(())
}

/// Registering in a second context of the same device (GPUFEED_BENCH_CTX_EXPERIMENT=1): its
/// cost, copies from it in the primary context, and hybrids that register the head there while
/// lanes stage the tail.
pub fn ctx_experiment(gpu: &Gpu, path: &Path) -> Result<()> {
    cache::warm(path)?;
    let ctx = Arc::clone(gpu.context());
    let len = path.metadata()?.len();
    let file = File::open(path)?;
    let stream = ctx.new_stream()?;
    // SAFETY: the bench's file never changes while mapped.
    let map = unsafe { FileMap::open(path, MapMode::ReadOnly) }?;
    let base = map.as_ptr() as usize;
    let piece = 64usize << 20;

    // Registration in the second context alone, then copies from it in the primary one.
    let (reg_s, r) = timed(|| -> Result<()> {
        std::thread::scope(|s| {
            s.spawn(|| -> Result<()> {
                let own = OwnContext::create(ctx.cu_device())?;
                for off in (0..len as usize).step_by(piece) {
                    // SAFETY: inside the mapping; unregistered below before it is dropped.
                    unsafe { register_raw(base + off, piece.min(len as usize - off)) }?;
                }
                std::mem::forget(own); // keep the registrations (and their context) alive
                Ok(())
            })
            .join()
            .map_err(|_| anyhow!("panicked"))?
        })
    });
    r?;
    let mut dev = gpu.alloc_zeroed(len as usize)?;
    let (dptr, guard) = dev.device_ptr_mut(&stream);
    let (copy_s, r) = timed(|| -> Result<()> {
        ctx.bind_to_thread()?;
        for off in (0..len as usize).step_by(16 << 20) {
            // SAFETY: registered (portable) above; dev holds len bytes.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dptr + off as u64,
                    (base + off) as *const std::ffi::c_void,
                    (16usize << 20).min(len as usize - off),
                    stream.cu_stream(),
                )
            }
            .result()?;
        }
        stream.synchronize()?;
        Ok(())
    });
    r?;
    eprintln!(
        "FILLX second context: register 4 GiB {:.1} ms; copies from it in the primary context {:.1} GB/s",
        reg_s * 1e3,
        gbps(len, copy_s)
    );
    for off in (0..len as usize).step_by(piece) {
        // SAFETY: registered above; portable registrations may be undone from any context.
        let _ = unsafe { sys::cuMemHostUnregister((base + off) as *mut _) };
    }

    // Hybrid: a thread with its own context registers the head in 64 MiB pieces and hands
    // each to a primary-context thread that copies it; lanes stage the tail.
    let own = OwnContext::create(ctx.cu_device())?;
    let own_raw = own.0 as usize;
    ctx.bind_to_thread()?;
    for threads in [12usize, 16] {
        let mut l = lanes(&ctx, threads, 2, 4 << 20, false)?;
        for share in [0.0f64, 0.2, 0.35, 0.5] {
            let head = ((len as f64 * share) as u64) / (piece as u64) * piece as u64;
            let mut v = Vec::new();
            for rep in 0..4 {
                let started = Instant::now();
                let registered = std::thread::scope(|s| -> Result<Vec<usize>> {
                    let (tx, rx) = std::sync::mpsc::channel::<usize>();
                    let reg = s.spawn(move || -> Result<()> {
                        // SAFETY: the context lives until the end of the experiment.
                        unsafe { sys::cuCtxSetCurrent(own_raw as sys::CUcontext) }.result()?;
                        for off in (0..head as usize).step_by(piece) {
                            // SAFETY: inside the mapping; unregistered after the load.
                            unsafe { register_raw(base + off, piece) }?;
                            if tx.send(off).is_err() {
                                break;
                            }
                        }
                        Ok(())
                    });
                    let ctx = &ctx;
                    let copier = s.spawn(move || -> Result<Vec<usize>> {
                        ctx.bind_to_thread()?;
                        let cs = ctx.new_stream()?;
                        let mut done = Vec::new();
                        for off in rx {
                            // SAFETY: registered by the other thread; inside dev.
                            unsafe {
                                sys::cuMemcpyHtoDAsync_v2(
                                    dptr + off as u64,
                                    (base + off) as *const std::ffi::c_void,
                                    piece,
                                    cs.cu_stream(),
                                )
                            }
                            .result()?;
                            done.push(off);
                        }
                        cs.synchronize()?;
                        Ok(done)
                    });
                    stage_pread(ctx, &mut l, dptr, head..len, &file, path)?;
                    let done = copier.join().map_err(|_| anyhow!("copier panicked"))??;
                    reg.join().map_err(|_| anyhow!("register panicked"))??;
                    Ok(done)
                })?;
                let secs = started.elapsed().as_secs_f64();
                if rep == 3 {
                    eprintln!(
                        "FILLX   ({} pieces registered and copied, load {:.1} ms)",
                        registered.len(),
                        secs * 1e3
                    );
                }
                for off in registered {
                    // SAFETY: registered above, copies synchronized.
                    let _ = unsafe { sys::cuMemHostUnregister((base + off) as *mut _) };
                }
                std::thread::sleep(Duration::from_millis(100));
                if rep > 0 {
                    v.push(gbps(len, secs));
                }
            }
            eprintln!(
                "FILLX hybrid (registering in a second context) threads {threads} share {share}: {:.1} GB/s",
                Samples::new(v).median
            );
        }
    }
    drop(guard);
    drop(own);
    Ok(())
}
