//! # gpufeed-object — layer 1 of gpufeed: objects in S3-compatible storage, read in parallel
//!
//! Models and data sets that outgrow one machine live in object storage. This crate reads an
//! object (`s3://bucket/key` on AWS, MinIO, SeaweedFS, Ceph, R2; or `https://host/path` from
//! any server that answers range requests) the way gpufeed reads a file:
//!
//! - [`Object::open`]: one `HEAD` pins the object's size and ETag; every later `GET` asks for
//!   that version (`If-Match`) and each answer's ETag and size are checked, so an object
//!   replaced during a read is [`Error::ObjectChanged`], never a mix of two versions (for a
//!   server that sends no ETag, only the size can be checked).
//! - [`Object::read_exact_at`]: any byte range, as ranged `GET`s of up to
//!   [`ObjectOptions::request_bytes`] (cut at the object's multiples of it) with
//!   [`ObjectOptions::requests_in_flight`] of them in flight, each written straight into its
//!   part of the caller's buffer (a pinned staging buffer that the transfer scheduler then
//!   uploads: `gpufeed-load`'s object loads). Host memory is what the caller gives, whatever
//!   the object's size.
//! - [`Object::read_ahead`]: a range fetched ahead of readers that take it piece by piece:
//!   the GETs stay in flight between the pieces, in blocks of the crate's own, at most
//!   [`read_ahead_bytes`] held (the loader's fill threads read with their own GETs: faster on
//!   the H200 machine).
//! - Failures retried with exponential backoff (5xx, throttling, refused or reset
//!   connections, bodies cut short where the server sent an ETag: the store's retries,
//!   bounded by [`ObjectOptions::timeout`]); what is left is a typed [`Error`] naming the object and what
//!   to do ([`Error::NotFound`], [`Error::AccessDenied`], [`Error::Truncated`]...).
//!
//! Credentials, region and endpoint come the standard way (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`, `AWS_PROFILE` and the shared
//! files; see [`ObjectOptions`]); S3-compatible servers are addressed path-style. The HTTP
//! client is Apache Arrow's `object_store` (reqwest, rustls; an S3 endpoint's redirects are not
//! followed, so that no request with its session token goes to another host) on a small tokio
//! runtime of the crate's own (one per process: a forked child makes its own); the API is
//! blocking, callable from any thread, also from inside an async runtime (the call then runs
//! on a thread of its own).
//!
//! Depends on no other gpufeed crate.
//!
//! The loader's `object` feature builds loads into GPU memory on it (`Loader::load_object`).
//!
//! # Example
//! ```no_run
//! use gpufeed_object::{Object, ObjectOptions};
//! let opts = ObjectOptions::default().with_endpoint("http://127.0.0.1:8333");
//! let obj = Object::open("s3://models/shard-000.bin", &opts)?;
//! let mut buf = vec![0u8; obj.len() as usize];
//! let stats = obj.read_exact_at(0, &mut buf)?;
//! println!("{} bytes in {} requests, {:.2} GB/s", stats.bytes, stats.requests, stats.gbps());
//! # Ok::<(), gpufeed_object::Error>(())
//! ```

#![deny(unsafe_code)]

mod ahead;
mod client;
mod error;
mod object;
mod options;
mod url;

pub use ahead::{ReadAhead, read_ahead_bytes};
pub use error::{Error, Result};
pub use object::{Object, ReadStats, list};
pub use options::{Credentials, ObjectOptions};
pub use url::{ObjectUrl, Scheme};
