//! The errors of the batch loader: the loader's and the ring's, plus records, batches and
//! workers.

use std::path::PathBuf;

/// Result alias of gpufeed-data.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong while loading batches.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The loads (and every layer below: files, reads, pinned memory, the GPU).
    #[error(transparent)]
    Load(gpufeed_load::Error),

    /// The batch ring between worker processes and the trainer (gpufeed-ipc).
    #[error(transparent)]
    Ipc(#[from] gpufeed_ipc::Error),

    /// A record file that cannot be used.
    #[error("{}: {reason}", .path.display())]
    Records {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// An image that could not be decoded ([`crate::decode_jpeg`]; made by
    /// [`ImageError::named`](crate::ImageError::named)).
    #[error("{name}: {reason}")]
    Image {
        /// The image: its file's path, or its sample's key in a shard.
        name: String,
        /// Why it was not decoded.
        reason: crate::images::ImageError,
    },

    /// A batch that a worker process wrote into the shared ring cannot be read: its slot is
    /// malformed, out of range or of another epoch (another process writes these bytes, so
    /// they are checked like input).
    #[error("a batch from a worker process is malformed: {reason}")]
    MalformedBatch {
        /// What is wrong with it.
        reason: String,
    },

    /// A batch whose bytes are more than one pinned batch buffer holds
    /// ([`gpufeed_pinned::MAX_CLASS`]): a smaller batch size fits.
    #[error("{}", batch_too_large(*.bytes, *.records, *.max, .largest.as_ref()))]
    BatchTooLarge {
        /// The batch's bytes.
        bytes: usize,
        /// Its records.
        records: usize,
        /// The most bytes a batch may hold.
        max: usize,
        /// Its largest record (its file, for a folder) and that record's bytes, where known.
        largest: Option<(String, usize)>,
    },

    /// The batch loader's worker threads stopped before the epoch ended.
    #[error("the batch workers stopped before the epoch ended")]
    WorkersStopped,

    /// A user transform failed (or panicked) on a record.
    #[error("transform failed on record {record}: {message}")]
    Transform {
        /// The record's index.
        record: usize,
        /// The transform's error, or its panic message.
        message: String,
        /// Whether it panicked (which ends the epoch) rather than returned an error.
        panicked: bool,
    },

    /// Decoding a batch of images panicked (a bug of gpufeed or of a decoder it calls, not a
    /// bad file: those are [`Error::Image`]); the epoch ends there.
    #[error(
        "decoding batch {batch} of images panicked: {message}; this is a bug: please report it \
         (with the files of that batch if you can)"
    )]
    DecodePanicked {
        /// The batch's number in its epoch.
        batch: usize,
        /// The panic's message.
        message: String,
    },

    /// A batch was not ready in time: a worker is stuck (a transform that never returns?).
    #[error(
        "batch {batch} was not ready after {ms} ms: a worker is stuck (a transform that never \
         returns?); raise BatchLoaderOptions::batch_timeout if batches really take this long"
    )]
    BatchTimeout {
        /// The batch's number in its epoch.
        batch: usize,
        /// The bound waited.
        ms: u128,
    },

    /// A batch of worker processes did not come to a
    /// [`RingLoader`](crate::ring::RingLoader) in time: the worker that makes it is
    /// hung, stopped or far behind the others, whose later batches the loader held meanwhile
    /// (at most its window copied out, the rest left in their ring slots).
    #[error(
        "batch {batch} did not come from the ring {}: {} is hung, stopped or far behind the \
         others, whose {held} later batches were waiting for it (a RingLoader copies at most \
         its window of batches out of order, RingLoader::with_window)",
        waited_for(*.ms, *.stalled),
        made_by(*.worker, *.workers)
    )]
    RingBatchMissing {
        /// The batch's number in its epoch.
        batch: usize,
        /// The worker that makes it (`batch % workers`: `produce_epoch`'s share), where the
        /// loader saw a slot of this epoch saying how many workers there are.
        worker: Option<usize>,
        /// The number of workers, from the slots of this epoch (`None`: no slot came).
        workers: Option<usize>,
        /// Later batches the loader held when it gave up (released with the error).
        held: usize,
        /// How long it waited for the batch.
        ms: u128,
        /// Whether it gave up before its timeout because every slot of the ring held a later
        /// batch, so that no worker could publish the one it needed.
        stalled: bool,
    },

    /// A worker process ([`produce_epoch`](crate::ring::produce_epoch)) gave up on a
    /// batch that its trainer's [`RingLoader`](crate::ring::RingLoader) was not ready
    /// for: the loader lets workers run at most its window ahead of the batch it waits for,
    /// and it did not come within reach of this one in time (the batch it waits for is late:
    /// its worker is hung or far slower; or the trainer stopped taking batches), or it ended
    /// the epoch (an error, or it stopped reading) or went on to another first.
    #[error(
        "worker {worker} gave up on batch {batch} of epoch {epoch} after {ms} ms: {}",
        held_back(*.epoch, *.reading, *.position, *.window, *.ended)
    )]
    RingWorkerHeldBack {
        /// The worker's epoch.
        epoch: u64,
        /// The batch it was to produce.
        batch: usize,
        /// The worker.
        worker: usize,
        /// The epoch the trainer read when the worker gave up (`None`: between epochs).
        reading: Option<u64>,
        /// The batch the trainer waited for in that epoch.
        position: u64,
        /// How many batches past it the trainer lets workers produce.
        window: u64,
        /// How long the worker waited.
        ms: u128,
        /// Whether the trainer ended this epoch (or went on to another) after the worker had
        /// seen it read it; otherwise the wait timed out (`WorkerShare::with_timeout`).
        ended: bool,
    },
}

/// What the trainer did while a worker of [`Error::RingWorkerHeldBack`] waited.
fn held_back(epoch: u64, reading: Option<u64>, position: u64, window: u64, ended: bool) -> String {
    match (ended, reading) {
        (true, _) => format!(
            "the trainer ended epoch {epoch} (it failed, or stopped reading it) or went on to \
             another before it could take this batch"
        ),
        (false, Some(r)) if r == epoch => format!(
            "the trainer still waited for batch {position} and takes at most {window} batches \
             ahead of the one it waits for (RingLoader::with_window): the worker of batch \
             {position} is hung, stopped or far behind, or the trainer stopped taking batches"
        ),
        (false, Some(r)) => format!(
            "the trainer reads epoch {r}, not {epoch}: this worker is of another epoch than its \
             trainer's"
        ),
        (false, None) => format!(
            "the trainer did not begin epoch {epoch} (between epochs it lets workers produce \
             batches 0 to {window} only)"
        ),
    }
}

/// How long a [`Error::RingBatchMissing`] waited, and why it stopped.
fn waited_for(ms: u128, stalled: bool) -> String {
    if stalled {
        format!(
            "after {ms} ms, and cannot: every slot of the ring holds a later batch, so no worker \
             can publish it"
        )
    } else {
        format!("within {ms} ms")
    }
}

/// Who makes the batch of a [`Error::RingBatchMissing`].
fn made_by(worker: Option<usize>, workers: Option<usize>) -> String {
    match (worker, workers) {
        (Some(w), Some(n)) => format!("worker {w} of {n}, which makes it,"),
        _ => "the worker that makes it".to_owned(),
    }
}

gpufeed_load::load_error_conversions!(Error);

impl Error {
    /// Whether the error means no GPU can be used here (no driver, no device).
    pub fn is_no_gpu(&self) -> bool {
        matches!(self, Error::Load(e) if e.is_no_gpu())
    }
}

/// [`Error::BatchTooLarge`]'s text: what to do depends on whether one record alone is over.
fn batch_too_large(
    bytes: usize,
    records: usize,
    max: usize,
    largest: Option<&(String, usize)>,
) -> String {
    let head = format!(
        "a batch of {records} records is {bytes} bytes, more than a batch buffer holds ({max} bytes)"
    );
    match largest {
        Some((name, n)) if *n > max => {
            format!("{head}: {name} alone is {n} bytes; leave it out of the data set or shrink it")
        }
        _ if records == 1 => {
            format!("{head}: that record alone is over; leave it out or shrink it")
        }
        Some((name, n)) => {
            format!("{head}; its largest, {name}, is {n} bytes: use a smaller batch_size")
        }
        None => format!("{head}: use a smaller batch_size"),
    }
}
