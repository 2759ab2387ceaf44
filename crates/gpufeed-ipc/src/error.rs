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
        /// What was awaited: `"a free slot"`, `"a batch"`, or the other ranks' descriptors.
        what: &'static str,
        /// The timeout.
        ms: u128,
    },

    /// Every consumer that registered has died or left (dropped its `Consumer`): nobody will
    /// free slots again.
    #[error("every consumer of the ring has exited or left; stop producing or start a consumer")]
    ConsumerGone,

    /// Every producer that registered ([`crate::BatchRing::producer`]) has died or left, and
    /// no published batch is left: nobody will publish again.
    #[error(
        "every producer of the ring has exited or left and no batch is waiting; the process feeding this ring stopped (see its own output) or start a producer"
    )]
    ProducerGone,

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

    /// All producer places are taken.
    #[error("the ring already has {0} live producers registered, its maximum")]
    TooManyProducers(usize),

    /// A slot changed under its holder (another process freed it): the ring is being misused.
    #[error(
        "slot {slot} was taken away from this process: a peer judged it gone (stopped for longer than the ring's lease?)"
    )]
    SlotLost {
        /// The slot.
        slot: u32,
    },

    /// Every place of the ring's process table is taken by a live process.
    #[error(
        "{0} processes are attached to the ring, its maximum; drop rings that are no longer used"
    )]
    TooManyProcesses(usize),

    /// The ring is used in a child forked after attaching: its slots and registration belong
    /// to the parent.
    #[error(
        "this batch ring was attached by process {attached_pid} and is used in its forked child {pid}; \
         open the ring again in the child (BatchRing::open or BatchRing::from_fd)"
    )]
    Forked {
        /// The pid that attached the ring.
        attached_pid: u32,
        /// This process.
        pid: u32,
    },

    /// A peer judged this process gone and reclaimed its registration and slots (its
    /// heartbeat stood still for a whole lease: the process was stopped, or starved).
    #[error(
        "this process's registration in the batch ring was reclaimed by a peer (no heartbeat for \
         {lease_ms} ms: was the process stopped?); open the ring again, or set a longer lease"
    )]
    Detached {
        /// The ring's lease.
        lease_ms: u128,
    },

    /// A rank of a [`crate::Rendezvous`] did not join within the join timeout.
    #[error(
        "rank {rank} of {world} did not join the rendezvous within {waited_ms} ms: was it \
         started (LOCAL_RANK={rank}), with the same job name and world size?"
    )]
    RankNeverArrived {
        /// The missing rank.
        rank: usize,
        /// The number of ranks.
        world: usize,
        /// How long this rank waited.
        waited_ms: u128,
    },

    /// A rank of a [`crate::Rendezvous`] died (its process exited, or its heartbeat stood
    /// still for a whole lease).
    #[error(
        "rank {rank} (pid {pid}) died or hangs: no heartbeat for {silent_ms} ms; see its own \
         output for why, then restart the job"
    )]
    RankDied {
        /// The rank.
        rank: usize,
        /// Its pid, in its own PID namespace.
        pid: u32,
        /// How long its heartbeat stood still.
        silent_ms: u128,
    },

    /// A rank of a [`crate::Rendezvous`] left it (dropped its handle, as after an error of its
    /// own) before reaching a barrier the others wait at.
    #[error("rank {rank} left the rendezvous before this step (it failed: see its own output)")]
    RankLeft {
        /// The rank.
        rank: usize,
    },

    /// Passing a file descriptor to or from a rank ([`crate::Rendezvous::share_fd`]) failed
    /// while that rank still lived (its socket refused or closed the connection).
    #[error(
        "passing a file descriptor with rank {rank} failed: {source} (did it fail or leave? see \
         its own output)"
    )]
    FdPass {
        /// The other rank.
        rank: usize,
        /// The error.
        #[source]
        source: std::io::Error,
    },

    /// A process that is not the rank it should be took part in a
    /// [`crate::Rendezvous::share_fd`]: it claimed a rank whose pid it does not have, asked
    /// for a descriptor a second time, or listened in a rank's place. It was given nothing.
    #[error(
        "a process (pid {pid} as seen here, uid {uid}) {why} in the rendezvous's descriptor \
         exchange; it was given nothing. Two jobs under one rendezvous name, or a process that \
         is not part of this job: find it by its pid"
    )]
    FdImpostor {
        /// The rank it claimed or stood in for.
        rank: usize,
        /// Its pid in our PID namespace (0 where it is not visible here).
        pid: u32,
        /// Its uid.
        uid: u32,
        /// What it did.
        why: String,
    },

    /// The rendezvous name is taken by a file of another user: another user's job of the same
    /// name, or a squatter. It is never opened or removed.
    #[error(
        "the rendezvous name {name} in /dev/shm is taken by a file of uid {owner_uid}, not ours \
         ({our_uid}): another user's job of the same name, or a squatter; give this job a name \
         of its own (or have uid {owner_uid} remove the file)"
    )]
    RendezvousSquatted {
        /// The name.
        name: String,
        /// The file's owner.
        owner_uid: u32,
        /// Our effective uid.
        our_uid: u32,
    },

    /// Rank 0 found the rendezvous name held by a live job (its rank 0 lives): never removed.
    #[error(
        "the rendezvous {name} is in use by a live job: its rank 0 is pid {pid} (a world of \
         {world}); two jobs were given one name: give each its own (for torchrun, a --rdzv-id \
         or MASTER_PORT of its own), or wait until that job has met"
    )]
    RendezvousInUse {
        /// The name.
        name: String,
        /// The live rank 0's pid (in its own PID namespace).
        pid: u32,
        /// Its world size.
        world: usize,
    },

    /// Another live process already holds this rank of the rendezvous.
    #[error(
        "rank {rank} of the rendezvous is already held by pid {pid}{}: two processes were \
         given the same LOCAL_RANK, or two jobs the same name",
        if *.left { " (which has left it)" } else { "" }
    )]
    RankTaken {
        /// The rank.
        rank: usize,
        /// The holder's pid.
        pid: u32,
        /// Whether the holder has left already.
        left: bool,
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
