//! The one error type of `gpufeed-ipc`.

/// Result alias used throughout `gpufeed-ipc`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `gpufeed-ipc`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A ring geometry that cannot be built.
    #[error("invalid ring layout: {0}")]
    InvalidLayout(String),

    /// The segment does not hold a valid ring (or another process damaged its header).
    #[error(
        "invalid batch ring header: {0}; is this segment a gpufeed batch ring of the same version?"
    )]
    InvalidHeader(String),

    /// No slot became free or ready in time.
    #[error("timed out after {ms} ms waiting for {what}")]
    Timeout {
        /// `"a free slot"` or `"a batch"`.
        what: &'static str,
        /// The timeout.
        ms: u128,
    },

    /// Every consumer that registered has died: nobody will free slots again.
    #[error("every consumer of the ring has exited; stop producing or start a consumer")]
    ConsumerGone,

    /// Data larger than a slot.
    #[error("{len} bytes do not fit a slot of {capacity} bytes; create the ring with larger slots")]
    TooLarge {
        /// Bytes offered.
        len: u64,
        /// Slot size.
        capacity: u64,
    },

    /// All consumer places are taken.
    #[error("the ring already has {0} live consumers, its maximum")]
    TooManyConsumers(usize),

    /// A slot changed under its holder (another process freed it): the ring is being misused.
    #[error(
        "slot {slot} was taken away from this process; a peer process freed it (clock or pid confusion?)"
    )]
    SlotLost {
        /// The slot.
        slot: u32,
    },

    /// A lower-level error (shared memory, system calls).
    #[error(transparent)]
    Os(#[from] gpufeed_os::Error),

    /// A system call of the ring itself failed.
    #[error("{op} failed: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}
