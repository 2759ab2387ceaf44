//! A file range as the transfer scheduler's fill source.

use std::ops::Range;
use std::path::Path;

use gpufeed_cuda::{FillSource, SourceError};
use gpufeed_os::{Fallback, OpenedFile};
use gpufeed_uring::{Direct, Reader};
use parking_lot::Mutex;

use crate::error::Result;
use crate::loader::Readers;

/// A file range as a fill source. Buffered (`Staged`): every fill thread `pread`s from one
/// descriptor opened once per load — a read of cached pages completes inside the call, so
/// io_uring adds nothing, and opening the file in a ring per thread cost each thread a few
/// system calls before its first byte. `O_DIRECT` (`Direct`): each fill thread reads with its
/// own io_uring reader (several reads in flight), taken from the loader's idle readers (or
/// built) with the file opened in it, and given back with the file closed by
/// [`FileSource::finish`].
pub(crate) struct FileSource<'a> {
    file: &'a OpenedFile,
    /// The file's ranges, back to back in the stream the scheduler uploads.
    spans: Spans<'a>,
    /// Buffered loads `pread` the opened file itself; `false`: O_DIRECT through readers.
    buffered: bool,
    queue_depth: usize,
    readers: &'a Readers,
    /// Readers with the file open, not in use by a fill thread right now.
    pub(crate) open: Mutex<Vec<OpenReader>>,
}

/// A reader with the load's file open in it.
pub(crate) struct OpenReader {
    pub(crate) reader: Reader,
    file: gpufeed_uring::FileId,
}

impl<'a> FileSource<'a> {
    pub(crate) fn new(
        file: &'a OpenedFile,
        spans: &'a [Range<u64>],
        direct: bool,
        queue_depth: usize,
        readers: &'a Readers,
    ) -> Self {
        FileSource {
            file,
            spans: Spans::new(spans),
            buffered: !direct,
            queue_depth,
            readers,
            open: Mutex::new(Vec::new()),
        }
    }

    /// Bytes of all spans together.
    pub(crate) fn len(&self) -> u64 {
        self.spans.len()
    }

    /// An idle reader (or a new one) with the file opened in it.
    pub(crate) fn take(&self) -> Result<OpenReader> {
        // Readers serve the O_DIRECT loads only (buffered ones pread `buffered`).
        let mut reader = self.readers.take(Direct::On, self.queue_depth)?;
        match reader.open_opened(self.file) {
            Ok(file) => Ok(OpenReader { reader, file }),
            Err(e) => {
                self.readers.give_back(Direct::On, reader);
                Err(e.into())
            }
        }
    }

    /// Closes the file in every reader, gives them back, and returns their fallbacks.
    pub(crate) fn finish(self) -> Vec<Fallback> {
        let mut fallbacks = Vec::new();
        for OpenReader { mut reader, file } in self.open.into_inner() {
            for f in &reader.stats().fallbacks {
                f.clone().push_once(&mut fallbacks);
            }
            // Cannot fail: `file` was opened by this reader and not closed.
            if reader.close(file).is_ok() {
                self.readers.give_back(Direct::On, reader);
            }
        }
        fallbacks
    }
}

/// Byte ranges of a source (a file, an object), back to back in the stream a scheduler
/// uploads. Spans may be empty, repeat or overlap.
pub(crate) struct Spans<'a> {
    spans: &'a [Range<u64>],
    /// Where each span ends in that stream.
    ends: Vec<u64>,
}

impl<'a> Spans<'a> {
    pub(crate) fn new(spans: &'a [Range<u64>]) -> Self {
        let ends = spans
            .iter()
            .scan(0u64, |end, s| {
                *end += s.end.saturating_sub(s.start);
                Some(*end)
            })
            .collect();
        Spans { spans, ends }
    }

    /// Bytes of all spans together.
    pub(crate) fn len(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    /// Where the stream's byte 0 lies in the source: the first non-empty span's start (what
    /// later spans do to alignment is theirs; one span is the common case).
    #[cfg(feature = "object")]
    pub(crate) fn origin(&self) -> u64 {
        self.spans
            .iter()
            .find(|s| s.end > s.start)
            .map_or(0, |s| s.start)
    }

    /// Reads `[offset, offset + dst.len())` of the stream: the spans it covers, one by one,
    /// each with `read(source offset, bytes)`.
    pub(crate) fn read<E: From<&'static str>>(
        &self,
        offset: u64,
        dst: &mut [u8],
        mut read: impl FnMut(u64, &mut [u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let (mut at, mut done) = (offset, 0usize);
        let mut i = self.ends.partition_point(|&end| end <= offset);
        while done < dst.len() {
            let (Some(span), Some(&end)) = (self.spans.get(i), self.ends.get(i)) else {
                return Err(E::from("a fill past the end of the spans"));
            };
            let span_start = end - (span.end - span.start);
            let n = ((end - at) as usize).min(dst.len() - done);
            read(span.start + (at - span_start), &mut dst[done..done + n])?;
            done += n;
            at += n as u64;
            i += 1;
        }
        Ok(())
    }
}

impl FillSource for FileSource<'_> {
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        if self.buffered {
            return self.spans.read(offset, dst, |at, buf| {
                pread_exact(self.file.file(), self.file.path(), at, buf).map_err(Into::into)
            });
        }
        let ready = self.open.lock().pop();
        let mut open = match ready {
            Some(r) => r,
            None => self.take()?,
        };
        let result = self.spans.read(offset, dst, |at, buf| {
            open.reader
                .read_exact_at(open.file, at, buf)
                .map_err(Into::into)
        });
        self.open.lock().push(open);
        result
    }
}

/// Reads all of `buf` from `file` (at `path`) at `offset` with `pread`, with the errors an
/// io_uring reader gives: [`gpufeed_uring::Error::UnexpectedEof`] where the file ends first,
/// [`gpufeed_uring::Error::Read`] for a failed read.
fn pread_exact(
    file: &std::fs::File,
    path: &Path,
    offset: u64,
    buf: &mut [u8],
) -> std::result::Result<(), gpufeed_uring::Error> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(gpufeed_uring::Error::UnexpectedEof {
                    path: path.into(),
                    offset,
                    got: done as u64,
                    want: buf.len() as u64,
                });
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(gpufeed_uring::Error::Read {
                    path: path.into(),
                    offset: offset + done as u64,
                    source,
                });
            }
        }
    }
    Ok(())
}
