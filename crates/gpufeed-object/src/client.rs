//! The HTTP client of S3 stores: object_store's own client settings, but redirects are never
//! followed.
//!
//! object_store builds its reqwest client with reqwest's default redirect policy (up to 10
//! hops, to any host). reqwest drops `Authorization` when a redirect leaves the host, but not
//! `x-amz-security-token`: an S3 endpoint answering `307` with another host's `Location` had
//! a session's token sent there, and the bytes read from there. With no redirect followed, a
//! `3xx` answer is an error of the load ([`crate::Error::Answered`], which says what to set).
//! S3 itself redirects only to another region's endpoint, where a request signed for the
//! first would be refused anyway, so nothing that worked stops working. Plain `https://`
//! objects keep object_store's client: they carry no credentials, and hosts such as the
//! Hugging Face Hub answer with a redirect to their CDN.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use object_store::ClientConfigKey;
use object_store::ClientOptions;
use object_store::client::{HttpClient, HttpConnector};

/// Builds the client of an S3 store (and of its credential providers, which object_store
/// builds through the same connector with options of their own): the settings gpufeed gives
/// object_store (the timeouts, whether `http://` is allowed) read back from `options`, and
/// what object_store's client always has (HTTP/1.1, no compression, resolved addresses in a
/// varying order), with [`reqwest::redirect::Policy::none`].
///
/// gpufeed sets no other client option (its `ClientOptions` replace any that
/// `AmazonS3Builder::from_env` read), so nothing else is to be carried over.
#[derive(Debug, Default)]
pub(crate) struct NoRedirects;

impl HttpConnector for NoRedirects {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let duration = |key: ClientConfigKey| -> object_store::Result<Option<Duration>> {
            options
                .get_config_value(&key)
                .map(|v| humantime::parse_duration(&v).map_err(|e| generic(Box::new(e))))
                .transpose()
        };
        let allow_http = options
            .get_config_value(&ClientConfigKey::AllowHttp)
            .as_deref()
            == Some("true");
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("gpufeed/", env!("CARGO_PKG_VERSION")))
            .http1_only()
            // As object_store's: compression would hide the sizes the reads check.
            .no_gzip()
            .no_brotli()
            .no_zstd()
            .no_deflate()
            .dns_resolver(Arc::new(Rotating::default()))
            .redirect(reqwest::redirect::Policy::none())
            .https_only(!allow_http);
        if let Some(t) = duration(ClientConfigKey::Timeout)? {
            builder = builder.timeout(t);
        }
        if let Some(t) = duration(ClientConfigKey::ConnectTimeout)? {
            builder = builder.connect_timeout(t);
        }
        builder
            .build()
            .map(HttpClient::new)
            .map_err(|e| generic(Box::new(e)))
    }
}

fn generic(source: Box<dyn std::error::Error + Send + Sync>) -> object_store::Error {
    object_store::Error::Generic {
        store: "S3",
        source,
    }
}

/// The system resolver's addresses, each lookup starting one further along them, so that a
/// host with several addresses (AWS's endpoints have eight) gets connections spread over
/// them, as object_store's shuffling resolver does.
#[derive(Debug, Default)]
struct Rotating {
    lookups: AtomicUsize,
}

impl reqwest::dns::Resolve for Rotating {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        let turn = self.lookups.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            let lookup = tokio::task::spawn_blocking(move || {
                // Port 0: reqwest puts the URL's port in.
                (host.as_str(), 0)
                    .to_socket_addrs()
                    .map(|a| a.collect::<Vec<SocketAddr>>())
            });
            let mut addrs = lookup.await??;
            if !addrs.is_empty() {
                let n = addrs.len();
                addrs.rotate_left(turn % n);
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}
