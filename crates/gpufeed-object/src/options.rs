//! How objects are read, and where credentials and the endpoint come from.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use object_store::aws::AmazonS3Builder;
use object_store::http::HttpBuilder;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};

use crate::error::{Error, Result};
use crate::url::{ObjectUrl, Scheme};

/// Settings of object reads: start from the default and change what you need (new settings
/// may be added).
///
/// Credentials, region and endpoint come the standard way unless set here:
/// `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, `AWS_REGION` (or
/// `AWS_DEFAULT_REGION`), `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`, for S3-compatible
/// servers, addressed path-style), and where no key is in the environment the profile
/// `AWS_PROFILE` (default `default`) of `~/.aws/credentials` and `~/.aws/config`
/// (`AWS_SHARED_CREDENTIALS_FILE`, `AWS_CONFIG_FILE`). An `http://` endpoint is allowed as
/// given.
///
/// ```
/// let opts = gpufeed_object::ObjectOptions::default()
///     .with_endpoint("http://127.0.0.1:8333")
///     .with_requests_in_flight(32);
/// assert_eq!(opts.requests_in_flight, 32);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObjectOptions {
    /// The S3 endpoint (`http://127.0.0.1:8333`); `None`: the environment's, else AWS.
    pub endpoint: Option<String>,
    /// The region; `None`: the environment's or the profile's, else `us-east-1`.
    pub region: Option<String>,
    /// Ranged GETs in flight at once per read (default 16).
    pub requests_in_flight: usize,
    /// Bytes per ranged GET (default 8 MiB): large enough that a request's latency is small
    /// beside its transfer, small enough that a read of a few hundred MiB has many in flight.
    /// [`Object::read_exact_at`](crate::Object::read_exact_at) cuts its GETs at the object's
    /// multiples of it, so each stays within one such block
    /// ([`Object::read_ahead`](crate::Object::read_ahead)'s blocks start at its range's
    /// start).
    pub request_bytes: usize,
    /// Retries of a failed request (5xx, throttling, reset or refused connections, a body cut
    /// short), with exponential backoff from 50 ms (default 5).
    pub retries: usize,
    /// The longest a request, with its retries, may take before it is an error (default 60
    /// s).
    pub timeout: Duration,
    /// The longest a connection may take to open (default 5 s).
    pub connect_timeout: Duration,
    /// Credentials to use; `None`: the environment's or the profile's. Given, nothing is
    /// taken from the environment but what the other settings leave unset (the endpoint and
    /// region, from `AWS_ENDPOINT_URL` and `AWS_REGION`).
    pub credentials: Option<Credentials>,
}

/// The stores of this process ([`ObjectOptions::store`]): a forked child (a Python DataLoader
/// worker) has its own, since the parent's connections belong to the parent's I/O runtime,
/// whose threads it does not have.
static STORES: Mutex<Option<Stores>> = Mutex::new(None);

/// How many stores [`Stores::recent`] keeps.
const RECENT_STORES: usize = 8;

struct Stores {
    /// The process they belong to.
    pid: u32,
    /// The stores objects use now, by everything that built them.
    by_key: BTreeMap<String, Weak<dyn ObjectStore>>,
    /// The stores used last, the most recent at the back, kept while no object holds them: a
    /// checkpoint loaded again, or one object read after another was let go, finds the store
    /// and its open connections instead of building a new one (an open that built its store
    /// took 5-9 ms to its `HEAD`'s answer on a local server, GPU runs 236-237; over TLS each
    /// new connection adds a handshake).
    recent: VecDeque<Arc<dyn ObjectStore>>,
}

impl Stores {
    /// This process's stores: a parent's, inherited by a fork, are forgotten (dropping them
    /// would reach for the parent's runtime).
    fn of_this_process(slot: &mut Option<Stores>) -> &mut Stores {
        let pid = std::process::id();
        if slot.as_ref().is_some_and(|s| s.pid != pid)
            && let Some(Stores { recent, .. }) = slot.take()
        {
            std::mem::forget(recent);
        }
        slot.get_or_insert_with(|| Stores {
            pid,
            by_key: BTreeMap::new(),
            recent: VecDeque::new(),
        })
    }

    /// `store` made the most recently used, the oldest let go past [`RECENT_STORES`].
    fn keep_recent(&mut self, store: &Arc<dyn ObjectStore>) {
        self.recent.retain(|s| !Arc::ptr_eq(s, store));
        self.recent.push_back(Arc::clone(store));
        while self.recent.len() > RECENT_STORES {
            self.recent.pop_front();
        }
    }
}

/// An access key, its secret and, for temporary credentials, a session token (`Debug`
/// shows only the key id).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// `AWS_ACCESS_KEY_ID`.
    pub key_id: String,
    /// `AWS_SECRET_ACCESS_KEY`.
    pub secret: String,
    /// `AWS_SESSION_TOKEN`.
    pub token: Option<String>,
}

impl Credentials {
    /// A key and its secret.
    pub fn new(key_id: impl Into<String>, secret: impl Into<String>) -> Credentials {
        Credentials {
            key_id: key_id.into(),
            secret: secret.into(),
            token: None,
        }
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("key_id", &self.key_id)
            .field("secret", &"<redacted>")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Default for ObjectOptions {
    fn default() -> Self {
        ObjectOptions {
            endpoint: None,
            region: None,
            requests_in_flight: 16,
            request_bytes: 8 << 20,
            retries: 5,
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            credentials: None,
        }
    }
}

impl ObjectOptions {
    /// With this S3 endpoint.
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }
    /// With this region.
    pub fn with_region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }
    /// With this many ranged GETs in flight per read.
    pub fn with_requests_in_flight(mut self, n: usize) -> Self {
        self.requests_in_flight = n;
        self
    }
    /// With ranged GETs of this many bytes.
    pub fn with_request_bytes(mut self, bytes: usize) -> Self {
        self.request_bytes = bytes;
        self
    }
    /// With this many retries per request.
    pub fn with_retries(mut self, retries: usize) -> Self {
        self.retries = retries;
        self
    }
    /// With this limit on a request and its retries.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
    /// With these credentials (the environment's and the profile's are not read).
    pub fn with_credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = Some(credentials);
        self
    }
    /// With this limit on opening a connection.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.requests_in_flight == 0 || self.request_bytes == 0 {
            return Err(Error::InvalidSetting(format!(
                "requests_in_flight ({}) and request_bytes ({}) must be at least 1",
                self.requests_in_flight, self.request_bytes
            )));
        }
        if self.timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::InvalidSetting(
                "timeout and connect_timeout must be more than zero".into(),
            ));
        }
        Ok(())
    }

    /// The S3 endpoint `url` is read from: this one, else the environment's, else the
    /// profile's (`None`: AWS's own, or a plain HTTP(S) URL).
    pub(crate) fn endpoint_for(&self, url: &ObjectUrl) -> Option<String> {
        if url.scheme() == Scheme::Http {
            return None;
        }
        self.endpoint
            .clone()
            .or_else(|| {
                ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
                    .iter()
                    .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
            })
            .or_else(|| Profile::from_env().setting("endpoint_url"))
    }

    /// The store that serves `url`: the one already built for the same bucket (or HTTP
    /// origin), endpoint, region, credentials, limits and `AWS_*` environment while any object
    /// still holds it or it is among the eight stores used last, so objects opened one after
    /// another (a data set's thousands of shards, a checkpoint loaded again) share its
    /// connections and credential lookups instead of each opening its own. Any difference in
    /// those inputs builds another: a store never serves other credentials than the ones it
    /// was built with, nor a forked child its parent's connections.
    pub(crate) fn store(&self, url: &ObjectUrl) -> Result<Arc<dyn ObjectStore>> {
        self.check()?;
        let profile = Profile::from_env();
        let key = self.store_key(url, &profile);
        let mut slot = STORES.lock();
        let stores = Stores::of_this_process(&mut slot);
        let store = match stores.by_key.get(&key).and_then(Weak::upgrade) {
            Some(store) => store,
            None => {
                let store = self.build_store(url, &profile)?;
                stores.by_key.retain(|_, s| s.strong_count() > 0);
                stores.by_key.insert(key, Arc::downgrade(&store));
                store
            }
        };
        stores.keep_recent(&store);
        Ok(store)
    }

    /// Everything [`ObjectOptions::build_store`] reads, as one exact string (secrets
    /// included: it never leaves the process's memory, where the store holds them anyway).
    fn store_key(&self, url: &ObjectUrl, profile: &Profile) -> String {
        let mut env: Vec<(String, String)> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .filter(|(k, _)| k.starts_with("AWS_"))
            .collect();
        env.sort();
        format!(
            "{:?}\0{}\0{:?}\0{:?}\0{:?}\0{}\0{:?}\0{:?}\0{:?}\0{:?}\0{:?}\0{:?}",
            url.scheme(),
            url.bucket(),
            self.endpoint_for(url),
            self.region,
            self.credentials
                .as_ref()
                .map(|c| (&c.key_id, &c.secret, &c.token)),
            self.retries,
            self.timeout,
            self.connect_timeout,
            env,
            profile.credentials(),
            profile.setting("region"),
            profile.setting("endpoint_url"),
        )
    }

    /// A new store for `url`, with `profile` (the shared AWS files' section, read once by
    /// [`ObjectOptions::store`]).
    fn build_store(&self, url: &ObjectUrl, profile: &Profile) -> Result<Arc<dyn ObjectStore>> {
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(5),
                base: 2.0,
            },
            max_retries: self.retries,
            retry_timeout: self.timeout,
        };
        let endpoint = self
            .endpoint_for(url)
            .map(|e| checked_endpoint(&e))
            .transpose()?;
        let client = ClientOptions::new()
            .with_timeout(self.timeout)
            .with_connect_timeout(self.connect_timeout)
            .with_allow_http(
                url.scheme() == Scheme::Http
                    || endpoint
                        .as_deref()
                        .is_some_and(|e| e.starts_with("http://")),
            );
        let built = match url.scheme() {
            Scheme::Http => HttpBuilder::new()
                .with_url(url.bucket())
                .with_retry(retry)
                .with_client_options(client)
                .build()
                .map(|s| Arc::new(s) as Arc<dyn ObjectStore>),
            Scheme::S3 => {
                let given = self.credentials.clone().or_else(|| {
                    // The profile's, where the environment has no key.
                    std::env::var_os("AWS_ACCESS_KEY_ID")
                        .is_none()
                        .then(|| profile.credentials())
                        .flatten()
                        .map(|(key_id, secret, token)| Credentials {
                            key_id,
                            secret,
                            token,
                        })
                });
                let base = if self.credentials.is_some() {
                    AmazonS3Builder::new()
                } else {
                    AmazonS3Builder::from_env()
                };
                let mut b = base
                    .with_bucket_name(url.bucket())
                    .with_retry(retry)
                    .with_client_options(client)
                    .with_http_connector(crate::client::NoRedirects)
                    .with_virtual_hosted_style_request(false);
                if let Some(c) = given {
                    b = b
                        .with_access_key_id(c.key_id)
                        .with_secret_access_key(c.secret);
                    if let Some(token) = c.token {
                        b = b.with_token(token);
                    }
                }
                let region = self.region.clone().or_else(|| {
                    ["AWS_REGION", "AWS_DEFAULT_REGION"]
                        .iter()
                        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
                        .or_else(|| profile.setting("region"))
                });
                b = b.with_region(region.unwrap_or_else(|| "us-east-1".into()));
                if let Some(e) = endpoint {
                    b = b.with_endpoint(e);
                }
                b.build().map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
            }
        };
        built.map_err(|e| Error::InvalidSetting(format!("{url}: {e}")))
    }
}

/// An endpoint as the store takes it: an `http://` or `https://` URL (any case) with a host,
/// normalized (the scheme in lower case, no trailing `/`); anything else is
/// [`Error::InvalidSetting`] (the S3 client panicked on an endpoint without a scheme).
fn checked_endpoint(endpoint: &str) -> Result<String> {
    let bad = || {
        Error::InvalidSetting(format!(
            "endpoint {endpoint:?} (ObjectOptions::with_endpoint, AWS_ENDPOINT_URL or the \
             profile's endpoint_url) is not an http:// or https:// URL with a host: write it as \
             http://host:port"
        ))
    };
    let parsed = url::Url::parse(endpoint.trim()).map_err(|_| bad())?;
    if !parsed.username().is_empty() || parsed.password().is_some() {
        // They would be echoed in messages, and not be used.
        return Err(Error::InvalidSetting(
            "an endpoint with credentials in it (user:password@) is not supported: give them \
             as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or in the options"
                .into(),
        ));
    }
    if !matches!(parsed.scheme(), "http" | "https")
        || parsed.host_str().is_none_or(str::is_empty)
        || parsed.query().is_some()
        || parsed.fragment().is_some()
    {
        return Err(bad());
    }
    Ok(parsed.as_str().trim_end_matches('/').to_owned())
}

/// The profile's sections of the shared credentials and config files.
pub(crate) struct Profile {
    name: String,
    credentials: Option<PathBuf>,
    config: Option<PathBuf>,
}

impl Profile {
    /// `AWS_PROFILE` (default `default`) in `AWS_SHARED_CREDENTIALS_FILE` (default
    /// `~/.aws/credentials`) and `AWS_CONFIG_FILE` (default `~/.aws/config`).
    pub(crate) fn from_env() -> Profile {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let file = |var: &str, name: &str| {
            std::env::var_os(var)
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
        };
        Profile {
            name: std::env::var("AWS_PROFILE")
                .ok()
                .filter(|p| !p.is_empty())
                .unwrap_or_else(|| "default".into()),
            credentials: file("AWS_SHARED_CREDENTIALS_FILE", "credentials"),
            config: file("AWS_CONFIG_FILE", "config"),
        }
    }

    /// The key id, secret and session token of the profile, where its section has the first
    /// two (in the credentials file, else the config file).
    pub(crate) fn credentials(&self) -> Option<(String, String, Option<String>)> {
        let get = |k: &str| self.lookup(k, true).or_else(|| self.lookup(k, false));
        Some((
            get("aws_access_key_id")?,
            get("aws_secret_access_key")?,
            get("aws_session_token"),
        ))
    }

    /// A setting (`region`, `endpoint_url`) of the profile in the config file.
    pub(crate) fn setting(&self, key: &str) -> Option<String> {
        self.lookup(key, false)
    }

    fn lookup(&self, key: &str, in_credentials: bool) -> Option<String> {
        let (path, section) = if in_credentials {
            (self.credentials.as_deref()?, self.name.clone())
        } else if self.name == "default" {
            (self.config.as_deref()?, "default".to_string())
        } else {
            (self.config.as_deref()?, format!("profile {}", self.name))
        };
        ini_value(&std::fs::read_to_string(path).ok()?, &section, key)
            .or_else(|| fallback_section(path, &self.name, in_credentials, key))
    }
}

/// The config file also accepts a bare `[name]` section for the profile.
fn fallback_section(path: &Path, name: &str, in_credentials: bool, key: &str) -> Option<String> {
    if in_credentials || name == "default" {
        return None;
    }
    ini_value(&std::fs::read_to_string(path).ok()?, name, key)
}

/// `key = value` in `[section]` of an INI text (the AWS files' format: `#`/`;` comments,
/// whitespace around names and values).
pub(crate) fn ini_value(text: &str, section: &str, key: &str) -> Option<String> {
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            continue;
        }
        if !inside {
            continue;
        }
        if let Some((k, v)) = line.split_once('=')
            && k.trim() == key
        {
            return Some(v.trim().to_string()).filter(|v| !v.is_empty());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Endpoints without a scheme or host are refused with what to write (the S3 client
    /// panicked on them); the scheme's case does not matter.
    #[test]
    fn endpoints_are_checked_and_normalized() {
        for bad in [
            "127.0.0.1:8333",
            "not a url",
            "ftp://host",
            "http://",
            "",
            "http://h?x=1",
        ] {
            let e = checked_endpoint(bad).expect_err(bad);
            assert!(e.to_string().contains("http://host:port"), "{bad}: {e}");
        }
        assert_eq!(
            checked_endpoint("HTTP://127.0.0.1:8333/").expect("upper case"),
            "http://127.0.0.1:8333"
        );
        assert_eq!(
            checked_endpoint("https://s3.example.com/prefix").expect("a path"),
            "https://s3.example.com/prefix"
        );
        let e = checked_endpoint("http://alice:s3cr3t@host:1").expect_err("credentials");
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
        // Through a store: an error, not a panic.
        let opts = ObjectOptions::default().with_endpoint("127.0.0.1:8333");
        let url = crate::ObjectUrl::parse("s3://b/k").expect("url");
        assert!(matches!(opts.store(&url), Err(Error::InvalidSetting(_))));
    }

    #[test]
    fn ini_sections_and_keys() {
        let text = "# c\n[default]\naws_access_key_id = AK\n aws_secret_access_key=SK \n\n\
                    [profile other]\nregion = eu-west-1\n; c\nendpoint_url = http://h:1\n[x]\n";
        assert_eq!(
            ini_value(text, "default", "aws_access_key_id").as_deref(),
            Some("AK")
        );
        assert_eq!(
            ini_value(text, "default", "aws_secret_access_key").as_deref(),
            Some("SK")
        );
        assert_eq!(ini_value(text, "default", "region"), None);
        assert_eq!(
            ini_value(text, "profile other", "region").as_deref(),
            Some("eu-west-1")
        );
        assert_eq!(
            ini_value(text, "profile other", "endpoint_url").as_deref(),
            Some("http://h:1")
        );
        assert_eq!(ini_value(text, "x", "region"), None);
        assert_eq!(ini_value(text, "missing", "region"), None);
    }

    #[test]
    fn profiles_from_the_shared_files() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        let config = dir.path().join("config");
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id=D\naws_secret_access_key=DS\n\
             [job]\naws_access_key_id=J\naws_secret_access_key=JS\naws_session_token=T\n",
        )
        .unwrap();
        std::fs::write(&config, "[default]\nregion=r0\n[profile job]\nregion=r1\n").unwrap();
        let profile = |name: &str| Profile {
            name: name.into(),
            credentials: Some(creds.clone()),
            config: Some(config.clone()),
        };
        assert_eq!(
            profile("default").credentials(),
            Some(("D".into(), "DS".into(), None))
        );
        assert_eq!(
            profile("job").credentials(),
            Some(("J".into(), "JS".into(), Some("T".into())))
        );
        assert_eq!(profile("default").setting("region").as_deref(), Some("r0"));
        assert_eq!(profile("job").setting("region").as_deref(), Some("r1"));
        assert_eq!(profile("nobody").credentials(), None);
    }

    #[test]
    fn settings_that_cannot_work_are_refused() {
        for bad in [
            ObjectOptions::default().with_requests_in_flight(0),
            ObjectOptions::default().with_request_bytes(0),
            ObjectOptions::default().with_timeout(Duration::ZERO),
        ] {
            assert!(matches!(bad.check(), Err(Error::InvalidSetting(_))));
        }
        ObjectOptions::default().check().unwrap();
    }
}
