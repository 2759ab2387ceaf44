//! Checkpoints in object storage (the `object` feature): a safetensors object, or an index
//! object and its shards beside it, read header first by ranged GETs, then each data section
//! into GPU memory by the loader's object loads.

use std::path::Path;
use std::sync::Arc;

use gpufeed_load::Loader;
use gpufeed_load::object::{Object, ObjectOptions};

use crate::checkpoint::{Checkpoint, FileLayout};
use crate::error::{Error, Result};
use crate::header::{HeaderError, MAX_HEADER_BYTES, header_parts};
use crate::index::{SAVE_ID_KEY, check_one_save, shards_of};
use crate::source::PrefetchSource;
use crate::tensor_parallel::{Split, TensorParallel, check_ranks, shares_of};

/// The first read of a header: most headers fit (4,096 tensors take about 400 KB), so one GET
/// serves them; a larger one is read to its end by a second.
const FIRST_READ: u64 = 1 << 20;

/// The largest index object read (an index of 100,000 tensors is about 10 MB).
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// One object of a checkpoint, opened, with its header read and checked.
struct Planned {
    object: Object,
    layout: FileLayout,
    save_id: Option<String>,
}

/// Reads and checks the headers of the checkpoint at `url` (a `.safetensors` object, or a
/// `.safetensors.index.json` object whose shards lie beside it in the same bucket and
/// prefix), as [`load_object`] does before a byte of tensor data moves; no GPU needed.
///
/// # Errors
/// The objects' errors ([`gpufeed_load::Error::Object`] inside [`Error::Load`]: not found,
/// access denied...), [`Error::Safetensors`] for a bad header, [`Error::Index`] for a bad
/// index, [`Error::MixedCheckpoint`] for shards of different saves.
///
/// # Example
/// ```no_run
/// let opts = gpufeed_load::object::ObjectOptions::default();
/// for file in gpufeed_safetensors::inspect_object("s3://models/llama/model.safetensors.index.json", &opts)? {
///     println!("{}: {} tensors", file.path.display(), file.tensors.len());
/// }
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
pub fn inspect_object(url: &str, opts: &ObjectOptions) -> Result<Vec<FileLayout>> {
    Ok(plan(url, opts)?.into_iter().map(|p| p.layout).collect())
}

/// [`inspect_object`], with each object as it was opened to read its header: a caller that
/// reads the data sections itself (the Python drop-in's `safe_open` of a URL) reads them at
/// the version (ETag) each header came from.
///
/// # Errors
/// As for [`inspect_object`].
pub fn inspect_object_opened(url: &str, opts: &ObjectOptions) -> Result<Vec<(FileLayout, Object)>> {
    Ok(plan(url, opts)?
        .into_iter()
        .map(|p| (p.layout, p.object))
        .collect())
}

/// Loads the safetensors checkpoint at `url` into GPU memory: each object's header by one
/// ranged GET (two for a header over 1 MiB), then its data section by
/// [`Loader::load_object_range`] (ranged GETs into the pinned staging, uploaded as they
/// fill), every tensor a view into its object's device buffer, as [`crate::load`] gives for
/// files. Each object is read at the version (ETag) its header came from: one replaced
/// meanwhile is an error, not a mix.
///
/// # Errors
/// [`inspect_object`]'s, then the loads' ([`gpufeed_load::Error::Object`], CUDA errors).
///
/// # Example
/// ```no_run
/// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::for_objects())?;
/// let opts = gpufeed_load::object::ObjectOptions::default();
/// let ckpt = gpufeed_safetensors::load_object(&loader, "s3://models/model.safetensors", &opts)?;
/// println!("{} tensors, {} bytes on the GPU", ckpt.len(), ckpt.bytes());
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
pub fn load_object(loader: &Loader, url: &str, opts: &ObjectOptions) -> Result<Checkpoint> {
    let opened = plan(url, opts)?
        .into_iter()
        .map(|p| (p.layout, p.object))
        .collect();
    load_objects_opened(loader, url, opened)
}

/// [`load_object`] of the checkpoint at `url` whose objects [`inspect_object_opened`] already
/// opened and whose headers it read: no header is read again, each data section at the
/// version (ETag) its header came from. A caller that checks a checkpoint before it opens a
/// GPU (the Python package's first load of a URL) reads the headers while the GPU opens.
///
/// # Errors
/// The loads' ([`gpufeed_load::Error::Object`], CUDA errors).
///
/// # Example
/// ```no_run
/// let opts = gpufeed_load::object::ObjectOptions::default();
/// let url = "s3://models/model.safetensors";
/// let opened = gpufeed_safetensors::inspect_object_opened(url, &opts)?;
/// let loader = gpufeed_load::Loader::open(0, gpufeed_load::LoadOptions::for_objects())?;
/// let ckpt = gpufeed_safetensors::load_objects_opened(&loader, url, opened)?;
/// # Ok::<(), gpufeed_safetensors::Error>(())
/// ```
pub fn load_objects_opened(
    loader: &Loader,
    url: &str,
    opened: Vec<(FileLayout, Object)>,
) -> Result<Checkpoint> {
    let (mut layouts, mut buffers, mut reports) = (Vec::new(), Vec::new(), Vec::new());
    for (layout, object) in opened {
        let range = layout.data_start..layout.data_start + layout.data_bytes;
        let (buffer, report) = loader.load_object_range(&object, range)?;
        layouts.push(layout);
        buffers.push(buffer);
        reports.push(report);
    }
    let mut ckpt =
        Checkpoint::from_layouts(Path::new(url), loader.gpu().clone(), &layouts, buffers)?;
    ckpt.reports = reports;
    Ok(ckpt)
}

impl TensorParallel {
    /// Plans the checkpoint at `url` (a `.safetensors` object, or a `.safetensors.index.json`
    /// object with its shards beside it, as [`load_object`]) for `ranks` GPUs, each object's
    /// header read by ranged GETs: [`load_shard`](crate::load_shard) of a rank then reads
    /// only that rank's bytes of each object ([`Loader::load_object_spans`]: ranged GETs of
    /// its spans), at the version (ETag) its header came from. A row split reads one span
    /// per tensor; a column split one per row of each tensor, a GET each: slow for tensors
    /// of many short rows.
    ///
    /// # Errors
    /// [`inspect_object`]'s; [`TensorParallel::plan`]'s for the ranks and the cuts.
    ///
    /// # Example
    /// ```no_run
    /// use gpufeed_safetensors::{Split, TensorParallel, load_shard};
    /// let opts = gpufeed_load::object::ObjectOptions::default();
    /// let plan = TensorParallel::plan_object("s3://models/llama/model.safetensors.index.json", &opts, 2, Split::Rows)?;
    /// let loader = gpufeed_load::Loader::open(1, gpufeed_load::LoadOptions::for_objects())?;
    /// let shard = load_shard(&loader, &plan, 1)?;
    /// println!("rank 1: {} bytes of {} tensors", shard.bytes(), shard.len());
    /// # Ok::<(), gpufeed_safetensors::Error>(())
    /// ```
    pub fn plan_object(
        url: &str,
        opts: &ObjectOptions,
        ranks: usize,
        split: Split,
    ) -> Result<Self> {
        check_ranks(ranks)?;
        let mut files = Vec::new();
        let mut opened = Vec::new();
        let mut shares = vec![Vec::new(); ranks];
        for p in plan(url, opts)? {
            for (rank, list) in shares_of(&p.layout.tensors, p.layout.data_start, split, ranks)?
                .into_iter()
                .enumerate()
            {
                shares[rank].push(list);
            }
            files.push(p.layout.path);
            opened.push(Arc::new(PrefetchSource::Object(Arc::new(p.object))));
        }
        Ok(TensorParallel {
            split,
            files,
            opened,
            shares,
        })
    }
}

fn object_error(e: gpufeed_load::object::ObjectError) -> Error {
    Error::Load(gpufeed_load::Error::Object(e))
}

/// The objects of the checkpoint at `url`, opened, their headers read and checked.
fn plan(url: &str, opts: &ObjectOptions) -> Result<Vec<Planned>> {
    if !url.ends_with(".json") {
        return Ok(vec![open_file(url, opts)?]);
    }
    let index = Object::open(url, opts).map_err(object_error)?;
    if index.len() > MAX_INDEX_BYTES {
        return Err(Error::Index {
            path: url.into(),
            reason: format!(
                "{} bytes: larger than any index ({} MiB at most)",
                index.len(),
                MAX_INDEX_BYTES >> 20
            ),
        });
    }
    let text =
        String::from_utf8(index.read_all().map_err(object_error)?).map_err(|e| Error::Index {
            path: url.into(),
            reason: format!("not UTF-8 text: {e}"),
        })?;
    // Shard names are plain file names (checked), joined to the index's prefix.
    let shards = shards_of(&text, Path::new(url))?;
    let mut planned = Vec::with_capacity(shards.files.len());
    // The index's prefix, as given (up to its last `/`). An encoded `/` after it would put
    // the index in a folder its shards are not looked up in.
    let prefix = &url[..url.rfind('/').map_or(0, |i| i + 1)];
    if url[prefix.len()..].to_ascii_lowercase().contains("%2f") {
        return Err(Error::Index {
            path: url.into(),
            reason: "its name holds an encoded '/' (%2F): write the '/' itself, so that its \
                     shards are looked up beside it"
                .into(),
        });
    }
    for (file, expected) in shards.files {
        // A plain file name (checked by `shards_of`), which a URL must not decode into
        // another: `%`, `?` and `#` would (`..%2F` is `../`).
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.contains(['%', '?', '#', '\\'])
            || name.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(Error::Index {
                path: url.into(),
                reason: format!(
                    "shard name {name:?}: '%', '?', '#', '\\', white space and control \
                     characters are refused in an index in object storage (a URL would decode \
                     them into another name: an http(s) URL reads '\\' as '/')"
                ),
            });
        }
        let shard_url = format!("{prefix}{name}");
        let p = open_file(&shard_url, opts)?;
        for name in expected.iter().flatten() {
            if !p.layout.tensors.iter().any(|t| &t.name == name) {
                return Err(Error::Index {
                    path: url.into(),
                    reason: format!(
                        "{name} is mapped to {shard_url} but that object does not hold it"
                    ),
                });
            }
        }
        planned.push(p);
    }
    let facts: Vec<_> = planned
        .iter()
        .map(|p| (p.layout.path.clone(), p.save_id.clone(), p.object.len()))
        .collect();
    check_one_save(Path::new(url), shards.save.as_ref(), &facts)?;
    crate::index::check_names_unique(
        Path::new(url),
        planned
            .iter()
            .map(|p| (p.layout.path.display().to_string(), &p.layout.tensors[..])),
    )?;
    Ok(planned)
}

/// Opens one safetensors object and reads and checks its header.
fn open_file(url: &str, opts: &ObjectOptions) -> Result<Planned> {
    let started = std::time::Instant::now();
    let object = Object::open(url, opts).map_err(object_error)?;
    let len = object.len();
    let bad = |reason: HeaderError| Error::Safetensors {
        path: url.into(),
        reason,
    };
    let mut prefix = vec![0u8; len.min(FIRST_READ) as usize];
    object.read_exact_at(0, &mut prefix).map_err(object_error)?;
    let parts = match header_parts(&prefix, len) {
        Err(HeaderError::Incomplete { have, need }) if need <= 8 + MAX_HEADER_BYTES => {
            prefix.resize(need as usize, 0);
            object
                .read_exact_at(have, &mut prefix[have as usize..])
                .map_err(object_error)?;
            header_parts(&prefix, len)
        }
        other => other,
    };
    let (data_start, tensors, metadata) = parts.map_err(bad)?;
    tracing::debug!(
        url,
        tensors = tensors.len(),
        header_bytes = data_start,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "object's safetensors header read"
    );
    Ok(Planned {
        layout: FileLayout {
            path: url.into(),
            data_start,
            data_bytes: len - data_start,
            tensors: tensors.into(),
            metadata: metadata.clone(),
        },
        save_id: metadata.and_then(|m| m.get(SAVE_ID_KEY).cloned()),
        object,
    })
}
