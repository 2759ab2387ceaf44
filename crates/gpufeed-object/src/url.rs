//! Object URLs: `s3://bucket/key`, `http://host/path`, `https://host/path`.

use std::fmt;

use crate::error::{Error, Result};

/// Which kind of store an [`ObjectUrl`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Scheme {
    /// An S3 (or S3-compatible: MinIO, SeaweedFS, Ceph, R2) bucket.
    S3,
    /// A plain HTTP(S) server that answers range requests.
    Http,
}

/// A parsed object URL.
///
/// ```
/// use gpufeed_object::{ObjectUrl, Scheme};
/// let url = ObjectUrl::parse("s3://models/llama/model-00001.safetensors")?;
/// assert_eq!((url.scheme(), url.bucket(), url.key()), (Scheme::S3, "models", "llama/model-00001.safetensors"));
/// let web = ObjectUrl::parse("https://example.com:8443/data/shard-000.tar")?;
/// assert_eq!((web.scheme(), web.key()), (Scheme::Http, "data/shard-000.tar"));
/// assert!(ObjectUrl::parse("/local/file").is_err());
/// # Ok::<(), gpufeed_object::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectUrl {
    scheme: Scheme,
    /// The bucket (S3) or the origin `scheme://host[:port]` (HTTP).
    root: String,
    /// The key (S3) or the path without its leading `/` (HTTP), percent-decoded.
    key: String,
    text: String,
}

impl ObjectUrl {
    /// Parses `s3://bucket/key` (also `s3a://`), `http://host/path` or `https://host/path`.
    pub fn parse(text: &str) -> Result<ObjectUrl> {
        let bad = |reason: &str| Error::InvalidUrl {
            url: text.to_string(),
            reason: reason.to_string(),
        };
        // The URL parser drops leading and trailing white space and removes tabs and line
        // breaks anywhere: such a URL would read another object than the one written.
        if text.trim() != text || text.chars().any(char::is_control) {
            return Err(bad(
                "white space at its ends, or control characters (tabs, line breaks): write them \
                 percent-encoded (%20, %09) if the key has them",
            ));
        }
        let parsed = url::Url::parse(text).map_err(|e| bad(&e.to_string()))?;
        if !parsed.username().is_empty() || parsed.password().is_some() {
            // They would be echoed in every message and report, and not be used.
            return Err(Error::InvalidUrl {
                url: "<a URL with credentials in it>".into(),
                reason: "credentials in the URL are not supported: give them as \
                         AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or in the options"
                    .into(),
            });
        }
        let decoded = |path: &str| -> Result<String> {
            // One `/` separates the bucket or host from the key: `s3://b//k` names the key
            // `/k` (an empty first segment), not `k`.
            let raw = path.strip_prefix('/').unwrap_or(path);
            if raw.starts_with('/') {
                return Err(bad(
                    "two slashes after the bucket or host: the key would start with '/'",
                ));
            }
            let key = percent_decode(raw).ok_or_else(|| bad("its path is not UTF-8"))?;
            if key.is_empty() || key.ends_with('/') {
                return Err(bad("it names no object (a bucket or folder, not a key)"));
            }
            // Keys as the store takes them: no empty, "." or ".." segments, no control
            // characters.
            object_store::path::Path::parse(&key).map_err(|e| bad(&e.to_string()))?;
            Ok(key)
        };
        match parsed.scheme() {
            "s3" | "s3a" => {
                let bucket = parsed
                    .host_str()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| bad("no bucket"))?;
                if parsed.query().is_some() || parsed.fragment().is_some() {
                    return Err(bad("an s3:// URL takes no query or fragment"));
                }
                if parsed.port().is_some() {
                    return Err(bad(
                        "an s3:// URL takes no port (the endpoint does: AWS_ENDPOINT_URL or \
                         ObjectOptions::with_endpoint)",
                    ));
                }
                Ok(ObjectUrl {
                    scheme: Scheme::S3,
                    root: bucket.to_string(),
                    key: decoded(parsed.path())?,
                    text: text.to_string(),
                })
            }
            "http" | "https" => {
                if parsed.host_str().is_none_or(str::is_empty) {
                    return Err(bad("no host"));
                }
                if parsed.query().is_some() {
                    return Err(bad("queries are not supported (a signed URL, say)"));
                }
                Ok(ObjectUrl {
                    scheme: Scheme::Http,
                    root: parsed.origin().ascii_serialization(),
                    key: decoded(parsed.path())?,
                    text: text.to_string(),
                })
            }
            other => Err(bad(&format!(
                "the scheme {other}:// is not an object store"
            ))),
        }
    }

    /// Whether `text` looks like an object URL (`s3://`, `s3a://`, `http://`, `https://`), so
    /// that a caller taking paths or URLs knows which it was given.
    pub fn is_url(text: &str) -> bool {
        // Bytes, not `str` slices: a path's first bytes may end inside a character.
        let text = text.as_bytes();
        ["s3://", "s3a://", "http://", "https://"]
            .iter()
            .any(|p| text.len() > p.len() && text[..p.len()].eq_ignore_ascii_case(p.as_bytes()))
    }

    /// The kind of store.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The bucket (S3), or the origin `scheme://host[:port]` (HTTP).
    pub fn bucket(&self) -> &str {
        &self.root
    }

    /// The object's key (S3), or its path without the leading `/` (HTTP).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The URL as given.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for ObjectUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for ObjectUrl {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        ObjectUrl::parse(s)
    }
}

/// `%XX` sequences decoded; `None` where the result is not UTF-8 or a `%` is malformed.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_their_parts() {
        let u = ObjectUrl::parse("s3://b-1/a%20b/c.bin").unwrap();
        assert_eq!((u.bucket(), u.key()), ("b-1", "a b/c.bin"));
        assert_eq!(u.to_string(), "s3://b-1/a%20b/c.bin");
        let u = ObjectUrl::parse("s3a://bucket/k").unwrap();
        assert_eq!(u.scheme(), Scheme::S3);
        let u = ObjectUrl::parse("http://127.0.0.1:9000/x/y").unwrap();
        assert_eq!((u.bucket(), u.key()), ("http://127.0.0.1:9000", "x/y"));
        for bad in [
            "s3://bucket",
            "s3://bucket/",
            "s3://bucket/dir/",
            "s3:///key",
            "ftp://host/file",
            "relative/path",
            "https://host/f?X-Amz-Signature=1",
            "s3://bucket/%ff",
            "s3://bucket/%zz",
        ] {
            let e = ObjectUrl::parse(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidUrl { .. }), "{bad}: {e}");
            assert!(e.to_string().contains(bad), "{e}");
        }
        assert!(ObjectUrl::is_url("S3://b/k") && ObjectUrl::is_url("https://h/p"));
        assert!(!ObjectUrl::is_url("/tmp/s3://x") && !ObjectUrl::is_url("s3://"));
        // A local path whose first bytes end inside a character is no URL (and no panic).
        for local in ["/tmp/日本.bin", "/données/m.safetensors", "é", "ñs3://x"] {
            assert!(!ObjectUrl::is_url(local), "{local}");
        }
        // Keys with the characters S3 allows but URLs escape.
        let u = ObjectUrl::parse("s3://b/~user/a%5B1%5D%2550.bin").unwrap();
        assert_eq!(u.key(), "~user/a[1]%50.bin");
        // (The URL parser itself folds "a/../c" into "c", as URLs do.)
        for bad in ["s3://b/a//c", "s3://b/a/%00/c"] {
            assert!(ObjectUrl::parse(bad).is_err(), "{bad}");
        }
        // What the URL parser would fold into another key is refused: white space at the
        // ends, tabs and line breaks anywhere, a second `/` after the bucket; so is a port on
        // an s3:// URL (the endpoint has it). A space inside a key is the key's.
        for bad in [
            "s3://b/k.bin ",
            " s3://b/k.bin",
            "s3://b/k.b\tin",
            "s3://b/k\n.bin",
            "s3://b//k.bin",
            "https://h//k.bin",
            "s3://b:1234/k",
        ] {
            let e = ObjectUrl::parse(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidUrl { .. }), "{bad:?}: {e}");
        }
        assert_eq!(
            ObjectUrl::parse("s3://b/my key.bin").unwrap().key(),
            "my key.bin"
        );
        assert_eq!(
            ObjectUrl::parse("http://127.0.0.1:9000/x")
                .unwrap()
                .bucket(),
            "http://127.0.0.1:9000"
        );
        // Credentials in a URL: refused, and not echoed.
        let e = ObjectUrl::parse("https://alice:s3cr3t@host/file").unwrap_err();
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
    }
}
