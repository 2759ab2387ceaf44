//! What can go wrong reading an object: each case names the object and what to do.

/// Result alias of gpufeed-object.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong opening or reading an object.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Not a URL this crate reads (`s3://bucket/key`, `http://`, `https://`).
    #[error("{url:?} is not an object URL ({reason}); write s3://bucket/key or https://host/path")]
    InvalidUrl {
        /// What was given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The bucket or the key does not exist (the server answered 404).
    #[error(
        "{url}: not found (no such bucket or key{endpoint}); check the URL, and AWS_ENDPOINT_URL \
         for an S3-compatible server"
    )]
    NotFound {
        /// The object.
        url: String,
        /// `", endpoint E"` where one was set, else empty.
        endpoint: String,
    },

    /// The server refused the credentials, or they lack the right to read the object (401,
    /// 403).
    #[error(
        "{url}: access denied ({reason}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or \
         AWS_PROFILE) and the bucket's policy"
    )]
    AccessDenied {
        /// The object.
        url: String,
        /// The server's error code (`AccessDenied`, `SignatureDoesNotMatch`,
        /// `InvalidAccessKeyId`...): only the code, because the rest of such an answer can
        /// echo the signed request, session token included.
        reason: String,
    },

    /// No credentials were found: none in the options, the environment or the profile, and
    /// the instance metadata service (EC2 roles) gave none.
    #[error(
        "{url}: no credentials found (none in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, \
         AWS_PROFILE or ~/.aws/credentials, and the instance metadata service gave none); set \
         them, or AWS_SKIP_SIGNATURE=true for a public bucket"
    )]
    NoCredentials {
        /// The object.
        url: String,
    },

    /// The object was replaced or modified after it was opened: its ETag (or size) differs
    /// from the one pinned at the first request, so the bytes read so far may mix two
    /// versions and were not handed out.
    #[error(
        "{url} changed while it was being read ({what}): a writer replaced it, so what was read \
         was dropped; read it again once the writer is done"
    )]
    ObjectChanged {
        /// The object.
        url: String,
        /// What differed.
        what: String,
    },

    /// A read past the end of the object.
    #[error("{url}: bytes {start}..{end} asked for, but the object has {len} bytes")]
    OutOfRange {
        /// The object.
        url: String,
        /// First byte asked for.
        start: u64,
        /// One past the last byte asked for.
        end: u64,
        /// The object's size.
        len: u64,
    },

    /// The server's answer ended before the bytes asked for (a truncated object, a proxy
    /// that cut the body, a server that died) and retries did not bring them.
    #[error(
        "{url}: the server sent {got} of the {want} bytes at offset {offset}; the object may be \
         truncated or the connection cut"
    )]
    Truncated {
        /// The object.
        url: String,
        /// Where the request started.
        offset: u64,
        /// Bytes received.
        got: u64,
        /// Bytes asked for.
        want: u64,
    },

    /// A request failed after the retries without an error answer from the server
    /// (connection refused or reset, time-outs; an error status is [`Error::Answered`]): the
    /// message of the store, and the cause under it where that message leaves it out, say
    /// which.
    #[error("{url}: {what} failed: {source}{cause}")]
    Request {
        /// The object.
        url: String,
        /// The request (`HEAD`, `GET bytes a-b`).
        what: String,
        /// The store's error.
        #[source]
        source: Box<object_store::Error>,
        /// What the store's message leaves out: `" (operation timed out: ...)"`, the innermost
        /// cause of `source` with what to do where known; empty where the message says it.
        cause: String,
    },

    /// The server answered a request with an error status after the retries (a 400, a 5xx):
    /// only its HTTP status and S3 error code are kept, because the rest of such an answer
    /// can echo the signed request, session token included.
    #[error("{url}: {what} failed: the server answered {answer}")]
    Answered {
        /// The object.
        url: String,
        /// The request (`HEAD`, `GET bytes a-b`).
        what: String,
        /// `HTTP 503, SlowDown`: the status and the `<Code>` the answer quoted.
        answer: String,
    },

    /// A setting that cannot work: the message says which and what to write instead.
    #[error("invalid setting: {0}")]
    InvalidSetting(String),

    /// The I/O runtime could not be started (the process's thread limit?).
    #[error("could not start gpufeed-object's I/O threads: {0}")]
    Runtime(String),
}

impl Error {
    /// This error again, for the other readers of a read ahead whose GET failed: the same
    /// variant and message (a request's store error as its message).
    pub(crate) fn shared_copy(&self) -> Error {
        match self {
            Error::InvalidUrl { url, reason } => Error::InvalidUrl {
                url: url.clone(),
                reason: reason.clone(),
            },
            Error::NotFound { url, endpoint } => Error::NotFound {
                url: url.clone(),
                endpoint: endpoint.clone(),
            },
            Error::AccessDenied { url, reason } => Error::AccessDenied {
                url: url.clone(),
                reason: reason.clone(),
            },
            Error::NoCredentials { url } => Error::NoCredentials { url: url.clone() },
            Error::ObjectChanged { url, what } => Error::ObjectChanged {
                url: url.clone(),
                what: what.clone(),
            },
            Error::OutOfRange {
                url,
                start,
                end,
                len,
            } => Error::OutOfRange {
                url: url.clone(),
                start: *start,
                end: *end,
                len: *len,
            },
            Error::Truncated {
                url,
                offset,
                got,
                want,
            } => Error::Truncated {
                url: url.clone(),
                offset: *offset,
                got: *got,
                want: *want,
            },
            Error::Answered { url, what, answer } => Error::Answered {
                url: url.clone(),
                what: what.clone(),
                answer: answer.clone(),
            },
            Error::Request {
                url,
                what,
                source,
                cause,
            } => Error::Request {
                url: url.clone(),
                what: what.clone(),
                source: Box::new(object_store::Error::Generic {
                    store: "S3",
                    source: source.to_string().into(),
                }),
                cause: cause.clone(),
            },
            Error::InvalidSetting(s) => Error::InvalidSetting(s.clone()),
            Error::Runtime(s) => Error::Runtime(s.clone()),
        }
    }

    /// Whether the object (bucket or key) was not found.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound { .. })
    }
}
