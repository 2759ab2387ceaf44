//! Objects (`s3://`, `https://`) into GPU memory (the `object` feature): ranged GETs straight
//! into the pinned staging buffers, each uploaded as soon as it is full.

use std::ops::Range;
use std::time::Instant;

use gpufeed_cuda::cudarc::driver::{DevicePtrMut, DeviceSlice};
use gpufeed_cuda::{FillSource, HostSource, SourceError};

use crate::error::{Error, Result};
use crate::loader::Loader;
use crate::options::{DeviceBuffer, LoadOptions, LoadReport, Strategy};
use crate::route::read_error;
use crate::source::Spans;

/// Byte ranges of an object, back to back, as the scheduler's fill source: each fill thread
/// fills its staging buffer with one [`Object::read_exact_at`] per span it covers (several
/// ranged GETs in flight for a large one), so network, host and PCIe overlap, and host
/// memory is the staging alone.
struct ObjectSource<'a> {
    object: &'a Object,
    spans: Spans<'a>,
}

impl FillSource for ObjectSource<'_> {
    fn fill(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), SourceError> {
        self.spans.read(offset, dst, |at, buf| {
            self.object
                .read_exact_at(at, buf)
                .map(|_| ())
                .map_err(SourceError::from)
        })
    }

    /// The staging pieces at the object's multiples of the piece size, so each is filled by
    /// whole GETs of the object's aligned blocks: a checkpoint's data section starts after
    /// its header, a few KiB in, and cut from there every piece took GETs across the
    /// server's block boundaries (GPU run 215: a 4 GiB range from byte 4,104 loaded 3-8%
    /// slower than with this, which matches the range from byte 0).
    fn origin(&self) -> Option<u64> {
        Some(self.spans.origin())
    }
}

impl Loader {
    /// Loads all of `object` into new GPU memory.
    ///
    /// # Errors
    /// [`Loader::load_object_range`]'s.
    pub fn load_object(&self, object: &Object) -> Result<(DeviceBuffer, LoadReport)> {
        self.load_object_range(object, 0..object.len())
    }

    /// Loads bytes `range` of `object` into new GPU memory: the fill threads read it by
    /// ranged GETs of the version pinned when the object was opened into the pinned staging
    /// buffers, which are uploaded as they fill. Host memory is the loader's staging,
    /// whatever the object's size; device memory is the result. A loader made with
    /// [`LoadOptions::for_objects`] keeps twice the bytes in flight of one with the file
    /// settings (two 8 MiB GETs per fill thread against one 4 MiB GET): 0.98 of the host read
    /// on the H200 machine against 0.81.
    ///
    /// # Errors
    /// [`Error::Object`] (not found, access denied, the object replaced since it was opened,
    /// a request that failed after its retries, a range past the end); CUDA errors.
    ///
    /// # Example
    /// ```no_run
    /// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::for_objects())?;
    /// let object = gpufeed_load::object::Object::open("s3://models/shard-000.bin", &Default::default())?;
    /// let (buf, report) = loader.load_object(&object)?;
    /// println!("{} bytes at {:.1} GB/s ({})", buf.len(), report.gbps(), report.reason);
    /// # Ok::<(), gpufeed_load::Error>(())
    /// ```
    pub fn load_object_range(
        &self,
        object: &Object,
        range: Range<u64>,
    ) -> Result<(DeviceBuffer, LoadReport)> {
        self.load_object_spans(object, std::slice::from_ref(&range))
    }

    /// Loads byte ranges `spans` of `object`, back to back in that order, into new GPU
    /// memory, as [`Loader::load_object_range`] reads one range (a tensor-parallel share of
    /// each tensor of a checkpoint in a bucket, say): each span by ranged GETs of its own
    /// bytes only. Spans may be empty, repeat or overlap; many small spans cost a GET each.
    ///
    /// # Errors
    /// [`Loader::load_object_range`]'s, for any span past the end of the object.
    ///
    /// # Example
    /// ```no_run
    /// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::for_objects())?;
    /// let object = gpufeed_load::object::Object::open("s3://data/blob.bin", &Default::default())?;
    /// // The first and the third MiB of the object, 2 MiB on the GPU.
    /// let (buf, _) = loader.load_object_spans(&object, &[0..1 << 20, 2 << 20..3 << 20])?;
    /// assert_eq!(buf.len(), 2 << 20);
    /// # Ok::<(), gpufeed_load::Error>(())
    /// ```
    pub fn load_object_spans(
        &self,
        object: &Object,
        spans: &[Range<u64>],
    ) -> Result<(DeviceBuffer, LoadReport)> {
        let started = Instant::now();
        let len = spans_len(object, spans)?;
        let (buf, report) = self.gpu.alloc_filled(len, self.device_alloc(len), |dst| {
            self.fill_from_object(object, spans, dst, started)
        })?;
        Ok((buf, report))
    }

    /// Loads bytes `range` of `object` into `dst` from `dst_offset` on (as
    /// [`Loader::load_object_range`] reads them): a large object in pieces, say, to report
    /// progress.
    ///
    /// # Errors
    /// [`Loader::load_object_range`]'s, and a destination too small.
    pub fn load_object_into(
        &self,
        object: &Object,
        range: Range<u64>,
        dst: &mut DeviceBuffer,
        dst_offset: usize,
    ) -> Result<LoadReport> {
        let started = Instant::now();
        let len = check_range(object, &range)?;
        let at = if len == 0 { 0 } else { dst_offset };
        crate::route::fits(len as u64, at, dst.len())?;
        let mut view = dst.slice_mut(at..at + len);
        self.fill_from_object(object, std::slice::from_ref(&range), &mut view, started)
    }

    /// [`Loader::load_object_spans`] into `dst`, a device buffer or view exactly as long as
    /// the spans together (checked): an object's ranges into memory the caller placed (a
    /// chunk of a prefetch, say).
    ///
    /// # Errors
    /// [`Loader::load_object_spans`]'s, and [`gpufeed_cuda::Error::OutOfBounds`] where `dst`
    /// is not as long as the spans.
    pub fn load_object_spans_to<D>(
        &self,
        object: &Object,
        spans: &[Range<u64>],
        dst: &mut D,
    ) -> Result<LoadReport>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let started = Instant::now();
        crate::route::exactly(spans_len(object, spans)? as u64, dst.len())?;
        self.fill_from_object(object, spans, dst, started)
    }

    /// `spans` of `object` (checked) into `dst`, exactly as long as they are together.
    fn fill_from_object<D>(
        &self,
        object: &Object,
        spans: &[Range<u64>],
        dst: &mut D,
        started: Instant,
    ) -> Result<LoadReport>
    where
        D: DevicePtrMut<u8> + DeviceSlice<u8>,
    {
        let filling = started.elapsed();
        let spans = Spans::new(spans);
        let len = spans.len();
        let opts = object.options();
        // Each fill fills one staging piece (at most the chunk size) with one read: the GETs
        // in flight per fill thread are that piece's parts.
        let chunk = self.sched.config().chunk_bytes;
        let per_fill = chunk
            .div_ceil(opts.request_bytes)
            .min(opts.requests_in_flight);
        let mut report = LoadReport {
            path: object.url().as_str().into(),
            strategy: Strategy::Staged,
            reason: format!(
                "an object: ranged GETs of up to {} KiB into pinned staging, up to {per_fill} in \
                 flight per fill thread (its staging piece of up to {} KiB)",
                opts.request_bytes >> 10,
                chunk >> 10
            ),
            bytes: len,
            seconds: 0.0,
            residency_before: None,
            fallbacks: Vec::new(),
            copy_waited_s: 0.0,
            source_waited_s: 0.0,
            io_backend: Some("object store (HTTP ranged GETs)".into()),
            gds_refused: None,
            gds_registered_bytes: 0,
        };
        if len > 0 {
            let source = ObjectSource { object, spans };
            let stats = self
                .sched
                .upload(
                    HostSource::Fill {
                        source: &source,
                        len,
                    },
                    dst,
                    0,
                )
                .map_err(read_error)?;
            report.copy_waited_s = stats.copy_waited_s;
            report.source_waited_s = stats.source_waited_s;
        }
        for f in self.sched.fallbacks() {
            f.push_once(&mut report.fallbacks);
        }
        report.seconds = started.elapsed().as_secs_f64();
        tracing::debug!(
            url = %object.url(),
            bytes = len,
            before_fill_ms = filling.as_secs_f64() * 1e3,
            ms = report.seconds * 1e3,
            copy_waited_ms = report.copy_waited_s * 1e3,
            source_waited_ms = report.source_waited_s * 1e3,
            "object loaded"
        );
        Ok(report)
    }
}

/// The bytes of `spans` together, each checked against the object's size.
fn spans_len(object: &Object, spans: &[Range<u64>]) -> Result<usize> {
    spans.iter().try_fold(0usize, |len, range| {
        len.checked_add(check_range(object, range)?)
            .ok_or_else(|| Error::InvalidSetting("the spans do not fit in memory".into()))
    })
}

/// The length of `range`, checked against the object's size.
fn check_range(object: &Object, range: &Range<u64>) -> Result<usize> {
    if range.start > range.end || range.end > object.len() {
        return Err(gpufeed_object::Error::OutOfRange {
            url: object.url().to_string(),
            start: range.start,
            end: range.end,
            len: object.len(),
        }
        .into());
    }
    let len = range.end - range.start;
    usize::try_from(len)
        .map_err(|_| Error::InvalidSetting(format!("{len} bytes do not fit in memory")))
}

/// Loads the object at `url` (`s3://bucket/key`, `https://host/path`) into new GPU memory of
/// `gpu`, with a loader made for it ([`Loader::load_object`]); pass
/// [`LoadOptions::for_objects`] unless you have measured better settings.
///
/// # Errors
/// [`Loader::load_object_range`]'s, and the object's open errors.
pub fn load_object(
    gpu: &crate::Gpu,
    url: &str,
    object: &ObjectOptions,
    opts: LoadOptions,
) -> Result<(DeviceBuffer, LoadReport)> {
    let object = Object::open(url, object)?;
    let loader = Loader::for_bytes(gpu, opts, object.len())?;
    loader.load_object(&object)
}

pub use crate::object_cache::{CachedObject, ObjectCache};
pub use gpufeed_object::{
    Credentials, Error as ObjectError, Object, ObjectOptions, ObjectUrl, ReadStats, Scheme, list,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// An object's error raised in a fill thread reaches the caller as itself.
    #[test]
    fn an_objects_error_in_a_fill_is_the_loads_error() {
        let e = gpufeed_cuda::Error::Source {
            offset: 5,
            source: Box::new(ObjectError::ObjectChanged {
                url: "s3://b/k".into(),
                what: "ETag".into(),
            }),
        };
        assert!(matches!(
            read_error(e),
            Error::Object(ObjectError::ObjectChanged { .. })
        ));
    }
}
