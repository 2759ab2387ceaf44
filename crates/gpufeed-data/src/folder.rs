//! A data set of one file per sample in class folders: PyTorch `ImageFolder`'s layout
//! (`root/<class>/<...>/<file>`), labels from the class folders' names.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use gpufeed_uring::Reader;

use crate::error::{Error, Result};
use gpufeed_load::{FileList, Skipped};

/// The samples of a folder tree: each subfolder of the root is a class (label = its position
/// among the subfolders sorted by name), each file under it (at any depth, sorted by path) a
/// sample; files directly in the root are not samples. Listed once, in parallel; a sample's
/// bytes are the whole file, raw (decoding is the caller's transform or a GPU decoder).
///
/// Bad entries — a FIFO, a device, a broken symlink, a symlink loop, a folder that cannot be
/// read or is reached twice through symlinks — are an error naming them ([`ImageFolder::open`])
/// or left out and listed in [`ImageFolder::skipped`] ([`ImageFolder::open_skipping`]). Nothing
/// is opened while listing, so a FIFO cannot block.
///
/// # Example (runs without a GPU: host batches)
/// ```
/// use gpufeed_data::{BatchLoader, ImageFolder, BatchLoaderOptions, Order, Sampler};
/// # let dir = tempfile::tempdir()?;
/// # for (class, n) in [("cat", 3), ("dog", 2)] {
/// #     std::fs::create_dir(dir.path().join(class))?;
/// #     for i in 0..n { std::fs::write(dir.path().join(class).join(format!("{i}.jpg")), vec![i as u8; 10 + i])?; }
/// # }
/// let folder = ImageFolder::open(dir.path())?;
/// assert_eq!(folder.classes(), ["cat", "dog"]);
/// let cfg = BatchLoaderOptions::default().with_batch_size(4);
/// let mut loader = BatchLoader::new(folder, Sampler::new(Order::Shuffled { seed: 1 }), cfg, None)?;
/// for batch in loader.epoch(0)? {
///     let batch = batch?;
///     println!("{} samples, labels {:?}, {} bytes", batch.indices.len(), batch.labels, batch.bytes());
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    files: FileList,
    labels: Vec<u32>,
    skipped: Vec<Skipped>,
}

impl ImageFolder {
    /// Lists the samples under `root`.
    ///
    /// # Errors
    /// A root that is missing or not a folder, a folder with no class folder or no file, and
    /// the first bad entry, named.
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        Self::list(root.as_ref(), true)
    }

    /// Lists the samples under `root`, leaving out bad entries (each in
    /// [`ImageFolder::skipped`] with why).
    ///
    /// # Errors
    /// A root that is missing or not a folder, or with no class folder or no file.
    pub fn open_skipping(root: impl AsRef<Path>) -> Result<Self> {
        Self::list(root.as_ref(), false)
    }

    fn list(root: &Path, strict: bool) -> Result<Self> {
        let mut skipped = Vec::new();
        let mut classes: Vec<(String, PathBuf)> = Vec::new();
        for (entry, _) in read_dir_sorted(root)? {
            // Follows symlinks, as torchvision does: a symlinked class folder is a class.
            match std::fs::metadata(&entry) {
                Ok(m) if m.is_dir() => {
                    let name = entry
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    classes.push((name, entry));
                }
                Ok(_) => {} // a file in the root: not a sample
                Err(e) => {
                    let e = Error::from(gpufeed_os::Error::open(&entry, e));
                    if strict {
                        return Err(e);
                    }
                    skipped.push(skip(usize::MAX, entry, &e));
                }
            }
        }
        if classes.is_empty() {
            return Err(Error::Records {
                path: root.into(),
                reason: "no class folder in it (ImageFolder's layout is root/<class>/<files>)"
                    .into(),
            });
        }
        let mut paths = Vec::new();
        let mut labels = Vec::new();
        // The root and every class folder are claimed before any is walked: a symlink inside
        // one class to another class's folder (or to the root) is then a folder reached a
        // second time, refused or skipped, not that class's files labelled as this one.
        let id = |dir: &Path| std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()));
        let mut seen: HashSet<(u64, u64)> = id(root).into_iter().collect();
        let ids: Vec<_> = classes.iter().map(|(_, dir)| id(dir)).collect();
        let mut owners = std::collections::HashMap::new();
        for (label, i) in ids.iter().enumerate() {
            if let Some(i) = i {
                owners.entry(*i).or_insert(label);
            }
        }
        seen.extend(owners.keys().copied());
        for (label, (_, dir)) in classes.iter().enumerate() {
            // Its own folder (claimed above by the first class that has it): walked.
            let claimed = ids[label].is_some_and(|i| owners.get(&i) == Some(&label));
            walk(dir, claimed, strict, &mut seen, &mut paths, &mut skipped)?;
            labels.resize(paths.len(), label as u32);
        }
        if paths.is_empty() {
            return Err(Error::Records {
                path: root.into(),
                reason: format!("no file in its {} class folders", classes.len()),
            });
        }
        let files = if strict {
            FileList::new(&paths)?
        } else {
            FileList::new_skipping(&paths)?
        };
        // Labels of the files the list kept.
        let dropped: HashSet<usize> = files.skipped().iter().map(|s| s.index).collect();
        let labels = labels
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !dropped.contains(i))
            .map(|(_, l)| l)
            .collect();
        skipped.extend(files.skipped().iter().cloned());
        Ok(ImageFolder {
            root: root.into(),
            classes: classes.into_iter().map(|(name, _)| name).collect(),
            files,
            labels,
            skipped,
        })
    }

    /// The root folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Class names, sorted; a sample's label is its class's position here.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Samples.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether there is no sample (never true for a folder that opened).
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The samples' files, sizes and offsets (load them all with
    /// [`Loader::load_files`](gpufeed_load::Loader::load_files)).
    pub fn files(&self) -> &FileList {
        &self.files
    }

    /// Each sample's label.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// Entries left out by [`ImageFolder::open_skipping`] (`index` is the position among the
    /// files found, `usize::MAX` for a folder).
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// Bytes of sample `i` (its file's size when listed).
    pub(crate) fn sample_len(&self, i: usize) -> Option<usize> {
        self.files.range(i).map(|r| (r.end - r.start) as usize)
    }

    /// Reads samples `indices` back to back into `out` (of their summed sizes) with `reader`
    /// (`gpufeed_load`'s `read_parts`).
    pub(crate) fn read_samples(
        &self,
        reader: &mut Reader,
        indices: &[usize],
        out: &mut [u8],
    ) -> Result<()> {
        let mut rest = out;
        let mut parts = Vec::with_capacity(indices.len());
        for &i in indices {
            let (Some(path), Some(len)) = (self.files.paths().get(i), self.sample_len(i)) else {
                return Err(Error::Records {
                    path: self.root.clone(),
                    reason: format!("sample {i} does not exist ({} samples)", self.len()),
                });
            };
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
            parts.push((path.as_path(), 0, head, Some(len as u64)));
            rest = tail;
        }
        Ok(gpufeed_load::internal::read_parts(reader, parts)?)
    }
}

fn skip(index: usize, path: PathBuf, e: &Error) -> Skipped {
    Skipped {
        index,
        path,
        reason: e.to_string(),
    }
}

/// The entries of `dir` with their own types (not followed), sorted by name.
fn read_dir_sorted(dir: &Path) -> Result<Vec<(PathBuf, std::fs::FileType)>> {
    let open = |e| Error::from(gpufeed_os::Error::open(dir, e));
    let mut entries = std::fs::read_dir(dir)
        .map_err(open)?
        .map(|e| e.and_then(|e| Ok((e.path(), e.file_type()?))))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(open)?;
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(entries)
}

/// Appends the files under `dir` (sorted, at any depth; symlinked folders followed once) to
/// `paths`; `claimed`: `dir` is in `seen` already as the folder of the class being walked.
fn walk(
    dir: &Path,
    claimed: bool,
    strict: bool,
    seen: &mut HashSet<(u64, u64)>,
    paths: &mut Vec<PathBuf>,
    skipped: &mut Vec<Skipped>,
) -> Result<()> {
    let fail = |path: PathBuf, e: Error, skipped: &mut Vec<Skipped>| {
        if strict {
            Err(e)
        } else {
            skipped.push(skip(usize::MAX, path, &e));
            Ok(())
        }
    };
    // A claimed folder was looked at already; any other is claimed here, once.
    if !claimed {
        match std::fs::metadata(dir) {
            Ok(m) if !seen.insert((m.dev(), m.ino())) => {
                let e = Error::Records {
                    path: dir.into(),
                    reason: "this folder is reached a second time (a symlink loop or a second \
                             link to it): its files would be samples twice"
                        .into(),
                };
                return fail(dir.into(), e, skipped);
            }
            Ok(_) => {}
            Err(e) => {
                return fail(
                    dir.into(),
                    Error::from(gpufeed_os::Error::open(dir, e)),
                    skipped,
                );
            }
        }
    }
    let entries = match read_dir_sorted(dir) {
        Ok(e) => e,
        Err(e) => return fail(dir.into(), e, skipped),
    };
    for (entry, kind) in entries {
        // A folder (also through a symlink) is walked; anything else is a sample candidate,
        // checked by the file list (a FIFO, a loop or a dangling link is refused there). Only
        // symlinks need a stat here: the entry's own type says the rest.
        let is_dir = kind.is_dir()
            || (kind.is_symlink() && std::fs::metadata(&entry).is_ok_and(|m| m.is_dir()));
        if is_dir {
            walk(&entry, false, strict, seen, paths, skipped)?;
        } else {
            paths.push(entry);
        }
    }
    Ok(())
}
