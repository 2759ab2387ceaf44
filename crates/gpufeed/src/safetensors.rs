//! safetensors checkpoints to GPU memory: one bulk transfer per file, a named view per tensor.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use gpufeed_cuda::cudarc::driver::CudaView;
use gpufeed_os::{FileMap, MapMode};
use safetensors::SafeTensors;

pub use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::load::{DeviceBuffer, LoadOptions, LoadReport, Loader};

/// Where one tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// Which file of the checkpoint (index into [`Checkpoint::files`]).
    pub file: usize,
    /// Byte range in that file's device buffer.
    pub range: Range<usize>,
}

/// A checkpoint in GPU memory: one device buffer per file, a view per tensor.
#[derive(Debug)]
pub struct Checkpoint {
    files: Vec<PathBuf>,
    buffers: Vec<DeviceBuffer>,
    tensors: BTreeMap<String, TensorInfo>,
    reports: Vec<LoadReport>,
}

impl Checkpoint {
    /// The tensor `name`: its facts and a view of its bytes on the GPU.
    pub fn get(&self, name: &str) -> Option<(&TensorInfo, CudaView<'_, u8>)> {
        let info = self.tensors.get(name)?;
        let view = self.buffers[info.file].slice(info.range.clone());
        Some((info, view))
    }

    /// Facts of the tensor `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The files loaded, in order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The device buffer holding file `i`'s data section.
    pub fn buffer(&self, i: usize) -> Option<&DeviceBuffer> {
        self.buffers.get(i)
    }

    /// One load report per file.
    pub fn reports(&self) -> &[LoadReport] {
        &self.reports
    }

    /// Bytes on the GPU.
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().map(|b| b.len() as u64).sum()
    }
}

/// The tensors of one safetensors file and where its data section starts.
struct Parsed {
    data_start: u64,
    data_len: u64,
    tensors: Vec<HeaderEntry>,
}

/// Parses the header of `path` with the `safetensors` crate (which checks offsets, sizes and
/// overlaps against the file's length), touching only the header's pages.
fn parse(path: &Path) -> Result<Parsed> {
    let len = std::fs::metadata(path)
        .map_err(|_| gpufeed_os::Error::NotFound { path: path.into() })?
        .len();
    if len < 8 {
        return Err(Error::Safetensors {
            path: path.into(),
            reason: format!("{len} bytes: shorter than the 8-byte header length"),
        });
    }
    // SAFETY: only the header's pages are read (read_metadata uses the buffer's length for
    // its checks, not its data); a file truncated below its header meanwhile is the caller's
    // promise on `load`.
    let map = unsafe { FileMap::open(path, MapMode::ReadOnly)? };
    let (data_start, tensors) = header(&map).map_err(|reason| Error::Safetensors {
        path: path.into(),
        reason,
    })?;
    Ok(Parsed {
        data_start,
        data_len: len - data_start,
        tensors,
    })
}

/// One tensor of a safetensors header: name, dtype, shape, byte range in the data section.
pub type HeaderEntry = (String, Dtype, Vec<usize>, Range<usize>);

/// Validates the header of a whole safetensors file held in `bytes` (the `safetensors` crate
/// checks the header length, the JSON, dtypes, shapes against sizes, and that the tensors tile
/// the data section exactly): returns where the data section starts and the tensors, sorted by
/// name, or why the bytes are not a valid file. Never panics, whatever the bytes (fuzzed:
/// crates/gpufeed/fuzz).
pub fn header(bytes: &[u8]) -> std::result::Result<(u64, Vec<HeaderEntry>), String> {
    let (header_len, metadata) = SafeTensors::read_metadata(bytes).map_err(|e| format!("{e:?}"))?;
    let mut tensors: Vec<HeaderEntry> = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let (a, b) = info.data_offsets;
            (name, info.dtype, info.shape.clone(), a..b)
        })
        .collect();
    tensors.sort_by(|x, y| x.0.cmp(&y.0));
    Ok((8 + header_len as u64, tensors))
}

/// Loads a safetensors file, or a sharded checkpoint given by its `*.index.json`, into GPU
/// memory: the header is parsed with the `safetensors` crate, each file's data section moves in
/// one bulk transfer (`load_file`'s machinery), and every tensor is a view into its file's
/// device buffer.
///
/// # Errors
/// [`Error::Safetensors`] for a malformed or hostile header (with the crate's reason),
/// [`Error::Index`] for a bad index, and the errors of [`crate::load_file`].
///
/// # Example
/// ```no_run
/// let gpu = gpufeed::Gpu::open(0)?;
/// let ckpt = gpufeed::safetensors::load(&gpu, "model.safetensors")?;
/// let (info, view) = ckpt.get("lm_head.weight").expect("tensor");
/// println!("{:?} {:?}: {} bytes on the GPU", info.dtype, info.shape, view.len());
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn load(gpu: &gpufeed_cuda::Gpu, path: impl AsRef<Path>) -> Result<Checkpoint> {
    load_with(&Loader::new(gpu, LoadOptions::default())?, path)
}

/// Like [`load`], with a [`Loader`] of your own (options, reuse of staging buffers).
pub fn load_with(loader: &Loader, path: impl AsRef<Path>) -> Result<Checkpoint> {
    let path = path.as_ref();
    let files = if path.to_string_lossy().ends_with(".json") {
        shards(path)?
    } else {
        vec![(path.to_path_buf(), None)]
    };
    let mut ckpt = Checkpoint {
        files: Vec::new(),
        buffers: Vec::new(),
        tensors: BTreeMap::new(),
        reports: Vec::new(),
    };
    for (i, (file, expected)) in files.into_iter().enumerate() {
        let parsed = parse(&file)?;
        if let Some(expected) = expected {
            for name in &expected {
                if !parsed.tensors.iter().any(|t| &t.0 == name) {
                    return Err(Error::Index {
                        path: path.into(),
                        reason: format!(
                            "{name} is mapped to {} but that file does not hold it",
                            file.display()
                        ),
                    });
                }
            }
        }
        let (buffer, report) = loader.load_range(
            &file,
            parsed.data_start..parsed.data_start + parsed.data_len,
        )?;
        for (name, dtype, shape, range) in parsed.tensors {
            if ckpt.tensors.contains_key(&name) {
                return Err(Error::Index {
                    path: path.into(),
                    reason: format!("tensor {name} appears in two files"),
                });
            }
            ckpt.tensors.insert(
                name,
                TensorInfo {
                    dtype,
                    shape,
                    file: i,
                    range,
                },
            );
        }
        ckpt.files.push(file);
        ckpt.buffers.push(buffer);
        ckpt.reports.push(report);
    }
    Ok(ckpt)
}

/// The shard files of an index (`{"weight_map": {"tensor": "file", ...}}`), each with the
/// tensors the index maps to it.
fn shards(index: &Path) -> Result<Vec<(PathBuf, Option<Vec<String>>)>> {
    let bad = |reason: String| Error::Index {
        path: index.into(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            Error::Os(gpufeed_os::Error::NotFound { path: index.into() })
        }
        _ => bad(e.to_string()),
    })?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("{tensor}: file name is not a string")))?;
        if file.contains('/') || file == ".." || file.is_empty() {
            return Err(bad(format!(
                "{tensor}: shard name {file:?} leaves the checkpoint's directory"
            )));
        }
        by_file
            .entry(file.to_owned())
            .or_default()
            .push(tensor.clone());
    }
    if by_file.is_empty() {
        return Err(bad("the weight map is empty".into()));
    }
    Ok(by_file
        .into_iter()
        .map(|(f, names)| (dir.join(f), Some(names)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_headers_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cases: [(&str, Vec<u8>); 5] = [
            ("short", vec![1, 2, 3]),
            ("huge length", u64::MAX.to_le_bytes().to_vec()),
            (
                "past the end",
                [100u64.to_le_bytes().to_vec(), b"{}".to_vec()].concat(),
            ),
            (
                "not json",
                [4u64.to_le_bytes().to_vec(), b"{{{{".to_vec()].concat(),
            ),
            ("offsets outside", {
                let h = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,1000]}}"#;
                [
                    (h.len() as u64).to_le_bytes().to_vec(),
                    h.to_vec(),
                    vec![0u8; 16],
                ]
                .concat()
            }),
        ];
        for (what, bytes) in cases {
            let p = dir.path().join(format!("{what}.safetensors"));
            std::fs::write(&p, &bytes).expect("write");
            let err = parse(&p)
                .err()
                .unwrap_or_else(|| panic!("{what}: accepted"));
            assert!(matches!(err, Error::Safetensors { .. }), "{what}: {err:?}");
        }
    }

    #[test]
    fn headers_written_by_the_crate_parse() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("ok.safetensors");
        let a = vec![1u8; 12];
        let b = vec![2u8; 6];
        let views = [
            (
                "a",
                safetensors::tensor::TensorView::new(Dtype::F32, vec![3], &a).expect("view"),
            ),
            (
                "b",
                safetensors::tensor::TensorView::new(Dtype::I16, vec![3], &b).expect("view"),
            ),
        ];
        safetensors::serialize_to_file(views, None, &p).expect("serialize");
        let parsed = parse(&p).expect("parse");
        assert_eq!(parsed.tensors.len(), 2);
        assert_eq!(parsed.data_len, 18);
        assert_eq!(parsed.tensors[1].0, "b");
        assert_eq!(parsed.tensors[1].2, vec![3]);
    }

    #[test]
    fn bad_indexes() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (what, text) in [
            ("not json", "{"),
            ("no map", "{}"),
            ("escape", r#"{"weight_map":{"a":"../x.safetensors"}}"#),
            ("empty", r#"{"weight_map":{}}"#),
            ("number", r#"{"weight_map":{"a":3}}"#),
        ] {
            let p = dir.path().join("model.safetensors.index.json");
            std::fs::write(&p, text).expect("write");
            assert!(matches!(shards(&p), Err(Error::Index { .. })), "{what}");
        }
    }
}
