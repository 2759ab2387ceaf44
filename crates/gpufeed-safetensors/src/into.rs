//! [`LoadInto`]: a checkpoint's tensors written into device memory the caller owns (an
//! inference engine's preallocated parameters), through a bounded staging on the device.
//!
//! Every header is read and checked first ([`LoadInto::open`]: a file, or an index's shards,
//! shards of several saves refused); the caller looks at the tensors, picks the names to
//! write, and [`LoadInto::run`] reads each file's wanted bytes in chunks of at most
//! [`LoadIntoOptions::staging_bytes`] into one of two device staging buffers (the loader's
//! route chosen once per file, each chunk read through the descriptor its header came from and
//! that file's identity checked after its copies), hands each piece of a tensor in the
//! staging to the caller's `deliver`, which queues its device-to-device copy on the stream it
//! is given, and reuses a staging buffer only once the copies out of it are done: the reads
//! of one chunk overlap the copies out of the chunk before. Device memory beyond the caller's
//! is the two staging buffers and what the driver takes with them (10 MiB beside two of 512
//! MiB on the H200: docs/benchmarks.md, GPU run 146). [`load_into`] is the whole of it for
//! destinations that are cudarc slices.
//!
//! A `deliver` may cast instead of copying: a piece of a part asked for from an element
//! boundary (every range [`LoadInto::rows`] and [`LoadInto::narrow`] give, whole tensors) is
//! whole elements (pieces of a part larger than the staging split at multiples of 4 KiB of its
//! bytes), at any staging address, which [`gpufeed_cuda::cast::CastKernel::launch_raw`] takes
//! ([`Share::cast_piece`] for a narrowed part; gpufeed's Python `load_into` casts BF16, F16,
//! F32 and FP8 this way). A narrowed part's report counts every byte read for it, the other
//! ranks' columns between its runs included.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use gpufeed_cuda::DeviceAlloc;
use gpufeed_cuda::cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr};
use gpufeed_load::{DeviceBuffer, LoadReport, Loader};

use crate::error::{Error, Result};
use crate::header::{HeaderEntry, Parsed};
use crate::index::plan;
use crate::source::merge_adjacent;

/// How [`LoadInto::run`] stages.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadIntoOptions {
    /// Bytes of each of the two device staging buffers: the most one read moves (a tensor
    /// larger than this arrives in pieces). Default 512 MiB, so 1 GiB of device memory beyond
    /// the destinations, and what the driver takes with it.
    pub staging_bytes: usize,
}

impl Default for LoadIntoOptions {
    fn default() -> Self {
        LoadIntoOptions {
            staging_bytes: 512 << 20,
        }
    }
}

impl LoadIntoOptions {
    /// These options with staging buffers of `bytes` each (at least 1 MiB, rounded down to
    /// whole 4 KiB).
    pub fn with_staging_bytes(mut self, bytes: usize) -> Self {
        self.staging_bytes = bytes.max(1 << 20) & !4095;
        self
    }
}

/// One piece of a tensor in the staging, handed to [`LoadInto::run`]'s `deliver`: copy
/// `bytes` to the tensor's destination at `offset`, queued on `stream` (the staging buffer is
/// written again only after the work queued there up to the return of `deliver` for its
/// chunk).
#[derive(Debug)]
pub struct Delivery<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Where the piece starts in the destination: the tensor's bytes, or those of the part of
    /// it asked for ([`LoadInto::run_ranges`]).
    pub offset: usize,
    /// The piece, in a staging buffer.
    pub bytes: CudaView<'a, u8>,
    /// The piece's device address (the same bytes as `bytes`: for a caller that queues copies
    /// by address).
    pub address: u64,
    /// The stream to queue the copy on.
    pub stream: &'a Arc<CudaStream>,
}

/// What [`LoadInto::run`] did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LoadIntoReport {
    /// Tensors written.
    pub tensors: usize,
    /// Bytes written.
    pub bytes: u64,
    /// From the call to its end (every copy done).
    pub seconds: f64,
    /// Device memory used for staging.
    pub staging_bytes: u64,
    /// Each chunk's read.
    pub reads: Vec<LoadReport>,
}

impl LoadIntoReport {
    /// Bytes per second over the whole call.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e9
    }
}

/// A checkpoint opened for writing its tensors into the caller's device memory (see the
/// module).
///
/// # Example
/// ```no_run
/// use gpufeed_safetensors::{LoadInto, LoadIntoOptions};
/// let loader = gpufeed_load::Loader::open(0, Default::default())?;
/// let ckpt = LoadInto::open("model.safetensors.index.json")?;
/// // The caller's own memory (here: one allocation per tensor, as an engine preallocates).
/// let stream = loader.gpu().default_stream();
/// let mut weights = std::collections::HashMap::new();
/// for t in ckpt.tensors() {
///     weights.insert(t.name.clone(), stream.alloc_zeros::<u8>(t.range.end - t.range.start)?);
/// }
/// let names: Vec<&str> = ckpt.tensors().map(|t| t.name.as_str()).collect();
/// let report = ckpt.run(&loader, &names, &LoadIntoOptions::default(), |piece| {
///     // Queue the piece's copy on the stream given (here by cudarc's safe call).
///     let dst = weights.get_mut(piece.name).expect("asked for");
///     let end = piece.offset + piece.bytes.len();
///     piece
///         .stream
///         .memcpy_dtod(&piece.bytes, &mut dst.slice_mut(piece.offset..end))
///         .map_err(|e| gpufeed_safetensors::Error::invalid(e.to_string()))
/// })?;
/// println!("{} bytes at {:.1} GB/s", report.bytes, report.gbps());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct LoadInto {
    path: PathBuf,
    files: Vec<(PathBuf, Parsed)>,
    /// Tensor name -> (file, index in its `tensors`).
    by_name: HashMap<String, (usize, usize)>,
}

impl std::fmt::Debug for LoadInto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadInto")
            .field("path", &self.path)
            .field("files", &self.files.len())
            .field("tensors", &self.by_name.len())
            .finish()
    }
}

/// One read's share of a tensor: its bytes in the file and where they go.
struct Piece {
    /// Index into the file's `tensors`.
    tensor: usize,
    /// Bytes of the file (absolute).
    span: std::ops::Range<u64>,
    /// Where they start in the destination (the tensor, or the part of it asked for).
    offset: usize,
}

impl LoadInto {
    /// Reads and checks the headers of `path` (a safetensors file or a sharded checkpoint's
    /// `*.safetensors.index.json`), each file opened once; no data moves.
    ///
    /// # Errors
    /// [`load`](crate::load)'s header and index errors.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let files = plan(path)?.files;
        let mut by_name = HashMap::new();
        for (f, (_, parsed)) in files.iter().enumerate() {
            for (i, t) in parsed.tensors.iter().enumerate() {
                if by_name.insert(t.name.clone(), (f, i)).is_some() {
                    return Err(Error::Index {
                        path: path.into(),
                        reason: format!("tensor {} appears in two files", t.name),
                    });
                }
            }
        }
        Ok(LoadInto {
            path: path.to_path_buf(),
            files,
            by_name,
        })
    }

    /// Every tensor of the checkpoint, file by file.
    pub fn tensors(&self) -> impl Iterator<Item = &HeaderEntry> {
        self.files.iter().flat_map(|(_, p)| p.tensors.iter())
    }

    /// The tensor `name`, where the checkpoint has it.
    pub fn get(&self, name: &str) -> Option<&HeaderEntry> {
        let &(f, i) = self.by_name.get(name)?;
        Some(&self.files[f].1.tensors[i])
    }

    /// The bytes of rows `rows` (along the first dimension) of the tensor `name`, a range
    /// within its own bytes for [`LoadInto::run_ranges`]: a rank's share of a tensor split by
    /// rows.
    ///
    /// # Errors
    /// [`Error::NoTensor`]; an error naming the tensor for a 0-d tensor, rows past its first
    /// dimension, or a tensor whose bytes are not whole rows (packed types).
    pub fn rows(&self, name: &str, rows: std::ops::Range<usize>) -> Result<std::ops::Range<usize>> {
        let t = self.get(name).ok_or_else(|| self.no_tensor(name))?;
        let bad =
            |why: String| Error::invalid(format!("{}: tensor {name}: {why}", self.path.display()));
        let Some(&n) = t.shape.first() else {
            return Err(bad("a 0-d tensor has no rows to slice".into()));
        };
        if rows.start > rows.end || rows.end > n {
            return Err(bad(format!("rows {}..{} of {n}", rows.start, rows.end)));
        }
        let bytes = t.range.end - t.range.start;
        if n == 0 {
            return Ok(0..0);
        }
        if bytes % n != 0 {
            return Err(bad(format!("{bytes} bytes are not {n} whole rows")));
        }
        let row = bytes / n;
        Ok(rows.start * row..rows.end * row)
    }

    /// The part of the tensor `name` at `range` of its dimension `dim` (`torch.narrow`'s, a
    /// slice of its columns for `dim` 1 of a matrix): the bytes to read for it, a range within
    /// the tensor's own bytes for [`LoadInto::run_ranges`] (from its first run's start to its
    /// last one's end), and the [`Share`] that says which of them belong to it. Along the first
    /// dimension the share is one run (as [`LoadInto::rows`]); along another, one run per index
    /// of the dimensions before it, and the bytes read are those of the whole span, the other
    /// ranks' columns between the runs included.
    ///
    /// # Errors
    /// [`Error::NoTensor`]; an error naming the tensor for a dimension it does not have, a
    /// range past that dimension, or bytes that are not whole elements (packed types).
    pub fn narrow(
        &self,
        name: &str,
        dim: usize,
        range: std::ops::Range<usize>,
    ) -> Result<(std::ops::Range<usize>, Share)> {
        let t = self.get(name).ok_or_else(|| self.no_tensor(name))?;
        let bad =
            |why: String| Error::invalid(format!("{}: tensor {name}: {why}", self.path.display()));
        let Some(&n) = t.shape.get(dim) else {
            return Err(bad(format!(
                "no dimension {dim} in a tensor of {} dimensions",
                t.shape.len()
            )));
        };
        if range.start > range.end || range.end > n {
            return Err(bad(format!(
                "{}..{} of dimension {dim}, which has {n}",
                range.start, range.end
            )));
        }
        let bytes = t.range.end - t.range.start;
        let numel: usize = t.shape.iter().product();
        if numel == 0 || range.is_empty() {
            let share = Share {
                runs: 0,
                pitch: 0,
                width: 0,
            };
            return Ok((0..0, share));
        }
        if bytes % numel != 0 {
            return Err(bad(format!("{bytes} bytes are not {numel} whole elements")));
        }
        let inner: usize = t.shape[dim + 1..].iter().product::<usize>() * (bytes / numel);
        let runs: usize = t.shape[..dim].iter().product();
        let (pitch, width) = (n * inner, (range.end - range.start) * inner);
        let start = range.start * inner;
        let share = if width == pitch || runs == 1 {
            // One run: the whole rows of the part (or every column).
            Share {
                runs: 1,
                pitch: runs * width,
                width: runs * width,
            }
        } else {
            Share { runs, pitch, width }
        };
        Ok((start..start + (runs - 1) * pitch + width, share))
    }

    /// [`Error::NoTensor`] for `name`.
    fn no_tensor(&self, name: &str) -> Error {
        Error::NoTensor {
            path: self.path.clone(),
            name: name.to_owned(),
        }
    }

    /// Reads the tensors `names` and hands each to `deliver` piece by piece (see the module),
    /// file by file in the order of their bytes.
    ///
    /// # Errors
    /// [`Error::NoTensor`] for a name the checkpoint lacks (before a byte moves); the reads'
    /// errors (a file changed since [`LoadInto::open`] is `FileChangedDuringLoad`), CUDA
    /// errors, and `deliver`'s own. After a failure the copies queued before it have ended
    /// (so the destinations are no longer written when this returns), and the tensors
    /// delivered so far are written: a failed load leaves its destinations partly written.
    pub fn run(
        &self,
        loader: &Loader,
        names: &[&str],
        opts: &LoadIntoOptions,
        deliver: impl FnMut(Delivery<'_>) -> Result<()>,
    ) -> Result<LoadIntoReport> {
        let mut wanted = Vec::with_capacity(names.len());
        for &name in names {
            let t = self.get(name).ok_or_else(|| self.no_tensor(name))?;
            wanted.push((name, 0..t.range.end - t.range.start));
        }
        self.run_ranges(loader, &wanted, opts, deliver)
    }

    /// [`LoadInto::run`] of parts of tensors: for each `(name, bytes)`, the bytes `bytes` of
    /// the tensor (a range within its own bytes, as [`LoadInto::rows`] gives for a slice of
    /// its rows), delivered at offsets from the range's start: only those bytes are read. A
    /// part asked twice is delivered once; one name asked with two ranges is delivered twice
    /// (each from offset 0), which `deliver` cannot tell apart: ask each name once.
    ///
    /// # Errors
    /// [`LoadInto::run`]'s, and an error naming the tensor for a range past its end.
    pub fn run_ranges(
        &self,
        loader: &Loader,
        wanted: &[(&str, std::ops::Range<usize>)],
        opts: &LoadIntoOptions,
        deliver: impl FnMut(Delivery<'_>) -> Result<()>,
    ) -> Result<LoadIntoReport> {
        let started = Instant::now();
        let _context = gpufeed_cuda::ContextGuard::new();
        let gpu = loader.gpu();
        gpu.context()
            .bind_to_thread()
            .map_err(|e| cuda("cuCtxSetCurrent", e))?;
        let stream = gpu
            .context()
            .new_stream()
            .map_err(|e| cuda("cuStreamCreate", e))?;
        // The staging buffers live here, past the wait below.
        let mut buffers: [Option<(DeviceBuffer, u64)>; 2] = [None, None];
        let done = self.run_on(loader, wanted, opts, deliver, &stream, &mut buffers);
        // Every copy queued ends before this returns, failed or not: the staging buffers are
        // freed after it (their copies may go by raw address, which cudarc's event tracking
        // does not see), and a caller that gave up its destinations on an error must not have
        // them written afterwards.
        let synced = stream
            .synchronize()
            .map_err(|e| cuda("cuStreamSynchronize", e));
        let (tensors, bytes, reads) = done?;
        synced?;
        let staging_bytes = buffers.iter().flatten().map(|(b, _)| b.len() as u64).sum();
        drop(buffers);
        Ok(LoadIntoReport {
            tensors,
            bytes,
            seconds: started.elapsed().as_secs_f64(),
            staging_bytes,
            reads,
        })
    }

    /// [`LoadInto::run`]'s work, its copies queued on `stream` (not waited for): the tensors
    /// and bytes delivered, and each chunk's read.
    fn run_on(
        &self,
        loader: &Loader,
        asked: &[(&str, std::ops::Range<usize>)],
        opts: &LoadIntoOptions,
        mut deliver: impl FnMut(Delivery<'_>) -> Result<()>,
        stream: &Arc<CudaStream>,
        buffers: &mut [Option<(DeviceBuffer, u64)>; 2],
    ) -> Result<(usize, u64, Vec<LoadReport>)> {
        let mut wanted: Vec<Vec<(usize, std::ops::Range<usize>)>> =
            vec![Vec::new(); self.files.len()];
        for (name, bytes) in asked {
            let &(f, i) = self
                .by_name
                .get(*name)
                .ok_or_else(|| self.no_tensor(name))?;
            let t = &self.files[f].1.tensors[i];
            let len = t.range.end - t.range.start;
            if bytes.start > bytes.end || bytes.end > len {
                return Err(Error::invalid(format!(
                    "{}: bytes {}..{} of tensor {name}, which has {len}",
                    self.path.display(),
                    bytes.start,
                    bytes.end
                )));
            }
            wanted[f].push((i, bytes.clone()));
        }
        // Whole 4 KiB: a tensor split across chunks is split between elements, which a
        // `deliver` that casts relies on.
        let stage = opts.staging_bytes.max(1 << 20) & !4095;
        let gpu = loader.gpu();
        // Every file's pieces first: the staging buffers are as large as the largest chunk.
        let mut planned = Vec::new();
        let mut tensors = 0usize;
        for (f, mut want) in wanted.into_iter().enumerate() {
            let (_, parsed) = &self.files[f];
            // By offset, then index: an empty tensor shares its offset with the next one, and
            // a part asked twice must end up next to itself to be dropped.
            want.sort_unstable_by(|(i, a), (j, b)| {
                (parsed.tensors[*i].range.start + a.start, *i, a.end).cmp(&(
                    parsed.tensors[*j].range.start + b.start,
                    *j,
                    b.end,
                ))
            });
            want.dedup();
            tensors += want.len();
            let pieces = pieces_of(parsed, &want, stage);
            if !pieces.is_empty() {
                let chunks = chunks_of(&pieces, stage as u64);
                planned.push((parsed, pieces, chunks));
            }
        }
        let size = planned
            .iter()
            .flat_map(|(_, pieces, chunks)| chunks.iter().map(|c| chunk_len(&pieces[c.clone()])))
            .max()
            .unwrap_or(0);
        let mut done: [Option<gpufeed_cuda::cudarc::driver::CudaEvent>; 2] = [None, None];
        let (mut bytes, mut reads, mut k) = (0u64, Vec::new(), 0usize);
        for (parsed, pieces, chunks) in &planned {
            let hull =
                pieces.first().map_or(0, |p| p.span.start)..pieces.last().map_or(0, |p| p.span.end);
            let route = loader.choose_route(&parsed.file, hull);
            for chunk in chunks.iter().map(|c| &pieces[c.clone()]) {
                let len = chunk_len(chunk);
                let spans = merge_adjacent(chunk.iter().map(|p| p.span.clone()));
                let b = k % 2;
                k += 1;
                if let Some(event) = done[b].take() {
                    // The copies out of this buffer's last chunk are done before it is written.
                    event
                        .synchronize()
                        .map_err(|e| cuda("cuEventSynchronize", e))?;
                }
                let report = match &mut buffers[b] {
                    Some((buffer, _)) => loader.load_spans_to(
                        &parsed.file,
                        &spans,
                        &mut buffer.slice_mut(0..len),
                        Some(&route),
                    )?,
                    none => {
                        // The first chunk for each buffer allocates it, as large as the
                        // largest chunk, and reads into its start.
                        let (buffer, report) = gpu.alloc_filled(
                            size,
                            DeviceAlloc::Unpooled,
                            |buf: &mut CudaSlice<u8>| {
                                loader.load_spans_to(
                                    &parsed.file,
                                    &spans,
                                    &mut buf.slice_mut(0..len),
                                    Some(&route),
                                )
                            },
                        )?;
                        let address = {
                            let (ptr, _record) = buffer.device_ptr(stream);
                            ptr
                        };
                        *none = Some((buffer, address));
                        report
                    }
                };
                reads.push(report);
                let Some((buffer, address)) = &buffers[b] else {
                    return Err(Error::invalid("a staging buffer went missing".to_owned()));
                };
                let mut at = 0usize;
                for p in chunk {
                    let n = (p.span.end - p.span.start) as usize;
                    deliver(Delivery {
                        name: &parsed.tensors[p.tensor].name,
                        offset: p.offset,
                        bytes: buffer.slice(at..at + n),
                        address: address + at as u64,
                        stream,
                    })?;
                    at += n;
                    bytes += n as u64;
                }
                done[b] = Some(
                    stream
                        .record_event(None)
                        .map_err(|e| cuda("cuEventRecord", e))?,
                );
            }
        }
        // The copies out of the buffers end before they are freed: `run` waits for `stream`.
        Ok((tensors, bytes, reads))
    }
}

/// Which bytes of a range [`LoadInto::narrow`] gave belong to the part of the tensor asked for:
/// [`Share::runs`] runs of [`Share::width`] bytes, [`Share::pitch`] bytes apart, the first at
/// the range's start; the part itself is the runs back to back (a contiguous tensor of the
/// narrowed shape). Only [`LoadInto::narrow`] makes one (so a width is never more than its
/// pitch, and a pitch never 0 where there are several runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    runs: usize,
    pitch: usize,
    width: usize,
}

impl Share {
    /// Runs (one where the part is contiguous in the tensor; none for an empty part).
    pub fn runs(&self) -> usize {
        self.runs
    }

    /// Bytes from one run's start to the next.
    pub fn pitch(&self) -> usize {
        self.pitch
    }

    /// Bytes of each run.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Bytes of the part.
    pub fn bytes(&self) -> usize {
        self.runs * self.width
    }

    /// Queues on the piece's stream the copies of the part's bytes that `piece` (a piece of
    /// the range [`LoadInto::narrow`] gave, as [`LoadInto::run_ranges`] delivers it) holds into
    /// the part's destination at device address `dst`: one pitched copy for the runs the piece
    /// holds whole, one copy for each run it holds a part of (at most two).
    ///
    /// # Safety
    /// `dst .. dst + self.bytes()` must be device memory of the piece's stream's context,
    /// written by nothing else until the stream's work queued now has run.
    ///
    /// # Errors
    /// CUDA errors (a pitch the driver refuses: rows of more than 2 GiB).
    #[allow(
        unsafe_code,
        reason = "device copies by address, the destination the caller's promise"
    )]
    pub unsafe fn copy_piece(&self, piece: &Delivery<'_>, dst: u64) -> Result<()> {
        let moves = self.moves(piece.offset, piece.bytes.len());
        for (src_at, dst_at, n) in moves.runs.into_iter().flatten() {
            // SAFETY: the source is within the piece (`moves` keeps to it), the destination
            // within the part (the caller's promise; `moves` keeps to `bytes()`).
            unsafe {
                gpufeed_cuda::copy::dtod_async(
                    piece.stream,
                    dst + dst_at as u64,
                    piece.address + src_at as u64,
                    n,
                )
            }?;
        }
        if let Some((src_at, dst_at, height)) = moves.whole {
            // SAFETY: as above, for `height` runs `pitch` apart in the piece and back to back
            // in the part.
            unsafe {
                gpufeed_cuda::copy::dtod_2d_async(
                    piece.stream,
                    dst + dst_at as u64,
                    self.width,
                    piece.address + src_at as u64,
                    self.pitch,
                    self.width,
                    height,
                )
            }?;
        }
        Ok(())
    }

    /// [`Share::copy_piece`] casting on the way: the piece holds elements of `from`, the
    /// part's destination at `dst` is elements of `to` (as many), written by `kernel`'s
    /// kernels (one launch per partial run, one pitched launch for the whole runs).
    ///
    /// # Safety
    /// `dst .. dst + self.bytes() / from.size() * to.size()` must be device memory of the
    /// piece's stream's context, aligned to `to`'s elements and written by nothing else
    /// until the stream's work queued now has run.
    ///
    /// # Errors
    /// The kernels' ([`gpufeed_cuda::Error::CastUnsupported`] for a pair they do not cast);
    /// an error for a share that is not whole elements of `from`.
    #[allow(
        unsafe_code,
        reason = "kernel launches by address, the caller's promise"
    )]
    pub unsafe fn cast_piece(
        &self,
        piece: &Delivery<'_>,
        dst: u64,
        kernel: &gpufeed_cuda::cast::CastKernel,
        from: gpufeed_cuda::cast::CastType,
        to: gpufeed_cuda::cast::CastType,
    ) -> Result<()> {
        let (fs, ts) = (from.size(), to.size());
        if !(piece.offset.is_multiple_of(fs)
            && piece.bytes.len().is_multiple_of(fs)
            && self.pitch.is_multiple_of(fs)
            && self.width.is_multiple_of(fs))
        {
            return Err(Error::invalid(format!(
                "a piece of {} is not whole {from} elements",
                piece.name
            )));
        }
        let at = |bytes: usize| dst + (bytes / fs * ts) as u64;
        let moves = self.moves(piece.offset, piece.bytes.len());
        for (src_at, dst_at, n) in moves.runs.into_iter().flatten() {
            // SAFETY: the source is within the piece, the destination within the part (the
            // caller's promise, `moves` keeping to `bytes()`).
            unsafe {
                kernel.launch_raw(
                    piece.stream,
                    from,
                    piece.address + src_at as u64,
                    to,
                    at(dst_at),
                    (n / fs) as u64,
                )
            }?;
        }
        if let Some((src_at, dst_at, height)) = moves.whole {
            // SAFETY: as above, for `height` runs `pitch` apart in the piece.
            unsafe {
                kernel.launch_pitched_raw(
                    piece.stream,
                    from,
                    piece.address + src_at as u64,
                    self.pitch as u64,
                    to,
                    at(dst_at),
                    height as u64,
                    (self.width / fs) as u64,
                )
            }?;
        }
        Ok(())
    }

    /// The copies that move the part's bytes held by the piece at bytes `q0 .. q0 + len` of
    /// the range into the part (offsets in the piece and in the part).
    fn moves(&self, q0: usize, len: usize) -> Moves {
        let mut m = Moves::default();
        let q1 = q0 + len;
        if self.runs == 0 || len == 0 {
            return m;
        }
        if self.runs == 1 {
            let n = len.min(self.width.saturating_sub(q0));
            m.runs[0] = (n > 0).then_some((0, q0, n));
            return m;
        }
        let (p, w) = (self.pitch, self.width);
        // Run `o` is bytes `o * p .. o * p + w` of the range, `o * w ..` of the part.
        let part = |o: usize| {
            let (a, b) = ((o * p).max(q0), (o * p + w).min(q1));
            (b > a).then(|| (a - q0, o * w + (a - o * p), b - a))
        };
        let (first, last) = (q0 / p, ((q1 - 1) / p).min(self.runs - 1));
        let whole = |o: usize| o * p >= q0 && o * p + w <= q1;
        // The runs strictly between the first and the last are whole; those two may not be.
        let (mut from, mut to) = (first, last + 1);
        if !whole(first) {
            m.runs[0] = part(first);
            from += 1;
        }
        if to > from && !whole(last) {
            m.runs[1] = part(last);
            to -= 1;
        }
        if from < to {
            m.whole = Some((from * p - q0, from * w, to - from));
        }
        m
    }
}

/// What [`Share::moves`] gives: up to two copies of part of a run (from, to, bytes) and the
/// whole runs as one pitched copy (from, to, runs).
#[derive(Debug, Default, PartialEq, Eq)]
struct Moves {
    runs: [Option<(usize, usize, usize)>; 2],
    whole: Option<(usize, usize, usize)>,
}

/// A failed driver call as this crate's error.
fn cuda(op: &'static str, e: gpufeed_cuda::cudarc::driver::DriverError) -> Error {
    gpufeed_cuda::Error::Cuda { op, result: e.0 }.into()
}

/// The wanted parts `want` (a tensor's index and a range of its bytes, sorted by offset) of
/// one file as pieces of at most `stage` bytes.
fn pieces_of(
    parsed: &Parsed,
    want: &[(usize, std::ops::Range<usize>)],
    stage: usize,
) -> Vec<Piece> {
    let mut pieces = Vec::new();
    for (i, bytes) in want {
        let t = &parsed.tensors[*i];
        let start = parsed.data_start + (t.range.start + bytes.start) as u64;
        let len = bytes.end - bytes.start;
        let mut offset = 0usize;
        // An empty tensor has nothing to copy.
        while offset < len {
            let n = (len - offset).min(stage);
            pieces.push(Piece {
                tensor: *i,
                span: start + offset as u64..start + (offset + n) as u64,
                offset,
            });
            offset += n;
        }
    }
    pieces
}

/// `pieces` in chunks (ranges of indices) of at most `stage` bytes, in order.
fn chunks_of(pieces: &[Piece], stage: u64) -> Vec<std::ops::Range<usize>> {
    let (mut chunks, mut from, mut size) = (Vec::new(), 0usize, 0u64);
    for (i, p) in pieces.iter().enumerate() {
        let n = p.span.end - p.span.start;
        if i > from && size + n > stage {
            chunks.push(from..i);
            (from, size) = (i, 0);
        }
        size += n;
    }
    if from < pieces.len() {
        chunks.push(from..pieces.len());
    }
    chunks
}

/// The bytes of `chunk`.
fn chunk_len(chunk: &[Piece]) -> usize {
    chunk
        .iter()
        .map(|p| (p.span.end - p.span.start) as usize)
        .sum()
}

/// Writes the tensors of `path` named in `dsts` into those device slices (each exactly the tensor's
/// bytes), through [`LoadInto`] with `opts`.
///
/// # Errors
/// [`Error::NoTensor`] for a name the checkpoint lacks, an error naming the tensor for a
/// destination whose length is not the tensor's, before a byte moves; then
/// [`LoadInto::run`]'s (a failed load leaves the destinations partly written).
pub fn load_into(
    loader: &Loader,
    path: impl AsRef<Path>,
    dsts: &mut HashMap<String, CudaSlice<u8>>,
    opts: &LoadIntoOptions,
) -> Result<LoadIntoReport> {
    let ckpt = LoadInto::open(path)?;
    for (name, dst) in dsts.iter() {
        let t = ckpt.get(name).ok_or_else(|| Error::NoTensor {
            path: ckpt.path.clone(),
            name: name.clone(),
        })?;
        let want = t.range.end - t.range.start;
        if dst.len() != want {
            return Err(Error::invalid(format!(
                "{}: a destination of {} bytes for {name}, which has {want}",
                ckpt.path.display(),
                dst.len()
            )));
        }
    }
    let names: Vec<String> = dsts.keys().cloned().collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    ckpt.run(loader, &names, opts, |piece| {
        let Some(dst) = dsts.get_mut(piece.name) else {
            return Err(Error::invalid(format!(
                "a piece of {} that was not asked for",
                piece.name
            )));
        };
        let end = piece.offset + piece.bytes.len();
        piece
            .stream
            .memcpy_dtod(&piece.bytes, &mut dst.slice_mut(piece.offset..end))
            .map_err(|e| cuda("cuMemcpyDtoDAsync", e))?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(tensor: usize, a: u64, b: u64, offset: usize) -> Piece {
        Piece {
            tensor,
            span: a..b,
            offset,
        }
    }

    /// A slice of rows is the bytes of whole rows of the first dimension; 0-d tensors, rows
    /// past the end and missing names are refused with the tensor named.
    #[test]
    fn rows_are_whole_rows_of_the_first_dimension() {
        use safetensors::tensor::{Dtype, TensorView};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rows.safetensors");
        let (a, one) = (vec![3u8; 60], vec![7u8; 1]);
        let views = vec![
            ("a", TensorView::new(Dtype::F32, vec![5, 3], &a).expect("a")),
            ("s", TensorView::new(Dtype::U8, vec![], &one).expect("s")),
            (
                "e",
                TensorView::new(Dtype::F32, vec![0, 4], &[]).expect("e"),
            ),
        ];
        safetensors::serialize_to_file(views, None, &path).expect("write");
        let ckpt = LoadInto::open(&path).expect("open");
        assert_eq!(ckpt.rows("a", 1..4).expect("rows"), 12..48);
        assert_eq!(ckpt.rows("a", 0..5).expect("rows"), 0..60);
        assert_eq!(ckpt.rows("a", 2..2).expect("rows"), 24..24);
        assert_eq!(ckpt.rows("e", 0..0).expect("rows"), 0..0);
        let past = ckpt.rows("a", 4..6).expect_err("past the end").to_string();
        assert!(
            past.contains("tensor a") && past.contains("rows 4..6 of 5"),
            "{past}"
        );
        let scalar = ckpt.rows("s", 0..1).expect_err("0-d").to_string();
        assert!(
            scalar.contains("tensor s") && scalar.contains("0-d"),
            "{scalar}"
        );
        assert!(matches!(
            ckpt.rows("nope", 0..1),
            Err(Error::NoTensor { .. })
        ));
        // Columns 1..3 of the 5 x 3 F32 matrix: 5 runs of 8 bytes, 12 apart, from byte 4.
        let (range, share) = ckpt.narrow("a", 1, 1..3).expect("columns");
        assert_eq!(range, 4..4 + 4 * 12 + 8);
        assert_eq!((share.runs, share.pitch, share.width), (5, 12, 8));
        // Every column, or rows: one run, as `rows` gives.
        let (range, share) = ckpt.narrow("a", 1, 0..3).expect("every column");
        assert_eq!((range, share.runs, share.bytes()), (0..60, 1, 60));
        let (range, share) = ckpt.narrow("a", 0, 1..4).expect("rows");
        assert_eq!((range, share.runs, share.bytes()), (12..48, 1, 36));
        let (range, share) = ckpt.narrow("a", 1, 2..2).expect("no columns");
        assert_eq!((range, share.bytes()), (0..0, 0));
        let bad = ckpt
            .narrow("a", 2, 0..1)
            .expect_err("no dimension 2")
            .to_string();
        assert!(bad.contains("no dimension 2"), "{bad}");
        let bad = ckpt.narrow("a", 1, 2..4).expect_err("past").to_string();
        assert!(bad.contains("2..4 of dimension 1, which has 3"), "{bad}");
    }

    #[test]
    fn chunks_hold_at_most_the_staging_and_never_nothing() {
        let pieces = [
            piece(0, 0, 10, 0),
            piece(1, 10, 30, 0),
            piece(2, 40, 45, 0),
            piece(3, 45, 75, 0),
        ];
        assert_eq!(chunks_of(&pieces, 30), vec![0..2, 2..3, 3..4]);
        let one = chunks_of(&pieces, 100);
        assert_eq!(one, vec![0..4]);
        let spans = merge_adjacent(pieces[one[0].clone()].iter().map(|p| p.span.clone()));
        assert_eq!(spans, vec![0..30, 40..75]);
        assert!(chunks_of(&[], 30).is_empty());
    }

    #[test]
    fn a_shares_pieces_move_exactly_its_bytes_wherever_the_pieces_split() {
        // A tensor [runs, cols] of one-byte elements, columns c0..c1; its narrowed range
        // split into pieces at every pair of cut points: moving them as `moves` says gives
        // the part, byte for byte, and writes nothing else.
        for (runs, cols, c0, c1) in [
            (5, 7, 2, 5),
            (3, 4, 0, 1),
            (4, 6, 5, 6),
            (1, 9, 3, 8),
            (6, 3, 0, 3),
        ] {
            let tensor: Vec<u8> = (0..runs * cols).map(|i| i as u8).collect();
            let want: Vec<u8> = (0..runs)
                .flat_map(|r| tensor[r * cols + c0..r * cols + c1].to_vec())
                .collect();
            let share = if c1 - c0 == cols || runs == 1 {
                Share {
                    runs: 1,
                    pitch: runs * (c1 - c0),
                    width: runs * (c1 - c0),
                }
            } else {
                Share {
                    runs,
                    pitch: cols,
                    width: c1 - c0,
                }
            };
            assert_eq!(share.bytes(), want.len());
            let hull = &tensor[c0..c0 + (share.runs - 1) * share.pitch + share.width];
            for cut_a in 0..=hull.len() {
                for cut_b in cut_a..=hull.len() {
                    let mut got = vec![0xEEu8; want.len()];
                    for (q0, q1) in [(0, cut_a), (cut_a, cut_b), (cut_b, hull.len())] {
                        let piece = &hull[q0..q1];
                        let m = share.moves(q0, q1 - q0);
                        for (src, dst, n) in m.runs.into_iter().flatten() {
                            got[dst..dst + n].copy_from_slice(&piece[src..src + n]);
                        }
                        if let Some((src, dst, height)) = m.whole {
                            for r in 0..height {
                                let (s, d) = (src + r * share.pitch, dst + r * share.width);
                                got[d..d + share.width].copy_from_slice(&piece[s..s + share.width]);
                            }
                        }
                    }
                    assert_eq!(
                        got, want,
                        "{runs}x{cols} [{c0}..{c1}) cut at {cut_a}, {cut_b}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_staging_of_any_size_splits_tensors_between_elements() {
        // Whole 4 KiB whatever is asked, so a piece of a tensor of 2, 4 or 8-byte elements is
        // whole elements (casts rely on it).
        let opts = LoadIntoOptions::default().with_staging_bytes((1 << 20) + 4097);
        assert_eq!(opts.staging_bytes, (1 << 20) + 4096);
        assert_eq!(
            LoadIntoOptions::default()
                .with_staging_bytes(3)
                .staging_bytes,
            1 << 20
        );
    }
}
