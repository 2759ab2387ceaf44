//! Tensors on demand: [`OnDemand`] registers each file of a checkpoint once and loads one
//! tensor at a time, one copy by the GPU out of the page cache.

use std::collections::BTreeMap;
use std::path::Path;

use gpufeed_load::{DeviceBuffer, Loader, RegisteredFile};

use crate::checkpoint::TensorInfo;
use crate::error::{Error, Result};
use crate::header::HeaderEntry;
use crate::index::plan;

/// A checkpoint whose tensors are loaded one at a time, when asked, as safetensors'
/// `safe_open(...).get_tensor(name)` does: every file registered once ([`RegisteredFile`]),
/// each tensor then one copy by the GPU out of the page cache into memory of its own — for
/// weights streamed in on demand (experts of a mixture of experts, layers offloaded between
/// uses). Opening reads and checks every header as [`load`](crate::load) does and registers the files
/// (about 40 ms per GiB on the H200 machine, reading what is not cached); the files' pages
/// stay page-locked until the value is dropped.
///
/// # Example
/// ```no_run
/// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::default())?;
/// let ckpt = gpufeed_safetensors::OnDemand::open(&loader, "model.safetensors.index.json")?;
/// let (bytes, info) = ckpt.load(&loader, "model.layers.0.mlp.experts.3.w1.weight")?;
/// println!("{:?} {:?}: {} bytes on the GPU", info.dtype, info.shape, bytes.len());
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
#[derive(Debug)]
pub struct OnDemand {
    files: Vec<RegisteredFile>,
    /// Per tensor: dtype, shape, the file, and the byte range in that file.
    tensors: BTreeMap<String, TensorInfo>,
}

impl OnDemand {
    /// Reads and checks the headers of `path` (a file, or the shards of an index) and registers
    /// each file with `loader`'s context (portable: any loader may load from it after).
    ///
    /// # Errors
    /// [`load`](crate::load)'s header and index errors, before anything is registered; then
    /// [`RegisteredFile::open`]'s; [`Error::FileChangedDuringLoad`](gpufeed_load::Error::FileChangedDuringLoad) where a file changed
    /// between its header and its registration.
    pub fn open(loader: &Loader, path: impl AsRef<Path>) -> Result<Self> {
        let plan = plan(path.as_ref())?;
        let mut files = Vec::with_capacity(plan.files.len());
        let mut tensors = BTreeMap::new();
        for (i, (_, parsed)) in plan.files.into_iter().enumerate() {
            // Registered through the descriptor whose header was read.
            let file = RegisteredFile::of_opened(loader, &parsed.file)?;
            for HeaderEntry {
                name,
                dtype,
                shape,
                range,
            } in parsed.tensors.iter()
            {
                let start = parsed.data_start as usize;
                let info = TensorInfo {
                    dtype: *dtype,
                    shape: shape.clone(),
                    file: i,
                    range: start + range.start..start + range.end,
                };
                tensors.insert(name.clone(), info);
            }
            files.push(file);
        }
        Ok(OnDemand { files, tensors })
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Facts of the tensor `name`; its `range` is the tensor's bytes in its file.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// How many tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether it holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The files, in the order [`TensorInfo::file`] counts them.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(RegisteredFile::path)
    }

    /// The tensor `name` in new GPU memory of its own, loaded by `loader` (of any GPU), with
    /// its facts.
    ///
    /// # Errors
    /// [`Error::NoTensor`] for a name the checkpoint lacks;
    /// [`Loader::load_registered`]'s ([`Error::RegisteredFileChanged`](gpufeed_load::Error::RegisteredFileChanged) where the file
    /// changed since it was opened).
    pub fn load(&self, loader: &Loader, name: &str) -> Result<(DeviceBuffer, &TensorInfo)> {
        let info = self.tensors.get(name).ok_or_else(|| Error::NoTensor {
            path: self
                .files
                .first()
                .map(|f| f.path().into())
                .unwrap_or_default(),
            name: name.to_owned(),
        })?;
        let range = info.range.start as u64..info.range.end as u64;
        let (buf, _) = loader.load_registered(&self.files[info.file], range)?;
        Ok((buf, info))
    }
}
