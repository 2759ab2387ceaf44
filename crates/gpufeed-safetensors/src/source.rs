//! [`PrefetchSource`]: what the prefetch engine and tensor-parallel plans read, a file opened
//! once or (feature `object`) an object pinned at its version.

use std::ops::Range;
#[cfg(feature = "object")]
use std::sync::Arc;

use gpufeed_load::{DeviceBuffer, Loader};
use gpufeed_os::OpenedFile;

/// What a [`Prefetch`](crate::Prefetch) (and a [`TensorParallel`](crate::TensorParallel) plan) reads: a file
/// opened once (the descriptor its header was read on), or, with the `object` feature, an
/// object at the version (ETag) it was opened at.
#[non_exhaustive]
pub enum PrefetchSource {
    /// A file: chunks load by the route the loader chooses once for all of them.
    File(OpenedFile),
    /// An object: chunks load by ranged GETs of their spans.
    #[cfg(feature = "object")]
    Object(Arc<gpufeed_load::object::Object>),
}

impl From<OpenedFile> for PrefetchSource {
    fn from(file: OpenedFile) -> Self {
        PrefetchSource::File(file)
    }
}

#[cfg(feature = "object")]
impl From<Arc<gpufeed_load::object::Object>> for PrefetchSource {
    fn from(object: Arc<gpufeed_load::object::Object>) -> Self {
        PrefetchSource::Object(object)
    }
}

impl std::fmt::Debug for PrefetchSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrefetchSource({})", self.path().display())
    }
}

impl PrefetchSource {
    /// Bytes `spans` into new GPU memory of `loader`, back to back.
    pub(crate) fn load_spans(
        &self,
        loader: &Loader,
        spans: &[Range<u64>],
    ) -> gpufeed_load::Result<(DeviceBuffer, gpufeed_load::LoadReport)> {
        match self {
            PrefetchSource::File(file) => loader.load_spans_of(file, spans),
            #[cfg(feature = "object")]
            PrefetchSource::Object(object) => loader.load_object_spans(object, spans),
        }
    }

    pub(crate) fn len(&self) -> u64 {
        match self {
            PrefetchSource::File(f) => f.len(),
            #[cfg(feature = "object")]
            PrefetchSource::Object(o) => o.len(),
        }
    }

    pub(crate) fn path(&self) -> std::path::PathBuf {
        match self {
            PrefetchSource::File(f) => f.path().to_path_buf(),
            #[cfg(feature = "object")]
            PrefetchSource::Object(o) => o.url().as_str().into(),
        }
    }
}

/// `spans` in order, each merged into the one before where that ends where it starts: the
/// reads of a load that takes them back to back.
pub(crate) fn merge_adjacent(spans: impl IntoIterator<Item = Range<u64>>) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::new();
    for s in spans {
        match out.last_mut() {
            Some(last) if last.end == s.start => last.end = s.end,
            _ => out.push(s),
        }
    }
    out
}
