//! The errors of checkpoints: the loader's, plus files, indexes and checkpoints that cannot be
//! used.

use std::path::PathBuf;

use crate::header::HeaderError;

/// Result alias of gpufeed-safetensors.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong with a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The load or the save (and every layer below: files, reads, pinned memory, the GPU).
    #[error(transparent)]
    Load(gpufeed_load::Error),

    /// A safetensors file that cannot be used.
    #[error("{}: not a valid safetensors file: {reason}", .path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong with its header.
        reason: HeaderError,
    },

    /// A tensor name the checkpoint does not have.
    #[error("{}: no tensor named {name:?} in the checkpoint", .path.display())]
    NoTensor {
        /// The checkpoint (its first file).
        path: PathBuf,
        /// The name asked for.
        name: String,
    },

    /// A [`Prefetch`](crate::Prefetch) asked for what it cannot give: an item taken before,
    /// out of range, after `close`, or after an earlier transfer failed.
    #[error("{}: prefetch: {reason}", .path.display())]
    Prefetch {
        /// The file.
        path: PathBuf,
        /// What was refused, and why.
        reason: String,
    },

    /// A sharded checkpoint's index that cannot be used.
    #[error("{}: bad checkpoint index: {reason}", .path.display())]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A sharded checkpoint whose files are not all of the save its index names: a save was
    /// stopped between files, or a file was replaced on its own. Nothing was loaded.
    #[error(
        "{}: the checkpoint mixes versions: {} {} not of the save the index names ({index_save}); \
         save the checkpoint again, or restore the files of one save",
        .index.display(),
        files.iter().map(|(p, why)| format!("{} ({why})", p.display())).collect::<Vec<_>>().join(", "),
        if files.len() == 1 { "is" } else { "are" }
    )]
    MixedCheckpoint {
        /// The index file.
        index: PathBuf,
        /// The save the index records (`metadata.gpufeed_save_id`).
        index_save: String,
        /// Each file that does not belong to it, and why.
        files: Vec<(PathBuf, String)>,
    },
}

gpufeed_load::load_error_conversions!(Error);

impl Error {
    /// Whether the error means no GPU can be used here (no driver, no device).
    pub fn is_no_gpu(&self) -> bool {
        matches!(self, Error::Load(e) if e.is_no_gpu())
    }
}
