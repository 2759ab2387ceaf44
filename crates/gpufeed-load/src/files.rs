//! Many files into one GPU buffer: [`FileList`] (the files and where each one's bytes go) and
//! [`Loader::load_files`] / [`Loader::load_list`].
//!
//! A folder of small files (an image data set: a million files of ~110 KiB) loaded one
//! `load_file` at a time pays a load's fixed costs per file. A list is loaded as one upload:
//! the fill threads each take a piece of the concatenated bytes, open the files of that piece
//! in their io_uring reader and read them in one batch into pinned staging, and the pieces go
//! to the GPU in large copies.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufeed_cuda::{FillSource, HostSource, SourceError};
use gpufeed_uring::{Direct, Reader};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::loader::{Loader, Readers};
use crate::options::{DeviceBuffer, Strategy};
use crate::route::read_error;

/// Files with their sizes, listed once (in parallel: `statx` per file), and where each one's
/// bytes go in a buffer holding all of them back to back: file `i` at
/// [`FileList::range`]`(i)`.
///
/// # Example
/// ```no_run
/// let list = gpufeed_load::FileList::new(["a.jpg", "b.jpg", "c.jpg"])?;
/// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::default())?;
/// let (bytes, report) = loader.load_list(&list)?;
/// println!("{} files, {} bytes at {:.1} GB/s; b.jpg at {:?}", list.len(), bytes.len(), report.gbps(), list.range(1));
/// # Ok::<(), gpufeed_load::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct FileList {
    paths: Vec<PathBuf>,
    /// `paths.len() + 1` offsets: file `i` is `offsets[i]..offsets[i + 1]`.
    offsets: Vec<u64>,
    skipped: Vec<Skipped>,
}

/// A file left out of a [`FileList`] made by [`FileList::new_skipping`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// Its position among the paths given.
    pub index: usize,
    /// The path.
    pub path: PathBuf,
    /// Why (the error it would have been).
    pub reason: String,
}

/// Lists below this many files are stat'ed on the calling thread; larger ones on several.
const PARALLEL_FROM: usize = 512;

impl FileList {
    /// Lists `paths` in order with their sizes.
    ///
    /// # Errors
    /// The first file that cannot be loaded, named: missing, a directory, a FIFO or device, a
    /// symlink loop, a pseudo file (`/proc`, `/sys`) — found without opening anything, so
    /// nothing blocks.
    pub fn new<P: AsRef<Path>>(paths: impl IntoIterator<Item = P>) -> Result<Self> {
        let (list, first_bad) = Self::build(paths, true)?;
        match first_bad {
            Some(e) => Err(e),
            None => Ok(list),
        }
    }

    /// Lists `paths`, leaving out the files that [`FileList::new`] would refuse (each in
    /// [`FileList::skipped`], with why). A file that goes bad after it was listed (deleted,
    /// made unreadable, truncated) is still an error of the load.
    pub fn new_skipping<P: AsRef<Path>>(paths: impl IntoIterator<Item = P>) -> Result<Self> {
        Self::build(paths, false).map(|(list, _)| list)
    }

    fn build<P: AsRef<Path>>(
        paths: impl IntoIterator<Item = P>,
        strict: bool,
    ) -> Result<(Self, Option<Error>)> {
        let paths: Vec<PathBuf> = paths.into_iter().map(|p| p.as_ref().to_owned()).collect();
        let sizes = stat_all(&paths)?;
        let mut list = FileList {
            paths: Vec::with_capacity(paths.len()),
            offsets: Vec::with_capacity(paths.len() + 1),
            skipped: Vec::new(),
        };
        list.offsets.push(0);
        let mut end = 0u64;
        for (index, (path, size)) in paths.into_iter().zip(sizes).enumerate() {
            // Sizes come from the file system (sparse files can be huge): checked.
            let size = size.and_then(|s| {
                end.checked_add(s).ok_or_else(|| Error::ListTooLarge {
                    path: path.clone(),
                    size: s,
                    before: end,
                })
            });
            match size {
                Ok(size) => {
                    end = size;
                    list.paths.push(path);
                    list.offsets.push(end);
                }
                Err(e) if strict => return Ok((list, Some(e))),
                Err(e) => list.skipped.push(Skipped {
                    index,
                    path,
                    reason: e.to_string(),
                }),
            }
        }
        Ok((list, None))
    }

    /// Files in the list.
    pub fn len(&self) -> usize {
        self.paths.len()
    }

    /// Whether the list has no file.
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    /// The files, in order.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// `len() + 1` offsets into the loaded buffer: file `i` is `offsets[i]..offsets[i + 1]`
    /// (the layout GPU kernels take).
    pub fn offsets(&self) -> &[u64] {
        &self.offsets
    }

    /// Where file `i`'s bytes are in the loaded buffer (`None` past the end).
    pub fn range(&self, i: usize) -> Option<Range<u64>> {
        Some(*self.offsets.get(i)?..*self.offsets.get(i + 1)?)
    }

    /// Bytes of all the files.
    pub fn total_bytes(&self) -> u64 {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// Files left out by [`FileList::new_skipping`].
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// Reads all the files into `buf` (of [`FileList::total_bytes`]) on this thread, in
    /// batches of buffered io_uring reads: the list in host memory, where there is no GPU.
    ///
    /// # Errors
    /// A `buf` of another size; a file that went bad since it was listed (named).
    pub fn read_into(&self, buf: &mut [u8]) -> Result<()> {
        if buf.len() as u64 != self.total_bytes() {
            return Err(Error::InvalidSetting(format!(
                "a buffer of {} bytes for files of {} bytes; give one of exactly their size",
                buf.len(),
                self.total_bytes()
            )));
        }
        let readers = Readers::default();
        let source = ListSource {
            list: self,
            direct: Direct::Off,
            queue_depth: 32,
            readers: &readers,
            idle: Mutex::new(Vec::new()),
        };
        let mut reader = readers.take(Direct::Off, 32)?;
        // In batches of up to 8 MiB, so that a reader never holds thousands of files open.
        let mut at = 0u64;
        for part in buf.chunks_mut(8 << 20) {
            source.fill_with(&mut reader, at, part)?;
            at += part.len() as u64;
        }
        Ok(())
    }

    /// The files overlapping bytes `[offset, offset + len)` of the buffer, each as (its index,
    /// the range of its bytes, the offset in the buffer where that range goes).
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (usize, Range<u64>, u64)> {
        let end = offset + len;
        // The last file starting at or before `offset`.
        let first = self
            .offsets
            .partition_point(|&o| o <= offset)
            .saturating_sub(1);
        (first..self.paths.len())
            .take_while(move |&i| self.offsets[i] < end)
            .filter_map(move |i| {
                let (start, stop) = (self.offsets[i], self.offsets[i + 1]);
                let (from, to) = (start.max(offset), stop.min(end));
                (from < to).then(|| (i, from - start..to - start, from))
            })
    }
}

/// Each path's size (or why it cannot be loaded), on several threads for long lists.
fn stat_all(paths: &[PathBuf]) -> Result<Vec<Result<u64>>> {
    let stat = |p: &PathBuf| -> Result<u64> { Ok(gpufeed_os::file::stat_regular(p)?.size) };
    if paths.len() < PARALLEL_FROM {
        return Ok(paths.iter().map(stat).collect());
    }
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .min(paths.len() / (PARALLEL_FROM / 2))
        .max(1);
    let per = paths.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles = paths
            .chunks(per)
            .map(|part| {
                std::thread::Builder::new()
                    .name("gpufeed-stat".into())
                    .spawn_scoped(scope, move || part.iter().map(stat).collect::<Vec<_>>())
                    .map_err(|source| Error::ThreadStart {
                        what: "threads listing the files",
                        source,
                    })
            })
            .collect::<Vec<_>>();
        let mut sizes = Vec::with_capacity(paths.len());
        for h in handles {
            let part = h?.join().map_err(|_| Error::ThreadPanicked {
                what: "a thread listing the files",
            })?;
            sizes.extend(part);
        }
        Ok(sizes)
    })
}

/// What a load of a [`FileList`] did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FilesReport {
    /// Files loaded.
    pub files: usize,
    /// Bytes loaded.
    pub bytes: u64,
    /// Wall seconds of the load (not of listing the files).
    pub seconds: f64,
    /// `Staged` (buffered reads) or `Direct` (`O_DIRECT`).
    pub strategy: Strategy,
    /// Why that strategy.
    pub reason: String,
    /// Seconds the copies waited for the reads.
    pub copy_waited_s: f64,
    /// Seconds the reads waited for free staging buffers.
    pub source_waited_s: f64,
    /// The IO backend.
    pub io_backend: Option<String>,
    /// Slower paths taken.
    pub fallbacks: Vec<crate::Fallback>,
}

impl FilesReport {
    /// GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        gpufeed_os::gbps(self.bytes, self.seconds)
    }

    /// Files per second.
    pub fn files_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.files as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// Files sampled for page-cache residency when `Auto` picks a list's strategy.
const RESIDENCY_SAMPLES: usize = 8;

impl Loader {
    /// Lists `paths` ([`FileList::new`]) and loads them all into one new GPU buffer, back to
    /// back in the order given; the list says where each file is.
    ///
    /// # Errors
    /// [`FileList::new`]'s, then [`Loader::load_list_into`]'s.
    ///
    /// # Example
    /// ```no_run
    /// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::default())?;
    /// let paths: Vec<_> = std::fs::read_dir("images")?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
    /// let (bytes, list, report) = loader.load_files(&paths)?;
    /// println!("{} files at {:.0} files/s; offsets for the decoder: {:?}", list.len(), report.files_per_second(), &list.offsets()[..2]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load_files<P: AsRef<Path>>(
        &self,
        paths: impl IntoIterator<Item = P>,
    ) -> Result<(DeviceBuffer, FileList, FilesReport)> {
        let list = FileList::new(paths)?;
        let (buf, report) = self.load_list(&list)?;
        Ok((buf, list, report))
    }

    /// Loads the files of `list` into one new GPU buffer of [`FileList::total_bytes`].
    ///
    /// # Errors
    /// [`Loader::load_list_into`]'s, and the allocation's.
    pub fn load_list(&self, list: &FileList) -> Result<(DeviceBuffer, FilesReport)> {
        let len = list.total_bytes() as usize;
        self.gpu.alloc_filled(len, self.device_alloc(len), |dst| {
            self.load_list_into(list, dst, 0)
        })
    }

    /// Loads the files of `list` into `dst` from `dst_offset` on: file `i` at `dst_offset +
    /// list.range(i)`.
    ///
    /// Several fill threads read at once, each a piece of the list in one batch of io_uring
    /// reads; `Strategy::Auto` reads buffered when sampled files are in the page cache and
    /// with `O_DIRECT` when they are not (and the file system allows it), `Registered` is
    /// read as `Staged` (a list is not one mapping).
    ///
    /// # Errors
    /// A file that went bad since it was listed (gone, unreadable, shorter: named), read and
    /// CUDA errors, a destination too small.
    pub fn load_list_into(
        &self,
        list: &FileList,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<FilesReport> {
        let started = Instant::now();
        let len = list.total_bytes();
        crate::route::fits(len, dst_offset, dst.len())?;
        let (strategy, reason) = self.list_strategy(list);
        let mut report = FilesReport {
            files: list.len(),
            bytes: len,
            seconds: 0.0,
            strategy,
            reason,
            copy_waited_s: 0.0,
            source_waited_s: 0.0,
            io_backend: None,
            fallbacks: Vec::new(),
        };
        if self.opts.strategy == Strategy::Gds {
            gpufeed_os::Fallback::new(
                gpufeed_os::Refused::Gds,
                "a list of files is not read through cuFile (one request per file)",
                "O_DIRECT reads through io_uring",
            )
            .push_once(&mut report.fallbacks);
        }
        if len == 0 {
            return Ok(report);
        }
        let direct = if strategy == Strategy::Direct {
            Direct::On
        } else {
            Direct::Off
        };
        let source = ListSource {
            list,
            direct,
            // Files are small: more reads in flight than for one large file.
            queue_depth: self.opts.queue_depth.max(32),
            readers: &self.readers,
            idle: Mutex::new(Vec::new()),
        };
        let mut view = dst.slice_mut(dst_offset..dst_offset + len as usize);
        let uploaded = self
            .sched
            .upload(
                HostSource::Fill {
                    source: &source,
                    len,
                },
                &mut view,
                0,
            )
            .map_err(read_error);
        let readers = source.idle.into_inner();
        if let Some(r) = readers.first() {
            report.io_backend = Some(r.backend().to_string());
        }
        for reader in readers {
            for f in &reader.stats().fallbacks {
                f.clone().push_once(&mut report.fallbacks);
            }
            self.readers.give_back(direct, reader);
        }
        for f in self.sched.fallbacks() {
            f.push_once(&mut report.fallbacks);
        }
        let stats = uploaded?;
        report.copy_waited_s = stats.copy_waited_s;
        report.source_waited_s = stats.source_waited_s;
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }

    /// The strategy of a list load, and why.
    fn list_strategy(&self, list: &FileList) -> (Strategy, String) {
        match self.opts.strategy {
            Strategy::Staged => (Strategy::Staged, "asked for".into()),
            Strategy::Direct => (Strategy::Direct, "asked for".into()),
            Strategy::Gds => (
                Strategy::Direct,
                "a list of files is not read through cuFile (one request per file); O_DIRECT reads through io_uring instead".into(),
            ),
            Strategy::Registered => (
                Strategy::Staged,
                "Registered maps one file; a list of files is read into staging".into(),
            ),
            Strategy::Auto => {
                // A few files spread over the list stand for all of them.
                let n = list.len();
                let step = n.div_ceil(RESIDENCY_SAMPLES).max(1);
                let (mut cached, mut total) = (0.0, 0.0);
                for path in list.paths().iter().step_by(step) {
                    if let Ok(r) = gpufeed_os::cache::residency(path) {
                        cached += r.fraction() * r.file_bytes as f64;
                        total += r.file_bytes as f64;
                    }
                }
                let resident = if total > 0.0 { cached / total } else { 1.0 };
                let sampled = n.div_ceil(step);
                let dio = list.paths().first().is_some_and(|p| {
                    std::fs::File::open(p)
                        .ok()
                        .and_then(|f| gpufeed_os::align::dio_alignment(&f).ok())
                        .is_some_and(|d| d.supported())
                });
                if resident >= 0.5 || !dio {
                    (
                        Strategy::Staged,
                        format!(
                            "{:.0}% of {sampled} sampled files in the page cache{}: buffered reads",
                            resident * 100.0,
                            if dio { "" } else { ", O_DIRECT refused" }
                        ),
                    )
                } else {
                    (
                        Strategy::Direct,
                        format!(
                            "{:.0}% of {sampled} sampled files in the page cache: O_DIRECT reads",
                            resident * 100.0
                        ),
                    )
                }
            }
        }
    }
}

/// A list's bytes as a fill source: each piece's files are opened in a reader, read in one
/// batch, and closed.
struct ListSource<'a> {
    list: &'a FileList,
    direct: Direct,
    queue_depth: usize,
    readers: &'a Readers,
    /// Readers taken for this load, between pieces.
    idle: Mutex<Vec<Reader>>,
}

impl ListSource<'_> {
    fn fill_with(&self, reader: &mut Reader, offset: u64, dst: &mut [u8]) -> Result<()> {
        let mut rest = dst;
        let mut parts = Vec::new();
        for (i, range, _) in self.list.pieces(offset, rest.len() as u64) {
            let (head, tail) =
                std::mem::take(&mut rest).split_at_mut((range.end - range.start) as usize);
            let listed = self.list.range(i).map(|r| r.end - r.start);
            parts.push((self.list.paths[i].as_path(), range.start, head, listed));
            rest = tail;
        }
        read_parts(reader, parts)
    }
}

/// Most files a reader holds open at once (eight readers stay well under the usual limit of
/// 1024 descriptors, however small the files).
const OPEN_AT_ONCE: usize = 64;

/// One part of [`read_parts`]: a file's path, the offset in it, the destination, and the
/// file's whole size as listed where the caller listed it (a file found at another size when
/// opened is then an error naming it, not a read cut at the old size).
pub type Part<'a> = (&'a Path, u64, &'a mut [u8], Option<u64>);

/// Reads each [`Part`] exactly with `reader`, up to 64 files at a time (`OPEN_AT_ONCE`):
/// opened (its size checked against the listed one), read in one batch, closed (also on an
/// error).
pub fn read_parts<'a>(
    reader: &mut Reader,
    parts: impl IntoIterator<Item = Part<'a>>,
) -> Result<()> {
    let mut parts = parts.into_iter().peekable();
    while parts.peek().is_some() {
        let mut ids = Vec::with_capacity(OPEN_AT_ONCE);
        let mut reads = Vec::with_capacity(OPEN_AT_ONCE);
        let mut opened = Ok(());
        for (path, offset, dst, listed) in parts.by_ref().take(OPEN_AT_ONCE) {
            match reader.open_brief(path) {
                Ok(id) => {
                    ids.push(id);
                    // The open's own fstat: no system call more.
                    let now = reader.len_at_open(id).ok();
                    if let (Some(listed), Some(now)) = (listed, now)
                        && listed != now
                    {
                        opened = Err(Error::FileChangedDuringLoad {
                            path: path.into(),
                            what: format!(
                                "{listed} bytes when the files were listed, {now} bytes now"
                            ),
                        });
                        break;
                    }
                    reads.push((id, offset, dst));
                }
                Err(e) => {
                    opened = Err(e.into());
                    break;
                }
            }
        }
        let read = opened.and_then(|()| Ok(reader.read_exact_many(reads)?));
        for id in ids {
            // Cannot fail: opened above by this reader.
            let _ = reader.close(id);
        }
        read?;
    }
    Ok(())
}

impl FillSource for ListSource<'_> {
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        let ready = self.idle.lock().pop();
        let mut reader = match ready {
            Some(r) => r,
            None => self.readers.take(self.direct, self.queue_depth)?,
        };
        let result = self.fill_with(&mut reader, offset, dst);
        self.idle.lock().push(reader);
        result.map_err(|e| match e {
            // The reader's own error, so that `read_error` types it back to `Error::Read`.
            Error::Read(read) => Box::new(read) as SourceError,
            other => Box::new(other),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(sizes: &[u64]) -> FileList {
        let mut offsets = vec![0];
        for s in sizes {
            offsets.push(offsets.last().unwrap() + s);
        }
        FileList {
            paths: (0..sizes.len())
                .map(|i| PathBuf::from(format!("{i}")))
                .collect(),
            offsets,
            skipped: Vec::new(),
        }
    }

    /// Pieces of the buffer map to the right files and byte ranges, empty files left out.
    #[test]
    fn pieces_map_buffer_ranges_to_files() {
        let l = list(&[10, 0, 5, 20]);
        let all: Vec<_> = l.pieces(0, 35).collect();
        assert_eq!(all, vec![(0, 0..10, 0), (2, 0..5, 10), (3, 0..20, 15)]);
        assert_eq!(
            l.pieces(7, 6).collect::<Vec<_>>(),
            vec![(0, 7..10, 7), (2, 0..3, 10)]
        );
        assert_eq!(l.pieces(10, 5).collect::<Vec<_>>(), vec![(2, 0..5, 10)]);
        assert_eq!(l.pieces(30, 5).collect::<Vec<_>>(), vec![(3, 15..20, 30)]);
        assert_eq!(l.range(1), Some(10..10));
        assert_eq!(l.range(4), None);
        assert_eq!(l.total_bytes(), 35);
        // Every byte of the buffer in exactly one piece, whatever the cut.
        for cut in 1..35 {
            let mut covered = 0;
            let mut at = 0;
            while at < 35 {
                let n = cut.min(35 - at);
                covered += l
                    .pieces(at, n)
                    .map(|(_, r, _)| r.end - r.start)
                    .sum::<u64>();
                at += n;
            }
            assert_eq!(covered, 35, "cut {cut}");
        }
    }
}
