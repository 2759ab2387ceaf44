//! Table 14: objects in S3-compatible storage. A real server (SeaweedFS's `weed mini` on
//! 127.0.0.1, started here) holds one object of random bytes; beside gpufeed's reads, the
//! server's limit on this machine: the most bytes per second that parallel ranged GETs get
//! out of it, read by the same HTTP client and dropped unread.

use std::time::Instant;

use anyhow::{Context, Result};
use futures_util::StreamExt;
use gpufeed::object::{Credentials, Object, ObjectOptions};
use gpufeed_testkit::s3::{ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFs};
use object_store::ObjectStore;
use serde::Serialize;

use crate::util::{Samples, show_size};
use gpufeed::dataset::{
    BatchData, BatchLoader, BatchLoaderOptions, Order, Sampler, StreamOptions, StreamedShards,
};

/// The shards the object's bytes are cut into for the batch loader's rows.
const STREAM_SHARDS: usize = 8;
/// Their records: 1 MiB less 7 bytes (unaligned).
const STREAM_RECORD: usize = (1 << 20) - 7;

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
    /// `Loader::load_object` into GPU memory with `LoadOptions::for_objects` (GPU machine).
    pub gpu_gbps: Option<Samples>,
    /// The same with `LoadOptions::default` (the settings for files).
    pub gpu_file_options_gbps: Option<Samples>,
    /// The same with other fill threads and staging pieces (GPU machine): what the
    /// object loads' settings are chosen from.
    pub gpu_sweep: Vec<SweepRow>,
    /// Bytes of the checkpoint object (`checkpoint_tensors` F32 tensors of random bytes).
    pub checkpoint_bytes: u64,
    pub checkpoint_tensors: usize,
    /// `gpufeed_safetensors::load_object` of the checkpoint into GPU tensors (GPU machine).
    pub checkpoint_gpu_gbps: Option<Samples>,
    /// Host memory of the checkpoint's first load to the GPU, a loader made for it included:
    /// the process's peak RSS (reset before it) above its RSS before (bytes).
    pub checkpoint_peak_rss_growth: Option<u64>,
    /// The pinned staging that loader reserved (bytes).
    pub checkpoint_staging_bytes: Option<u64>,
    /// The object's bytes as `stream_shards` shards of records of `stream_record_bytes` in the
    /// bucket, streamed to a `BatchLoader` (`StreamedShards`, `Order::Shards`: shards in a
    /// shuffled order) under a cap of `stream_cap_bytes`: GB/s of records delivered as host
    /// batches, from the open (HEADs) to the epoch's end, the fetches included.
    pub stream_shards: usize,
    pub stream_record_bytes: usize,
    pub stream_cap_bytes: u64,
    pub stream_host_gbps: Option<Samples>,
    /// The same with GPU batches (GPU machine).
    pub stream_gpu_gbps: Option<Samples>,
    /// The most shard bytes held at once in those epochs.
    pub stream_peak_bytes: u64,
    /// The Python peers (`benches/peers/objects.py`, with `--peers`).
    pub peers: Vec<PeerRow>,
    /// Why rows are missing.
    pub notes: Vec<String>,
}

/// A `kB` field of `/proc/self/status` in bytes.
fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(kib << 10)
    })
}

/// `Loader::load_object` with `fill_threads` threads staging pieces of `chunk_bytes`
/// (`staging_buffers` of them in all).
#[derive(Debug, Serialize)]
pub struct SweepRow {
    pub fill_threads: usize,
    pub chunk_bytes: usize,
    pub staging_buffers: usize,
    /// Pinned staging the loader reserved.
    pub staging_bytes: u64,
    pub gbps: Samples,
}

/// The settings of the sweep: (fill threads, piece MiB, staging buffers per thread). In GPU run
/// 131 (a 4 GiB object, 5.88 GB/s limit) 8 x 16 MiB loaded at 5.83, 12 x 8 MiB at 5.67, 16 x
/// 4 MiB with 4 buffers each at 5.43, 24 x 4 MiB at 5.24, 8 x 8 MiB at 4.69, 16 x 8 MiB at
/// 4.50 and the file settings (16 x 4 MiB, 2 each) at 4.84: `LoadOptions::for_objects` took
/// the first.
const SWEEP: [(usize, usize, usize); 3] = [(12, 8, 2), (16, 4, 4), (8, 32, 2)];

/// One Python peer: GB/s of the first read of a fresh process (imports and set-up inside the
/// clock) and of a second read in it, or why it was not measured.
#[derive(Debug, Serialize)]
pub struct PeerRow {
    pub name: String,
    /// `object` (bytes to host) or `checkpoint` (tensors on the CPU).
    pub reads: String,
    pub fresh_gbps: Option<Samples>,
    pub again_gbps: Option<Samples>,
    pub error: Option<String>,
}

pub fn measure(
    bytes: u64,
    reps: usize,
    gpu: Option<&gpufeed::Gpu>,
    peers: bool,
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
        gpu_file_options_gbps: None,
        gpu_sweep: Vec::new(),
        checkpoint_bytes: 0,
        checkpoint_tensors: 0,
        checkpoint_gpu_gbps: None,
        checkpoint_peak_rss_growth: None,
        checkpoint_staging_bytes: None,
        stream_shards: STREAM_SHARDS,
        stream_record_bytes: STREAM_RECORD,
        stream_cap_bytes: 0,
        stream_host_gbps: None,
        stream_gpu_gbps: None,
        stream_peak_bytes: 0,
        peers: Vec::new(),
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
    // The same bytes as a checkpoint of 64 MiB F32 tensors (the last one shorter).
    let tensor_bytes = (64 << 20).min(data.len()).max(4);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .chunks(tensor_bytes)
        .filter(|c| c.len() >= 4)
        .enumerate()
        .map(|(i, c)| {
            let c = &c[..c.len() / 4 * 4];
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![c.len() / 4], c)
                    .expect("a whole number of F32 values");
            (format!("layer.{i:04}.weight"), view)
        })
        .collect();
    bench.checkpoint_tensors = views.len();
    let checkpoint = safetensors::serialize(views, None)?;
    bench.checkpoint_bytes = checkpoint.len() as u64;
    server
        .put("bench/model.safetensors", &checkpoint)
        .map_err(anyhow::Error::msg)?;
    drop(checkpoint);
    // The same bytes again as shards of records (a whole number of them each), and each
    // record's hash for the batches' check.
    let per_shard = (data.len() / STREAM_SHARDS / STREAM_RECORD).max(1);
    let shard_bytes = per_shard * STREAM_RECORD;
    let mut record_hashes = Vec::new();
    for s in 0..STREAM_SHARDS {
        let part = data
            .get(s * shard_bytes..(s + 1) * shard_bytes)
            .context("the object is too small for the streamed shards")?;
        server
            .put(&format!("bench/shards/part-{s}.bin"), part)
            .map_err(anyhow::Error::msg)?;
        record_hashes.extend(part.chunks(STREAM_RECORD).map(xxhash_rust::xxh3::xxh3_64));
    }
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
                    async move {
                        // Each body's chunks dropped as they arrive: no buffer of the range.
                        let opts = object_store::GetOptions {
                            range: Some(object_store::GetRange::Bounded(
                                at..(at + step).min(bytes),
                            )),
                            ..Default::default()
                        };
                        let mut body = store.get_opts(path, opts).await?.into_stream();
                        let mut n = 0u64;
                        while let Some(chunk) = body.next().await {
                            n += chunk?.len() as u64;
                        }
                        Ok::<u64, object_store::Error>(n)
                    }
                }))
                .buffer_unordered(opts.requests_in_flight);
            let mut got = 0u64;
            while let Some(n) = pending.next().await {
                got += n?;
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

    // Shards streamed to the batch loader: host batches, then (with a GPU) device batches.
    bench.stream_cap_bytes = 2 * shard_bytes as u64;
    let mut streamed = |gpu: Option<&gpufeed::Gpu>| -> Result<Samples> {
        let mut samples = Vec::new();
        for i in 0..reps + 1 {
            progress(&format!(
                "table 14: {STREAM_SHARDS} shards streamed to the batch loader ({})",
                if gpu.is_some() {
                    "GPU batches"
                } else {
                    "host batches"
                }
            ));
            let t = Instant::now();
            let sopts = StreamOptions::default()
                .with_record_bytes(STREAM_RECORD)
                .with_spool_bytes(bench.stream_cap_bytes)
                .with_object_options(opts.clone());
            let shards =
                StreamedShards::open(&[format!("s3://{BUCKET}/bench/shards/part-*.bin")], &sopts)?;
            let order = Order::Shards { seed: i as u64 };
            let cfg = BatchLoaderOptions::default().with_batch_size(per_shard.div_ceil(4));
            let mut loader = BatchLoader::new(shards, Sampler::new(order), cfg, gpu)?;
            let mut got = 0usize;
            for batch in loader.epoch(0)? {
                let batch = batch?;
                got += batch.indices.len();
                if let BatchData::Host(buf) = &batch.data {
                    for (k, &r) in batch.indices.iter().enumerate() {
                        let rec = &buf[batch.offsets[k]..batch.offsets[k + 1]];
                        anyhow::ensure!(
                            xxhash_rust::xxh3::xxh3_64(rec) == record_hashes[r],
                            "streamed shards: record {r} differs"
                        );
                    }
                }
            }
            let secs = t.elapsed().as_secs_f64();
            anyhow::ensure!(got == record_hashes.len(), "streamed shards: {got} records");
            if let gpufeed::dataset::Dataset::Streamed(s) = loader.dataset() {
                bench.stream_peak_bytes = bench.stream_peak_bytes.max(s.stats().peak_bytes);
            }
            if i > 0 {
                samples.push((got * STREAM_RECORD) as f64 / secs / 1e9);
            }
        }
        Ok(Samples::new(samples))
    };
    let host_stream = streamed(None)?;
    let gpu_stream = gpu.map(|g| streamed(Some(g))).transpose()?;
    bench.stream_host_gbps = Some(host_stream);
    bench.stream_gpu_gbps = gpu_stream;

    match gpu {
        Some(gpu) => {
            for (opts, row) in [
                (gpufeed::LoadOptions::for_objects(), &mut bench.gpu_gbps),
                (
                    gpufeed::LoadOptions::default(),
                    &mut bench.gpu_file_options_gbps,
                ),
            ] {
                let loader = gpufeed::Loader::for_bytes(gpu, opts, bytes)?;
                let on_gpu = gpu_loads(gpu, &loader, &object, reps, want, "GPU")?;
                *row = Some(on_gpu);
            }
            for (threads, mib, per_thread) in SWEEP {
                progress(&format!(
                    "table 14: object -> GPU with {threads} fill threads, {mib} MiB pieces"
                ));
                let mut lo = gpufeed::LoadOptions::default();
                lo.transfer = lo
                    .transfer
                    .with_fill_threads(threads)
                    .with_chunk_bytes(mib << 20)
                    .with_staging_buffers(per_thread * threads);
                let loader = gpufeed::Loader::for_bytes(gpu, lo, bytes)?;
                let what = format!("GPU ({threads} threads, {mib} MiB)");
                let samples = gpu_loads(gpu, &loader, &object, reps, want, &what)?;
                bench.gpu_sweep.push(SweepRow {
                    fill_threads: threads,
                    chunk_bytes: mib << 20,
                    staging_buffers: per_thread * threads,
                    staging_bytes: loader.setup().staging_bytes,
                    gbps: samples,
                });
            }
            let ckpt_url = format!("s3://{BUCKET}/bench/model.safetensors");
            // Host memory: the peak RSS reset (clear_refs 5), then a loader made for the
            // checkpoint and its first load; the growth is what both took at their peak.
            let rss_before = status_bytes("VmRSS");
            let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
            let loader = gpufeed::Loader::for_bytes(
                gpu,
                gpufeed::LoadOptions::for_objects(),
                bench.checkpoint_bytes,
            )?;
            bench.checkpoint_staging_bytes = Some(loader.setup().staging_bytes);
            let mut ckpt = Vec::new();
            for i in 0..reps + 1 {
                let t = Instant::now();
                let loaded = gpufeed::safetensors::load_object(&loader, &ckpt_url, &opts)?;
                if i == 0 {
                    bench.checkpoint_peak_rss_growth =
                        match (reset, rss_before, status_bytes("VmHWM")) {
                            (true, Some(before), Some(peak)) => Some(peak.saturating_sub(before)),
                            _ => None,
                        };
                }
                let secs = t.elapsed().as_secs_f64();
                anyhow::ensure!(
                    loaded.len() == bench.checkpoint_tensors,
                    "checkpoint: tensors"
                );
                if i > 0 {
                    ckpt.push(bench.checkpoint_bytes as f64 / secs / 1e9);
                }
            }
            bench.checkpoint_gpu_gbps = Some(Samples::new(ckpt));
        }
        None => bench
            .notes
            .push("object -> GPU not measured: no GPU here".into()),
    }
    if peers {
        progress("table 14: the Python peers on the same objects (fresh processes)");
        let out = std::process::Command::new("python3")
            .arg("benches/peers/objects.py")
            .args([
                reps.to_string(),
                "bench/object.bin".into(),
                "bench/model.safetensors".into(),
            ])
            .env("AWS_ENDPOINT_URL", &server.endpoint)
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env("AWS_REGION", "us-east-1")
            .env("GPUFEED_BENCH_BUCKET", BUCKET)
            .env("GPUFEED_BENCH_GPU", if gpu.is_some() { "1" } else { "0" })
            .env_remove("AWS_PROFILE")
            .env_remove("AWS_SESSION_TOKEN")
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
                let samples = |g: &serde_json::Value| {
                    g.as_array()
                        .map(|g| Samples::new(g.iter().filter_map(|x| x.as_f64()).collect()))
                };
                for (name, row) in v["rows"].as_object().into_iter().flatten() {
                    bench.peers.push(PeerRow {
                        name: name.clone(),
                        reads: row["reads"].as_str().unwrap_or("").to_string(),
                        fresh_gbps: samples(&row["fresh"]),
                        again_gbps: samples(&row["again"]),
                        error: row["error"].as_str().map(str::to_string),
                    });
                }
            }
            Ok(o) => bench.notes.push(format!(
                "peers not measured: {}",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("failed")
            )),
            Err(e) => bench
                .notes
                .push(format!("peers not measured: python3: {e}")),
        }
    } else {
        bench
            .notes
            .push("peers (boto3, obstore, Run:ai's Model Streamer): run with --peers".into());
    }
    Ok(bench)
}

/// GB/s of `reps` loads of `object` to the GPU by `loader`, after a first one whose bytes are
/// checked against `want` (its hash).
fn gpu_loads(
    gpu: &gpufeed::Gpu,
    loader: &gpufeed::Loader,
    object: &Object,
    reps: usize,
    want: u64,
    what: &str,
) -> Result<Samples> {
    let bytes = object.len();
    let mut samples = Vec::new();
    for i in 0..reps + 1 {
        let t = Instant::now();
        let (dev, _) = loader.load_object(object)?;
        let secs = t.elapsed().as_secs_f64();
        if i == 0 {
            let back = gpu.to_vec(&dev)?;
            anyhow::ensure!(
                xxhash_rust::xxh3::xxh3_64(&back) == want,
                "{what}: bytes differ"
            );
        } else {
            samples.push(bytes as f64 / secs / 1e9);
        }
    }
    Ok(Samples::new(samples))
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
    let mut lines = Vec::new();
    let row = |path: &str, g: &Option<Samples>| {
        g.as_ref().map(|g| {
            let of = limit.map_or("-".into(), |l| format!("{:.2}", g.median / l));
            format!("| {path} | {} | {of} |", g.show(2))
        })
    };
    lines.extend(row(
        "the server's limit (ranged GETs, bytes dropped)",
        &b.limit_gbps,
    ));
    lines.extend(row(
        "`Object::read_exact_at` -> host (buffer reused)",
        &b.host_gbps,
    ));
    lines.extend(row(
        "`Object::open` + `read_all` -> new host buffer",
        &b.host_first_gbps,
    ));
    lines.extend(row(
        "`Loader::load_object` -> GPU (`LoadOptions::for_objects`)",
        &b.gpu_gbps,
    ));
    lines.extend(row(
        "the same with `LoadOptions::default` (the settings for files)",
        &b.gpu_file_options_gbps,
    ));
    for r in &b.gpu_sweep {
        lines.extend(row(
            &format!(
                "`Loader::load_object` -> GPU, {} fill threads, {} pieces, {} staging",
                r.fill_threads,
                show_size(r.chunk_bytes as u64),
                show_size(r.staging_bytes)
            ),
            &Some(r.gbps.clone()),
        ));
    }
    lines.extend(row(
        &format!(
            "checkpoint ({} tensors, {}) -> GPU tensors: `safetensors::load_object` (`for_objects`)",
            b.checkpoint_tensors,
            show_size(b.checkpoint_bytes)
        ),
        &b.checkpoint_gpu_gbps,
    ));
    let streamed = |what: &str| {
        format!(
            "the object's bytes as {} shards in the bucket -> `BatchLoader` (`StreamedShards`, \
             shards shuffled, cap {}): {what}, from the open to the epoch's end",
            b.stream_shards,
            show_size(b.stream_cap_bytes)
        )
    };
    lines.extend(row(&streamed("host batches"), &b.stream_host_gbps));
    lines.extend(row(&streamed("GPU batches"), &b.stream_gpu_gbps));
    for p in &b.peers {
        let what = match p.reads.as_str() {
            "checkpoint" => "the checkpoint -> CPU tensors",
            "checkpoint-gpu" => "the checkpoint -> GPU tensors",
            _ => "the object -> host",
        };
        match &p.error {
            Some(e) => lines.push(format!("| peer: {} | not measured: {e} | - |", p.name)),
            None => {
                lines.extend(row(
                    &format!("peer: {} ({what}), fresh process", p.name),
                    &p.fresh_gbps,
                ));
                lines.extend(row(
                    &format!("peer: {} ({what}), read again", p.name),
                    &p.again_gbps,
                ));
            }
        }
    }
    for l in lines {
        let _ = writeln!(s, "{l}");
    }
    if let Some(growth) = b.checkpoint_peak_rss_growth {
        let _ = writeln!(
            s,
            "\nHost memory of the checkpoint's first load to the GPU (a loader made for it \
             included): peak RSS {} above the RSS before, for {} of tensors ({:.1}x the growth); \
             the loader's pinned staging {}.",
            show_size(growth),
            show_size(b.checkpoint_bytes),
            b.checkpoint_bytes as f64 / growth.max(1) as f64,
            b.checkpoint_staging_bytes.map_or("-".into(), show_size),
        );
    }
    if b.stream_host_gbps.is_some() {
        let _ = writeln!(
            s,
            "\nStreamed shards: records of {} B, every record's bytes checked in the host \
             batches; the most shard bytes held at once {} (cap {}).",
            b.stream_record_bytes,
            show_size(b.stream_peak_bytes),
            show_size(b.stream_cap_bytes)
        );
    }
    for n in &b.notes {
        let _ = writeln!(s, "\n{n}");
    }
}
