//! An opened object: its size and version pinned by one `HEAD`, then read by many ranged
//! `GET`s in flight at once, straight into the caller's memory.

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, GetResultPayload, ObjectStore, ObjectStoreExt};

use crate::error::{Error, Result};
use crate::options::ObjectOptions;
use crate::url::ObjectUrl;

/// An object opened for reading: its size and ETag (version) were read once, by a `HEAD`,
/// and every later read asks for that version (`If-Match`), so a read of an object replaced
/// meanwhile is [`Error::ObjectChanged`], never a mix of two versions.
///
/// Reads are blocking calls; the requests run on a small I/O runtime of the crate's own
/// (created on first use, again in a forked child), many in flight at once
/// ([`ObjectOptions::requests_in_flight`]). A weak ETag (`W/"..."`) is not sent as `If-Match`
/// (it would never match); answers are then checked by their ETag and size alone.
/// The bytes land in the memory the caller gives (a pinned staging buffer, say): no buffer
/// of the object's size is made, so host memory stays what the caller gave.
///
/// ```no_run
/// let obj = gpufeed_object::Object::open("s3://models/model.safetensors", &Default::default())?;
/// let mut header_len = [0u8; 8];
/// obj.read_exact_at(0, &mut header_len)?;
/// println!("{} bytes, header {} bytes", obj.len(), u64::from_le_bytes(header_len));
/// # Ok::<(), gpufeed_object::Error>(())
/// ```
pub struct Object {
    url: ObjectUrl,
    store: Arc<dyn ObjectStore>,
    path: Path,
    len: u64,
    etag: Option<String>,
    opts: ObjectOptions,
    endpoint: Option<String>,
}

impl std::fmt::Debug for Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Object")
            .field("url", &self.url.as_str())
            .field("len", &self.len)
            .field("etag", &self.etag)
            .finish_non_exhaustive()
    }
}

/// What one read did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReadStats {
    /// Bytes read.
    pub bytes: u64,
    /// Ranged GETs made (retries inside the store not counted).
    pub requests: usize,
    /// Time from the first request to the last byte.
    pub elapsed: Duration,
}

impl ReadStats {
    /// Bytes per second over the read, in GB/s (10^9).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

impl Object {
    /// Opens the object at `url` (`s3://bucket/key`, `http(s)://host/path`): one `HEAD` for
    /// its size and ETag.
    pub fn open(url: &str, opts: &ObjectOptions) -> Result<Object> {
        let url = ObjectUrl::parse(url)?;
        Object::open_url(url, opts)
    }

    /// [`Object::open`] of a parsed URL.
    pub fn open_url(url: ObjectUrl, opts: &ObjectOptions) -> Result<Object> {
        let started = std::time::Instant::now();
        let store = opts.store(&url)?;
        // Checked by `ObjectUrl::parse`; `parse` keeps the key's characters as they are (the
        // request encodes them once).
        let path = Path::parse(url.key()).map_err(|e| Error::InvalidUrl {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        let endpoint = opts.endpoint_for(&url);
        let meta = block_on(|| store.head(&path))?;
        let mut obj = Object {
            url,
            store,
            path,
            len: 0,
            etag: None,
            opts: opts.clone(),
            endpoint,
        };
        let meta = meta.map_err(|e| obj.error("HEAD", e))?;
        obj.len = meta.size;
        obj.etag = meta.e_tag;
        tracing::debug!(
            url = %obj.url,
            len = obj.len,
            etag = ?obj.etag,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "object opened"
        );
        Ok(obj)
    }

    /// The object's URL.
    pub fn url(&self) -> &ObjectUrl {
        &self.url
    }

    /// The object's size in bytes, as it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the object has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ETag pinned at open (`None` where the server gives none: then each answer's size
    /// is checked instead).
    pub fn etag(&self) -> Option<&str> {
        self.etag.as_deref()
    }

    /// The settings it reads with.
    pub fn options(&self) -> &ObjectOptions {
        &self.opts
    }

    /// Fills all of `dst` with the object's bytes from `offset`: ranged GETs of up to
    /// [`ObjectOptions::request_bytes`], cut where the object's offsets are multiples of it
    /// (a read that starts mid-block first GETs up to the next boundary), up to
    /// [`ObjectOptions::requests_in_flight`] at once, each straight into its part of `dst`.
    /// On an error `dst` holds an unspecified mix of old contents and object bytes.
    pub fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<ReadStats> {
        offset
            .checked_add(dst.len() as u64)
            .filter(|&end| end <= self.len)
            .ok_or_else(|| Error::OutOfRange {
                url: self.url.to_string(),
                start: offset,
                end: offset.saturating_add(dst.len() as u64),
                len: self.len,
            })?;
        let start = Instant::now();
        let bytes = dst.len() as u64;
        let parts = aligned_parts(offset, dst.len(), self.opts.request_bytes);
        let requests = parts.len();
        // The GETs' bodies are copied into place by the threads that poll them: a read of
        // several requests is polled by a few threads (scoped, each with its share of the
        // requests and of the ones in flight), so the copies do not queue on one core.
        // No more callers than requests in flight (each keeps at least one going).
        let callers = requests
            .min(MAX_CALLERS)
            .min(self.opts.requests_in_flight)
            .min(std::thread::available_parallelism().map_or(1, |n| n.get()));
        if callers <= 1 {
            self.get_parts(offset, dst, &parts, self.opts.requests_in_flight)?;
        } else {
            // The parts in `groups` runs of `per` (the last may be shorter), the requests in
            // flight shared among them.
            let per = requests.div_ceil(callers);
            let groups = requests.div_ceil(per);
            let in_flight = self.opts.requests_in_flight.div_ceil(groups);
            std::thread::scope(|scope| {
                let mut rest = dst;
                let handles: Vec<_> = parts
                    .chunks(per)
                    .map(|group| {
                        // Each caller's share of `dst`: its parts, back to back.
                        let (first, last) = (group[0].start, group[group.len() - 1].end);
                        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(last - first);
                        rest = tail;
                        let at = offset + first as u64;
                        let group: Vec<Range<usize>> = group
                            .iter()
                            .map(|r| r.start - first..r.end - first)
                            .collect();
                        std::thread::Builder::new()
                            .name("gpufeed-object-read".into())
                            .spawn_scoped(scope, move || {
                                self.get_parts(at, mine, &group, in_flight)
                            })
                            .map_err(|e| Error::Runtime(e.to_string()))
                    })
                    .collect();
                let mut first = Ok(());
                for h in handles {
                    let done = h.and_then(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(Error::Runtime("a read's thread panicked".into()))
                        })
                    });
                    if first.is_ok() {
                        first = done;
                    }
                }
                first
            })?;
        }
        Ok(ReadStats {
            bytes,
            requests,
            elapsed: start.elapsed(),
        })
    }

    /// `dst` from `offset`: one GET per part of `parts` (ranges of `dst`, back to back from
    /// 0), `in_flight` at once, polled (and their bodies copied) by this thread.
    fn get_parts(
        &self,
        offset: u64,
        dst: &mut [u8],
        parts: &[Range<usize>],
        in_flight: usize,
    ) -> Result<()> {
        let mut rest = dst;
        let mut slices = Vec::with_capacity(parts.len());
        for r in parts {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
            slices.push((offset + r.start as u64, part));
            rest = tail;
        }
        block_on(|| async {
            let mut pending = futures_util::stream::iter(
                slices.into_iter().map(|(at, part)| self.get_into(at, part)),
            )
            .buffer_unordered(in_flight.max(1));
            while let Some(done) = pending.next().await {
                done?;
            }
            Ok::<(), Error>(())
        })?
    }

    /// The whole object, read as [`Object::read_exact_at`] reads.
    pub fn read_all(&self) -> Result<Vec<u8>> {
        let len = usize::try_from(self.len).map_err(|_| {
            Error::InvalidSetting(format!(
                "{}: {} bytes do not fit in memory",
                self.url, self.len
            ))
        })?;
        // The size is the server's word: a claim past memory is an error, not an abort.
        let mut out = zeroed(len).ok_or_else(|| {
            Error::InvalidSetting(format!(
                "{}: {} bytes do not fit in memory",
                self.url, self.len
            ))
        })?;
        self.read_exact_at(0, &mut out)?;
        Ok(out)
    }

    /// One ranged GET of `dst.len()` bytes at `offset`, of the pinned version, into `dst`.
    pub(crate) async fn get_into(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let range = offset..offset + dst.len() as u64;
        let what = || format!("GET bytes {}-{}", range.start, range.end - 1);
        let options = GetOptions {
            range: Some(GetRange::Bounded(range.clone())),
            // A weak ETag (`W/"..."`) never matches `If-Match` (a strong comparison): such
            // answers are checked by their ETag and size alone.
            if_match: self.etag.clone().filter(|e| !e.starts_with("W/")),
            ..GetOptions::default()
        };
        let got = self
            .store
            .get_opts(&self.path, options)
            .await
            .map_err(|e| self.error(&what(), e))?;
        if got.meta.size != self.len || (self.etag.is_some() && got.meta.e_tag != self.etag) {
            return Err(Error::ObjectChanged {
                url: self.url.to_string(),
                what: format!(
                    "{} bytes, ETag {} at open; {} bytes, ETag {} now",
                    self.len,
                    shown(self.etag.as_deref()),
                    got.meta.size,
                    shown(got.meta.e_tag.as_deref())
                ),
            });
        }
        let GetResultPayload::Stream(mut body) = got.payload;
        let mut done = 0usize;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| self.error(&what(), e))?;
            let Some(to) = dst.get_mut(done..done + chunk.len()) else {
                return Err(self.truncated(offset, done + chunk.len(), dst.len()));
            };
            to.copy_from_slice(&chunk);
            done += chunk.len();
        }
        if done != dst.len() {
            return Err(self.truncated(offset, done, dst.len()));
        }
        Ok(())
    }

    fn truncated(&self, offset: u64, got: usize, want: usize) -> Error {
        Error::Truncated {
            url: self.url.to_string(),
            offset,
            got: got as u64,
            want: want as u64,
        }
    }

    /// The store's error `e` of request `what`, as this crate's.
    fn error(&self, what: &str, e: object_store::Error) -> Error {
        store_error(
            self.url.to_string(),
            self.endpoint.as_deref(),
            self.etag.as_deref(),
            what,
            e,
        )
    }
}

/// The crate's error for the store's error `e` of request `what` on `url` (at `endpoint`,
/// pinned to `etag`).
fn store_error(
    url: String,
    endpoint: Option<&str>,
    etag: Option<&str>,
    what: &str,
    e: object_store::Error,
) -> Error {
    match e {
        object_store::Error::NotFound { .. } => Error::NotFound {
            url,
            endpoint: endpoint.map_or_else(String::new, |e| format!(", endpoint {e}")),
        },
        object_store::Error::Precondition { .. } => Error::ObjectChanged {
            url,
            what: format!("its ETag is no longer {}", shown(etag)),
        },
        e @ (object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. }) => Error::AccessDenied {
            url,
            reason: refusal(&e.to_string()),
        },
        source => {
            let text = source.to_string();
            if is_metadata_failure(&text) {
                // object_store asks the instance metadata service where it found no
                // credentials: its failure is the missing credentials, not the request's.
                Error::NoCredentials { url }
            } else if is_answer(&text) {
                // An error status's answer: its status and code only (its body can echo the
                // signed request, session token included).
                let mut answer = refusal(&text);
                let redirect = ["HTTP 301", "HTTP 302", "HTTP 303", "HTTP 307", "HTTP 308"];
                if redirect.iter().any(|r| answer.starts_with(r)) {
                    answer.push_str(
                        " (a redirect: an S3 endpoint's redirects are not followed, since they \
                         would take the request's session token to another host; set the \
                         endpoint and region of where the bucket is)",
                    );
                }
                Error::Answered {
                    url,
                    what: what.to_string(),
                    answer,
                }
            } else {
                Error::Request {
                    url,
                    what: what.to_string(),
                    cause: left_out_cause(&source, &text),
                    source: Box::new(source),
                }
            }
        }
    }
}

/// `len` zero bytes, `None` where the allocator has no room. Zeroed memory from the
/// allocator (fresh pages of a mapping, for large sizes) rather than a buffer zeroed by this
/// thread: its pages are touched first by the copies of the GETs, spread over the threads
/// that poll them, not one after another here (a new 4 GiB buffer was read at 0.2 of the
/// reused buffer's speed on the H200 machine, zeroed first).
#[allow(unsafe_code)]
fn zeroed(len: usize) -> Option<Vec<u8>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: the layout's size is not zero.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `len` bytes at
    // alignment 1 (what a Vec<u8> of capacity `len` holds), and all `len` bytes are
    // initialized (zero).
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// What a refusal's message `text` may show: the HTTP status and the S3 error `<Code>` where
/// it quotes them, nothing else (the rest of an S3 error answer can echo the signed request).
fn refusal(text: &str) -> String {
    let status = text.find("status code: ").and_then(|i| {
        let rest = &text[i + "status code: ".len()..];
        let code = rest
            .get(..3)
            .filter(|c| c.bytes().all(|b| b.is_ascii_digit()))?;
        Some(format!("HTTP {code}"))
    });
    let code = text.find("<Code>").and_then(|i| {
        let rest = &text[i + "<Code>".len()..];
        let c = &rest[..rest.find("</Code>")?];
        (c.len() < 64 && c.chars().all(|ch| ch.is_ascii_alphanumeric())).then(|| c.to_string())
    });
    match (status, code) {
        (Some(s), Some(c)) => format!("{s}, {c}"),
        (Some(s), None) => s,
        (None, Some(c)) => c,
        (None, None) => "the server refused the request".into(),
    }
}

/// The innermost cause of the store's error `e` (whose message is `text`) where that message
/// does not say it, as `" (cause)"`: object_store's text for a body that stalled past the
/// timeout ends at "request or response body error", the "operation timed out" under it;
/// empty where there is nothing to add.
fn left_out_cause(e: &object_store::Error, text: &str) -> String {
    let mut root: &dyn std::error::Error = e;
    while let Some(next) = root.source() {
        root = next;
    }
    let cause = root.to_string();
    if cause.is_empty() || text.contains(&cause) {
        String::new()
    } else if cause.contains("timed out") {
        format!(
            " ({cause}: each request, with its retries, must finish within \
             ObjectOptions::timeout; raise it for a slow link or server)"
        )
    } else {
        format!(" ({cause})")
    }
}

/// An ETag as a message shows it: as the server sent it, or `none`.
fn shown(etag: Option<&str>) -> &str {
    etag.unwrap_or("none")
}

/// Whether a store's error `text` carries a server's error answer (object_store's
/// `RequestError::Status` and `Response` texts), whose body is not to be shown.
fn is_answer(text: &str) -> bool {
    text.contains("Server returned non-2xx status code")
        || text.contains("Server returned error response")
}

/// Whether a store's error `text` is the instance metadata service's (EC2's credentials).
fn is_metadata_failure(text: &str) -> bool {
    text.contains("169.254.169.254") || text.contains("169.254.170.2")
}

/// The most threads that poll one read's GETs.
const MAX_CALLERS: usize = 4;

/// The GETs of a read of `len` bytes at `offset` of an object, as ranges of the read (back to
/// back from 0): cut where the object's offsets are multiples of `step`, so that each GET
/// covers at most one `step`-aligned block of the object. Servers store large objects in
/// parts or chunks of such sizes (SeaweedFS in chunks, S3 in an upload's parts), and a GET
/// across a boundary costs them two fetches (docs/architecture.md, gpufeed-object, has the
/// figures: reads at such offsets from SeaweedFS ran 8-13% faster by their medians cut this
/// way; a checkpoint's data section starts after its header). A read that starts aligned is
/// cut in whole steps.
fn aligned_parts(offset: u64, len: usize, step: usize) -> Vec<Range<usize>> {
    let step = step.max(1);
    let mut parts = Vec::with_capacity(len.div_ceil(step) + 1);
    let mut at = 0usize;
    while at < len {
        // Bytes to the next multiple of `step` in the object's offsets (a whole step where
        // `offset + at` is one).
        let to_boundary = step - ((offset + at as u64) % step as u64) as usize;
        let end = at + to_boundary.min(len - at);
        parts.push(at..end);
        at = end;
    }
    parts
}

/// The crate's I/O runtime: a few worker threads drive the connections; the futures of a
/// read run on the calling thread. One per process: a child forked after the parent used it
/// (a Python DataLoader worker) has none of its threads, so it makes its own.
fn runtime() -> Result<Arc<tokio::runtime::Runtime>> {
    static RUNTIME: parking_lot::Mutex<Option<(u32, Arc<tokio::runtime::Runtime>)>> =
        parking_lot::Mutex::new(None);
    let pid = std::process::id();
    let mut slot = RUNTIME.lock();
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return Ok(Arc::clone(rt));
        }
        // The parent's: its threads do not exist here, and dropping it would wait for them.
        if let Some((_, inherited)) = slot.take() {
            std::mem::forget(inherited);
        }
    }
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("gpufeed-object")
        .enable_all()
        .build()
        .map(Arc::new)
        .map_err(|e| Error::Runtime(e.to_string()))?;
    *slot = Some((pid, Arc::clone(&rt)));
    Ok(rt)
}

/// The objects of an S3 bucket whose keys match `pattern` (`s3://bucket/dir/train-*.tar`:
/// `*` any characters but `/`, `[abc]` / `[0-9]` one of those; `?` is a URL's query, not a
/// wildcard, here), sorted by key; a URL without a wildcard is itself. Lists the keys under the
/// pattern's folder (the part before its first wildcard, up to a `/`), one `LIST` request per
/// thousand keys.
///
/// # Errors
/// [`Error::InvalidUrl`] for an HTTP URL (a plain server has no listing) or a malformed
/// pattern; [`Error::NotFound`] where no key matches (or the bucket does not exist); the
/// request's errors ([`Error::AccessDenied`], ...).
///
/// ```no_run
/// let opts = gpufeed_object::ObjectOptions::default();
/// for url in gpufeed_object::list("s3://data/imagenet/train-*.tar", &opts)? {
///     println!("{url}");
/// }
/// # Ok::<(), gpufeed_object::Error>(())
/// ```
pub fn list(pattern: &str, opts: &ObjectOptions) -> Result<Vec<ObjectUrl>> {
    let url = ObjectUrl::parse(pattern)?;
    let key = url.key();
    let Some(wild) = key.find(['*', '[']) else {
        return Ok(vec![url]);
    };
    let bad = |reason: String| Error::InvalidUrl {
        url: pattern.to_string(),
        reason,
    };
    if url.scheme() != crate::url::Scheme::S3 {
        return Err(bad(
            "a wildcard needs a listing, which only s3:// buckets have: give each URL".into(),
        ));
    }
    let matcher = glob::Pattern::new(key).map_err(|e| bad(format!("not a pattern: {e}")))?;
    let folder = key[..wild].rfind('/').map(|end| &key[..end]);
    let prefix = folder
        .map(Path::parse)
        .transpose()
        .map_err(|e| bad(e.to_string()))?;
    let store = opts.store(&url)?;
    let endpoint = opts.endpoint_for(&url);
    let listed = block_on(|| async {
        store
            .list(prefix.as_ref())
            .collect::<Vec<object_store::Result<object_store::ObjectMeta>>>()
            .await
    })?;
    let within = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: true,
        require_literal_leading_dot: false,
    };
    let mut keys = Vec::new();
    for meta in listed {
        let meta = meta
            .map_err(|e| store_error(pattern.to_string(), endpoint.as_deref(), None, "LIST", e))?;
        let found = meta.location.as_ref();
        if matcher.matches_with(found, within) {
            keys.push(found.to_string());
        }
    }
    if keys.is_empty() {
        return Err(Error::NotFound {
            url: format!("{pattern} (no key matches)"),
            endpoint: endpoint.map_or_else(String::new, |e| format!(", endpoint {e}")),
        });
    }
    keys.sort();
    keys.iter()
        .map(|k| ObjectUrl::parse(&format!("s3://{}/{}", url.bucket(), percent_encode(k))))
        .collect()
}

/// `key` with the characters a URL's path cannot hold as they are (`%`, `?`, `#`, space and
/// controls) percent-encoded: [`ObjectUrl::parse`] decodes them back.
fn percent_encode(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        match b {
            b'%' | b'?' | b'#' | b' ' | 0..=0x1F | 0x7F..=0xFF => {
                out.push_str(&format!("%{b:02X}"));
            }
            _ => out.push(b as char),
        }
    }
    out
}

/// Runs the future `make` makes to completion on the I/O runtime. From a thread that is itself inside an async
/// runtime (a tokio task, `spawn_blocking`), it is made and run on a scoped thread of its own, where
/// blocking is allowed; the caller's thread waits for it.
pub(crate) fn block_on<M, F>(make: M) -> Result<F::Output>
where
    M: FnOnce() -> F + Send,
    F: Future,
    F::Output: Send,
{
    let rt = runtime()?;
    if tokio::runtime::Handle::try_current().is_err() {
        return Ok(rt.block_on(make()));
    }
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("gpufeed-object-call".into())
            .spawn_scoped(scope, || rt.block_on(make()))
            .map_err(|e| Error::Runtime(e.to_string()))?
            .join()
            .map_err(|_| Error::Runtime("a read's thread panicked".into()))
    })
}

#[cfg(test)]
mod tests {
    use super::{aligned_parts, refusal};

    #[test]
    fn gets_are_cut_at_the_objects_aligned_offsets() {
        // Aligned: whole steps, then the rest.
        assert_eq!(aligned_parts(0, 20, 8), [0..8, 8..16, 16..20]);
        assert_eq!(aligned_parts(16, 16, 8), [0..8, 8..16]);
        // Unaligned: up to the next boundary first, every later GET within one block.
        assert_eq!(aligned_parts(5, 20, 8), [0..3, 3..11, 11..19, 19..20]);
        assert_eq!(aligned_parts(5, 2, 8), [0..2, 2..2][..1]);
        assert_eq!(aligned_parts(7, 1, 8), [0..1, 1..1][..1]);
        assert_eq!(aligned_parts(3, 0, 8), []);
        // Steps of 1 (and a step of 0 taken as 1): a GET per byte.
        assert_eq!(aligned_parts(9, 3, 0), [0..1, 1..2, 2..3]);
        // Whatever the offset, the parts tile the read and none crosses a boundary.
        for offset in [0u64, 1, 4104, (8 << 20) - 1, 3 << 30] {
            for len in [1usize, 4095, 8 << 20, (8 << 20) + 1, 40 << 20] {
                let parts = aligned_parts(offset, len, 8 << 20);
                assert_eq!(parts.first().map(|r| r.start), Some(0));
                assert_eq!(parts.last().map(|r| r.end), Some(len));
                for (a, b) in parts.iter().zip(parts.iter().skip(1)) {
                    assert_eq!(a.end, b.start);
                }
                for r in &parts {
                    let (start, end) = (offset + r.start as u64, offset + r.end as u64 - 1);
                    assert!(!r.is_empty());
                    assert_eq!(start >> 23, end >> 23, "{offset} {len} {r:?}");
                }
            }
        }
    }

    /// An error answer after the retries (a 400 quoting the session token, a 503) keeps its
    /// status and code only: no token, no signature in the message.
    #[test]
    fn an_error_answer_shows_its_status_and_code_only() {
        let body = "Server returned non-2xx status code: 400 Bad Request: <Error><Code>InvalidToken\
                    </Code><Message>The provided token is malformed</Message><Token-0>FwoGZXIvYXdz\
                    SECRETTOKEN</Token-0><RequestId>1</RequestId></Error> X-Amz-Security-Token=\
                    SECRETTOKEN&Signature=abcdef";
        let e = super::store_error(
            "s3://b/k".into(),
            None,
            None,
            "GET bytes 0-9",
            object_store::Error::Generic {
                store: "S3",
                source: body.into(),
            },
        );
        let text = e.to_string();
        assert!(matches!(e, crate::Error::Answered { .. }), "{e:?}");
        assert_eq!(
            text,
            "s3://b/k: GET bytes 0-9 failed: the server answered HTTP 400, InvalidToken"
        );
        // A connection error (no answer) keeps the store's text.
        let e = super::store_error(
            "s3://b/k".into(),
            None,
            None,
            "HEAD",
            object_store::Error::Generic {
                store: "S3",
                source: "error sending request: connection refused".into(),
            },
        );
        assert!(e.to_string().contains("connection refused"), "{e}");
    }

    #[test]
    fn a_refusal_shows_its_status_and_code_only() {
        let aws = "Server returned non-2xx status code: 403 Forbidden: <?xml?><Error><Code>\
                   SignatureDoesNotMatch</Code><StringToSign>AWS4 x-amz-security-token:SECRET\
                   </StringToSign></Error>";
        assert_eq!(refusal(aws), "HTTP 403, SignatureDoesNotMatch");
        assert_eq!(refusal("status code: 401 Unauthorized: "), "HTTP 401");
        assert_eq!(
            refusal("<Code>x y</Code>"),
            "the server refused the request"
        );
        assert!(!refusal(aws).contains("SECRET"));
    }

    #[test]
    fn a_metadata_service_failure_is_missing_credentials() {
        let seen = "Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token \
                    in 2ms - Server returned non-2xx status code: 403 Forbidden";
        assert!(super::is_metadata_failure(seen));
        assert!(!super::is_metadata_failure(
            "Error performing GET http://127.0.0.1:9/b/k"
        ));
    }
}
