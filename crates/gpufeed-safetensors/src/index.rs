//! Sharded checkpoints: the index (`*.safetensors.index.json`), the plan of a load (every
//! file's header read and checked before a byte moves), and the check that all shards are of
//! one save ([`Error::MixedCheckpoint`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpufeed_load::Loader;

use crate::checkpoint::{Checkpoint, FileLayout};
use crate::error::{Error, Result};
use crate::header::{Parsed, parse};

/// Whether `path` names a safetensors checkpoint by its name: `*.safetensors`, or an index
/// `*.safetensors.index.json`.
pub fn is_checkpoint_name(path: impl AsRef<Path>) -> bool {
    let name = path.as_ref().to_string_lossy();
    name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json")
}

/// The files of a checkpoint with their parsed headers, before any byte moves.
pub(crate) struct Plan {
    pub(crate) files: Vec<(PathBuf, Parsed)>,
}

impl Plan {
    /// The largest data section: the most one load moves.
    pub(crate) fn largest(&self) -> u64 {
        self.files.iter().map(|f| f.1.data_len).max().unwrap_or(0)
    }
}

/// Reads and checks the headers of `path` (a file, or the shards of an index).
pub(crate) fn plan(path: &Path) -> Result<Plan> {
    let index = if path.to_string_lossy().ends_with(".json") {
        shards(path)?
    } else {
        Index {
            files: vec![(path.to_path_buf(), None)],
            save: None,
        }
    };
    let is_index = index.files.iter().any(|f| f.1.is_some());
    let mut planned = Vec::with_capacity(index.files.len());
    for (file, expected) in index.files {
        let parsed = parse(&file)?;
        if let Some(expected) = &expected {
            for name in expected {
                if !parsed.tensors.iter().any(|t| &t.name == name) {
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
        planned.push((file, parsed));
    }
    if is_index {
        let facts: Vec<_> = planned
            .iter()
            .map(|(f, p)| (f.clone(), p.save_id.clone(), p.file.len()))
            .collect();
        check_one_save(path, index.save.as_ref(), &facts)?;
        check_names_unique(
            path,
            planned
                .iter()
                .map(|(f, p)| (f.display().to_string(), &p.tensors[..])),
        )?;
    }
    Ok(Plan { files: planned })
}

/// Checks that no tensor name is in two shards of the index `index` (each shard given as its
/// name and its tensors): which of two copies the index means cannot be told by the name, so
/// neither is taken.
pub(crate) fn check_names_unique<'a>(
    index: &Path,
    shards: impl IntoIterator<Item = (String, &'a [crate::HeaderEntry])>,
) -> Result<()> {
    let shards: Vec<_> = shards.into_iter().collect();
    let mut seen = std::collections::HashMap::new();
    for (k, (shard, tensors)) in shards.iter().enumerate() {
        for t in tensors.iter() {
            if let Some(first) = seen.insert(t.name.as_str(), k) {
                return Err(Error::Index {
                    path: index.into(),
                    reason: format!(
                        "tensor {} is in two shards, {} and {shard}: remove one copy",
                        t.name, shards[first].0
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Checks that the shards of the index `index` are all of one save: of the save the index
/// records (its id in each shard's header, each shard's size as recorded), or, for an index
/// that records none (one not written by gpufeed), that the shards that carry a save id all
/// carry the same one.
/// Each file is `(path, the save id in its header, its size)`.
pub(crate) fn check_one_save(
    index: &Path,
    save: Option<&IndexSave>,
    files: &[(PathBuf, Option<String>, u64)],
) -> Result<()> {
    let (index_save, mut wrong) = match save {
        Some(save) => {
            let mut wrong = Vec::new();
            for (file, save_id, len) in files {
                let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
                let why = match (save_id, name.and_then(|n| save.sizes.get(&n).copied())) {
                    (Some(id), _) if *id != save.id => Some(format!("written by save {id}")),
                    (None, _) => Some("written by no recorded save".to_owned()),
                    (_, Some(size)) if size != *len => {
                        Some(format!("{len} bytes where the index records {size}"))
                    }
                    _ => None,
                };
                wrong.extend(why.map(|w| (file.clone(), w)));
            }
            (save.id.clone(), wrong)
        }
        None => {
            let mut ids = files
                .iter()
                .filter_map(|(f, id, _)| Some((f, id.as_ref()?)));
            let Some((_, first)) = ids.next() else {
                return Ok(());
            };
            let wrong: Vec<_> = files
                .iter()
                .filter_map(|(f, id, _)| {
                    let id = id.as_ref()?;
                    (id != first).then(|| (f.clone(), format!("written by save {id}")))
                })
                .collect();
            if wrong.is_empty() {
                return Ok(());
            }
            (format!("none recorded; {first} by the first shard"), wrong)
        }
    };
    if wrong.is_empty() {
        return Ok(());
    }
    wrong.sort();
    Err(Error::MixedCheckpoint {
        index: index.into(),
        index_save,
        files: wrong,
    })
}

/// Loads the data sections of a planned checkpoint, one bulk transfer per file. Where its
/// memory comes from is decided once for all the files (the loader's first load: every shard
/// from `cuMemAlloc`, not the first alone with the rest growing the context's pool at 2-3 ms
/// per GiB, and the pool's first allocation 7-10 ms; docs/benchmarks.md, GPU runs 8 and 136).
pub(crate) fn load_planned(loader: &Loader, path: &Path, plan: Plan) -> Result<Checkpoint> {
    let total: u64 = plan.files.iter().map(|(_, p)| p.data_len).sum();
    let from = loader.device_alloc(total as usize);
    let (mut layouts, mut buffers, mut reports) = (Vec::new(), Vec::new(), Vec::new());
    for (file, parsed) in plan.files {
        // Through the descriptor whose header was read: the data comes from that version of the
        // file (the loader checks on it after the copies that it was not written meanwhile).
        let span = parsed.data_start..parsed.data_start + parsed.data_len;
        let (buffer, report) =
            loader
                .gpu()
                .alloc_filled(parsed.data_len as usize, from, |dst| {
                    loader.load_spans_to(&parsed.file, std::slice::from_ref(&span), dst, None)
                })?;
        layouts.push(FileLayout {
            path: file,
            data_start: parsed.data_start,
            data_bytes: parsed.data_len,
            tensors: parsed.tensors,
            metadata: parsed.metadata,
        });
        buffers.push(buffer);
        reports.push(report);
    }
    let mut ckpt = Checkpoint::from_layouts(path, loader.gpu().clone(), &layouts, buffers)?;
    ckpt.reports = reports;
    Ok(ckpt)
}

/// The metadata key, in each shard's header and in the index, of the save that wrote a sharded
/// checkpoint ([`save_sharded`](crate::save_sharded)): a random id per save.
pub const SAVE_ID_KEY: &str = "gpufeed_save_id";

/// The index metadata key of the shard files' sizes (`{"file": bytes}`), written by
/// [`save_sharded`](crate::save_sharded).
pub const FILE_SIZES_KEY: &str = "gpufeed_file_sizes";

/// What an index says of its shards.
pub(crate) struct Index {
    /// Each shard file, with the tensors the index maps to it.
    pub(crate) files: Vec<(PathBuf, Option<Vec<String>>)>,
    /// The save that wrote the shards, where the index records one.
    pub(crate) save: Option<IndexSave>,
}

/// The save an index records ([`SAVE_ID_KEY`], [`FILE_SIZES_KEY`]).
pub(crate) struct IndexSave {
    pub(crate) id: String,
    pub(crate) sizes: BTreeMap<String, u64>,
}

/// The shard files of an index (`{"weight_map": {"tensor": "file", ...}}`), each with the
/// tensors the index maps to it, and the save it records.
pub(crate) fn shards(index: &Path) -> Result<Index> {
    let bad = |reason: String| Error::Index {
        path: index.into(),
        reason,
    };
    // Missing, a directory, a FIFO, unreadable: the one helper's clear errors.
    let (mut file, _) = gpufeed_os::file::open_regular(index, false)?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut file, &mut text)
        .map_err(|e| bad(format!("cannot be read as text: {e}")))?;
    shards_of(&text, index)
}

/// [`shards`] of an index's text (untrusted: property-tested).
pub(crate) fn shards_of(text: &str, index: &Path) -> Result<Index> {
    let bad = |reason: String| Error::Index {
        path: index.into(),
        reason,
    };
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
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
        // One plain file name: no directories, no "." or "..", nothing empty.
        let mut parts = Path::new(file).components();
        let plain = matches!(
            (parts.next(), parts.next()),
            (Some(std::path::Component::Normal(n)), None) if n == file
        );
        if !plain {
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
    let metadata = json.get("metadata");
    let save = match metadata.and_then(|m| m.get(SAVE_ID_KEY)) {
        None => None,
        Some(id) => {
            let id = id
                .as_str()
                .ok_or_else(|| bad(format!("metadata.{SAVE_ID_KEY} is not a string")))?;
            let mut sizes = BTreeMap::new();
            if let Some(recorded) = metadata.and_then(|m| m.get(FILE_SIZES_KEY)) {
                let recorded = recorded
                    .as_object()
                    .ok_or_else(|| bad(format!("metadata.{FILE_SIZES_KEY} is not an object")))?;
                for (file, size) in recorded {
                    let size = size.as_u64().ok_or_else(|| {
                        bad(format!(
                            "metadata.{FILE_SIZES_KEY}.{file} is not a byte count"
                        ))
                    })?;
                    sizes.insert(file.clone(), size);
                }
            }
            Some(IndexSave {
                id: id.to_owned(),
                sizes,
            })
        }
    };
    Ok(Index {
        files: by_file
            .into_iter()
            .map(|(f, names)| (dir.join(f), Some(names)))
            .collect(),
        save,
    })
}
