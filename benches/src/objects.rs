//! Table 14: objects in S3-compatible storage. A real server (SeaweedFS's `weed mini` on
//! 127.0.0.1, started here) holds one object of random bytes; beside gpufeed's reads, the
//! server's limit on this machine: the most bytes per second that parallel ranged GETs get
//! out of it, read by the same HTTP client and dropped unread.

use std::time::Instant;

use anyhow::{Context, Result};
use futures_util::StreamExt;
use gpufeed::object::{Credentials, Object, ObjectOptions};
use gpufeed_testkit::s3::{ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFs};
use object_store::ObjectStoreExt;
use serde::Serialize;

use crate::util::{Samples, show_size};

#[derive(Debug, Serialize)]
pub struct ObjectsBench {
    pub server: String,
    pub object_bytes: u64,
    pub request_bytes: usize,
    pub requests_in_flight: usize,
    /// The server's limit: ranged GETs with as many in flight, bytes dropped (GB/s).
    pub limit_gbps: Option<Samples>,
    /// `Object::read_exact_at` of the whole object into a buffer reused across repetitions.
    pub host_gbps: Option<Samples>,
    /// `Object::open` and a read into a new buffer, each repetition.
    pub host_first_gbps: Option<Samples>,
    /// `Loader::load_object` into GPU memory (GPU machine).
    pub gpu_gbps: Option<Samples>,
    /// Why rows are missing.
    pub notes: Vec<String>,
}

pub fn measure(
    bytes: u64,
    reps: usize,
    gpu: Option<&gpufeed::Gpu>,
    progress: impl Fn(&str),
) -> Result<ObjectsBench> {
    let opts = ObjectOptions::default();
    let mut bench = ObjectsBench {
        server: "SeaweedFS weed mini on 127.0.0.1".into(),
        object_bytes: bytes,
        request_bytes: opts.request_bytes,
        requests_in_flight: opts.requests_in_flight,
        limit_gbps: None,
        host_gbps: None,
        host_first_gbps: None,
        gpu_gbps: None,
        notes: Vec::new(),
    };
    let server = match SeaweedFs::start() {
        Ok(s) => s,
        Err(why) => {
            bench.notes.push(format!("not measured: {why}"));
            return Ok(bench);
        }
    };
    progress(&format!(
        "table 14: {} object into {}",
        show_size(bytes),
        server.endpoint
    ));
    let mut data = vec![0u8; bytes as usize];
    crate::util::SplitMix(0x0B1E).fill(&mut data);
    server
        .put("bench/object.bin", &data)
        .map_err(anyhow::Error::msg)?;
    drop(data);
    let url = format!("s3://{BUCKET}/bench/object.bin");
    let opts = opts
        .with_endpoint(&server.endpoint)
        .with_region("us-east-1")
        .with_credentials(Credentials::new(ACCESS_KEY, SECRET_KEY));
    let object = Object::open(&url, &opts).context("open the object")?;
    let gbps = |secs: f64| bytes as f64 / secs / 1e9;

    // The limit: the same client, the same requests, nothing written anywhere.
    let store = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&server.endpoint)
        .with_allow_http(true)
        .with_bucket_name(BUCKET)
        .with_region("us-east-1")
        .with_access_key_id(ACCESS_KEY)
        .with_secret_access_key(SECRET_KEY)
        .build()?;
    let rt = tokio::runtime::Runtime::new()?;
    let path = object_store::path::Path::from("bench/object.bin");
    let step = opts.request_bytes as u64;
    let mut limit = Vec::new();
    for _ in 0..reps + 1 {
        let t = Instant::now();
        let got: u64 = rt.block_on(async {
            let mut pending =
                futures_util::stream::iter((0..bytes).step_by(step as usize).map(|at| {
                    let (store, path) = (&store, &path);
                    async move { store.get_range(path, at..(at + step).min(bytes)).await }
                }))
                .buffer_unordered(opts.requests_in_flight);
            let mut got = 0u64;
            while let Some(b) = pending.next().await {
                got += b?.len() as u64;
            }
            Ok::<u64, object_store::Error>(got)
        })?;
        anyhow::ensure!(got == bytes, "the limit's loop read {got} of {bytes} bytes");
        limit.push(gbps(t.elapsed().as_secs_f64()));
    }
    limit.remove(0);
    bench.limit_gbps = Some(Samples::new(limit));

    let want = xxhash_rust::xxh3::xxh3_64(&object.read_all()?);
    let mut buf = vec![0u8; bytes as usize];
    let mut host = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        object.read_exact_at(0, &mut buf)?;
        host.push(gbps(t.elapsed().as_secs_f64()));
        anyhow::ensure!(
            xxhash_rust::xxh3::xxh3_64(&buf) == want,
            "host read: bytes differ"
        );
    }
    bench.host_gbps = Some(Samples::new(host));
    drop(buf);
    let mut first = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let o = Object::open(&url, &opts)?;
        let all = o.read_all()?;
        first.push(gbps(t.elapsed().as_secs_f64()));
        anyhow::ensure!(
            xxhash_rust::xxh3::xxh3_64(&all) == want,
            "first read: bytes differ"
        );
    }
    bench.host_first_gbps = Some(Samples::new(first));

    match gpu {
        Some(gpu) => {
            let loader = gpufeed::Loader::for_bytes(gpu, gpufeed::LoadOptions::default(), bytes)?;
            let mut on_gpu = Vec::new();
            for i in 0..reps + 1 {
                let t = Instant::now();
                let (dev, _) = loader.load_object(&object)?;
                let secs = t.elapsed().as_secs_f64();
                if i == 0 {
                    let back = gpu.to_vec(&dev)?;
                    anyhow::ensure!(
                        xxhash_rust::xxh3::xxh3_64(&back) == want,
                        "GPU: bytes differ"
                    );
                } else {
                    on_gpu.push(gbps(secs));
                }
            }
            bench.gpu_gbps = Some(Samples::new(on_gpu));
        }
        None => bench
            .notes
            .push("object -> GPU not measured: no GPU here".into()),
    }
    bench.notes.push(
        "peers (Run:ai's Model Streamer, boto3, obstore) and a checkpoint from the bucket: not \
         measured yet"
            .into(),
    );
    Ok(bench)
}

pub fn table(s: &mut String, b: &ObjectsBench) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\n## Table 14 — objects in S3-compatible storage\n\n\
         One {} object of random bytes on a {}; ranged GETs of {} with {} in flight (the \
         defaults). GB/s; the limit is the same client's parallel ranged GETs with the bytes \
         dropped.\n\n| path | GB/s | of the limit |\n|---|---|---|",
        show_size(b.object_bytes),
        b.server,
        show_size(b.request_bytes as u64),
        b.requests_in_flight
    );
    let limit = b.limit_gbps.as_ref().map(|l| l.median);
    let mut row = |path: &str, g: &Option<Samples>| {
        if let Some(g) = g {
            let of = limit.map_or("-".into(), |l| format!("{:.2}", g.median / l));
            let _ = writeln!(s, "| {path} | {} | {of} |", g.show(2));
        }
    };
    row(
        "the server's limit (ranged GETs, bytes dropped)",
        &b.limit_gbps,
    );
    row(
        "`Object::read_exact_at` -> host (buffer reused)",
        &b.host_gbps,
    );
    row(
        "`Object::open` + `read_all` -> new host buffer",
        &b.host_first_gbps,
    );
    row("`Loader::load_object` -> GPU", &b.gpu_gbps);
    for n in &b.notes {
        let _ = writeln!(s, "\n{n}");
    }
}
