//! Shards streamed from a real S3 server (SeaweedFS) to the batch loader, no GPU needed: the
//! batches equal those of the same shards as local files, in the sampler's order (elastic
//! included); the shards held at once stay under the cap and are let go; an order
//! that needs more than the cap is refused before it starts; `.npy` and tar shards; a shard
//! replaced after it was opened, and a server that dies, give errors naming what failed.

use std::path::Path;

use gpufeed_data::{
    BatchData, BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler, ShardSet,
    StreamOptions, StreamedShards,
};
use gpufeed_load::object::{Credentials, ObjectOptions};
use gpufeed_testkit::s3::{self, ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFs};

use crate::random_bytes;

fn object_opts(server: &SeaweedFs) -> ObjectOptions {
    ObjectOptions::default()
        .with_endpoint(&server.endpoint)
        .with_region("us-east-1")
        .with_credentials(Credentials::new(ACCESS_KEY, SECRET_KEY))
        .with_request_bytes((1 << 20) + 3)
        .with_retries(1)
        .with_timeout(std::time::Duration::from_secs(5))
}

/// Every batch of `epoch`: its indices and bytes.
fn batches(loader: &mut BatchLoader, epoch: u64) -> Vec<(Vec<usize>, Vec<u8>)> {
    loader
        .epoch(epoch)
        .expect("epoch")
        .map(|b| {
            let b = b.expect("batch");
            let BatchData::Host(buf) = &b.data else {
                panic!("host batches without a GPU")
            };
            (b.indices.clone(), buf.to_vec())
        })
        .collect()
}

/// `shards` as local files in `dir` (named as in the bucket), read as one set.
fn local_set(
    dir: &Path,
    shards: &[(String, Vec<u8>)],
    open: impl Fn(&Path) -> RecordFile,
) -> ShardSet {
    ShardSet::new(
        shards
            .iter()
            .map(|(name, bytes)| {
                let p = dir.join(name);
                std::fs::write(&p, bytes).expect("write");
                open(&p)
            })
            .collect(),
    )
}

#[test]
fn shards_in_a_bucket_stream_in_the_samplers_order_under_the_cap() {
    let test = "shards_in_a_bucket_stream_in_the_samplers_order_under_the_cap";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    // Six shards of 300 to 385 records of 1,237 bytes (odd, unaligned, unequal).
    let record = 1237usize;
    let counts: Vec<usize> = (0..6).map(|s| 300 + 17 * s).collect();
    let shards: Vec<(String, Vec<u8>)> = counts
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (
                format!("train-{s:03}.bin"),
                random_bytes(record * n, seed + s as u64),
            )
        })
        .collect();
    for (name, bytes) in &shards {
        server.put(&format!("stream/{name}"), bytes).expect("put");
    }
    let local = tempfile::tempdir().expect("dir");
    // A batch's one or two shards, and the first shard, which the epoch's padded last step
    // takes records of again.
    let cap = 3 * (record * counts[5]) as u64;
    let opts = StreamOptions::default()
        .with_record_bytes(record)
        .with_object_options(object_opts(&server))
        .with_spool_bytes(cap)
        .with_fetchers(3);
    // Shards in a shuffled order, records shuffled within each; elastic, rank 1 of 2.
    let order = Order::Shards { seed: 9 };
    let sampler = Sampler::elastic(order, 60, 1, 2, false).expect("sampler");
    let cfg = BatchLoaderOptions::default()
        .with_workers(3)
        .with_prefetch(4);
    let streamed =
        StreamedShards::open(&[format!("s3://{BUCKET}/stream/train-*.bin")], &opts).expect("open");
    assert_eq!(streamed.len(), counts.iter().sum::<usize>());
    let names: Vec<&str> = streamed.shards().map(|(n, _, _)| n).collect();
    assert_eq!(
        names[0],
        format!("s3://{BUCKET}/stream/train-000.bin"),
        "listed, sorted"
    );
    let mut from_bucket = BatchLoader::new(streamed, sampler, cfg.clone(), None).expect("loader");
    // SAFETY: the test's files are not changed while mapped.
    let set = local_set(local.path(), &shards, |p| unsafe {
        RecordFile::open_fixed(p, record).expect("open")
    });
    let mut from_disk = BatchLoader::new(set, sampler, cfg, None).expect("loader");
    for epoch in 0..2 {
        let want = batches(&mut from_disk, epoch);
        let got = batches(&mut from_bucket, epoch);
        assert_eq!(got.len(), want.len(), "epoch {epoch}");
        assert!(got == want, "epoch {epoch}: the streamed batches differ");
    }
    let gpufeed_data::Dataset::Streamed(s) = from_bucket_dataset(&from_bucket) else {
        unreachable!()
    };
    let stats = s.stats();
    assert_eq!(stats.fetched, 12, "each shard once per epoch: {stats:?}");
    assert!(stats.peak_bytes <= cap, "{stats:?} over the cap {cap}");
    assert!(stats.peak_bytes > 0);
    // Every shard's memory let go between epochs.
    assert_eq!(stats.held_bytes, 0, "{stats:?}");
}

fn from_bucket_dataset(loader: &BatchLoader) -> &gpufeed_data::Dataset {
    loader.dataset()
}

#[test]
fn an_order_over_all_shards_is_refused_under_a_small_cap_and_runs_through_a_cache() {
    let test = "an_order_over_all_shards_is_refused_under_a_small_cap_and_runs_through_a_cache";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let shards: Vec<(String, Vec<u8>)> = (0..4)
        .map(|s| (format!("all-{s}.bin"), random_bytes(64 * 1001, seed + s)))
        .collect();
    for (name, bytes) in &shards {
        server.put(&format!("all/{name}"), bytes).expect("put");
    }
    let urls: Vec<String> = shards
        .iter()
        .map(|(n, _)| format!("s3://{BUCKET}/all/{n}"))
        .collect();
    let base = StreamOptions::default()
        .with_record_bytes(1001)
        .with_object_options(object_opts(&server));
    let sampler = Sampler::new(Order::Shuffled { seed: 3 });
    let cfg = BatchLoaderOptions::default().with_batch_size(32);
    let small = base.clone().with_spool_bytes(2 * 64 * 1001);
    let set = StreamedShards::open(&urls, &small).expect("open");
    let mut loader = BatchLoader::new(set, sampler, cfg.clone(), None).expect("loader");
    let err = loader.epoch(0).err().expect("refused").to_string();
    assert!(
        err.contains("over the cap") && err.contains("spool_bytes"),
        "{err}"
    );
    // Through a cache directory: no cap, every shard kept there.
    let cache = tempfile::tempdir().expect("cache");
    let set = StreamedShards::open(&urls, &base.clone().with_cache(cache.path())).expect("open");
    let mut loader = BatchLoader::new(set, sampler, cfg.clone(), None).expect("loader");
    let local = tempfile::tempdir().expect("dir");
    // SAFETY: the test's files are not changed while mapped.
    let disk = local_set(local.path(), &shards, |p| unsafe {
        RecordFile::open_fixed(p, 1001).expect("open")
    });
    let mut from_disk = BatchLoader::new(disk, sampler, cfg, None).expect("loader");
    assert!(batches(&mut loader, 0) == batches(&mut from_disk, 0));
    assert_eq!(std::fs::read_dir(cache.path()).expect("ls").count(), 4);
}

/// A tar of `samples` samples of two members each (`.jpg`-named random bytes and `.cls`).
fn tar_shard(samples: usize, seed: u64) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for k in 0..samples {
        for (ext, body) in [
            ("bin", random_bytes(100 + (k * 37) % 900, seed + k as u64)),
            ("cls", format!("{}", k % 10).into_bytes()),
        ] {
            let mut h = tar::Header::new_ustar();
            h.set_size(body.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, format!("s{seed}/{k:05}.{ext}"), body.as_slice())
                .expect("append");
        }
    }
    b.into_inner().expect("tar")
}

#[test]
fn npy_and_tar_shards_stream_as_their_local_files_read() {
    let test = "npy_and_tar_shards_stream_as_their_local_files_read";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let npys: Vec<(String, Vec<u8>)> = (0..3)
        .map(|s| {
            let rows = 50 + s * 7;
            let data = random_bytes(rows * 3 * 4, seed + s as u64);
            (
                format!("part-{s}.npy"),
                gpufeed_testkit::npy_bytes("<f4", false, &format!("({rows}, 3)"), &data),
            )
        })
        .collect();
    let tars: Vec<(String, Vec<u8>)> = (0..3)
        .map(|s| {
            (
                format!("shard-{s}.tar"),
                tar_shard(40 + s * 3, seed + 10 + s as u64),
            )
        })
        .collect();
    for (name, bytes) in npys.iter().chain(&tars) {
        server.put(&format!("kinds/{name}"), bytes).expect("put");
    }
    let opts = StreamOptions::default().with_object_options(object_opts(&server));
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(16)
        .with_workers(2);
    let local = tempfile::tempdir().expect("dir");
    for (shards, pattern, open) in [
        (
            &npys,
            "kinds/part-*.npy",
            // SAFETY: the test's files are not changed while mapped.
            (|p: &Path| unsafe { RecordFile::open_npy(p).expect("npy") })
                as fn(&Path) -> RecordFile,
        ),
        (
            &tars,
            "kinds/shard-*.tar",
            // SAFETY: as above.
            |p: &Path| unsafe { RecordFile::open_tar(p).expect("tar") },
        ),
    ] {
        let streamed =
            StreamedShards::open(&[format!("s3://{BUCKET}/{pattern}")], &opts).expect("open");
        if pattern.ends_with(".npy") {
            let npy = streamed.npy().expect("npy layout");
            assert_eq!(npy.shape[1..], [3]);
        } else {
            let sample = streamed.sample(0).expect("a tar sample");
            assert_eq!(sample.members.len(), 2);
        }
        let sampler = Sampler::new(Order::Blocks { seed: 5, block: 40 });
        let mut a = BatchLoader::new(streamed, sampler, cfg.clone(), None).expect("loader");
        let mut b = BatchLoader::new(
            local_set(local.path(), shards, open),
            sampler,
            cfg.clone(),
            None,
        )
        .expect("loader");
        let (got, want) = (batches(&mut a, 0), batches(&mut b, 0));
        assert!(!got.is_empty());
        assert!(got == want, "{pattern}: the streamed batches differ");
        // A local shard among the objects (the first written by local_set above): read in
        // place, mapped once, the same batches over two epochs.
        let mixed: Vec<String> =
            std::iter::once(local.path().join(&shards[0].0).display().to_string())
                .chain(
                    shards[1..]
                        .iter()
                        .map(|(n, _)| format!("s3://{BUCKET}/kinds/{n}")),
                )
                .collect();
        let mixed = StreamedShards::open(&mixed, &opts).expect("open mixed");
        let mut c = BatchLoader::new(mixed, sampler, cfg.clone(), None).expect("loader");
        for epoch in 0..2 {
            assert!(
                batches(&mut c, epoch) == batches(&mut b, epoch),
                "{pattern}: mixed, epoch {epoch}"
            );
        }
    }
    // The tars through a shard index (webdataset's wids format), URLs relative to it: nothing
    // of them is read before the epoch, the same batches.
    let list: Vec<String> = tars
        .iter()
        .map(|(name, bytes)| {
            let n = tar::Archive::new(bytes.as_slice())
                .entries()
                .expect("tar")
                .count()
                / 2;
            format!(
                r#"{{"url": "{name}", "nsamples": {n}, "filesize": {}}}"#,
                bytes.len()
            )
        })
        .collect();
    let index = format!(
        r#"{{"wids_version": 1, "shardlist": [{}]}}"#,
        list.join(", ")
    );
    server
        .put("kinds/index.json", index.as_bytes())
        .expect("put");
    let sampler = Sampler::new(Order::Blocks { seed: 5, block: 40 });
    // SAFETY: the test's files are not changed while mapped.
    let open_tar = |p: &Path| unsafe { RecordFile::open_tar(p).expect("tar") };
    let mut want = BatchLoader::new(
        local_set(local.path(), &tars, open_tar),
        sampler,
        cfg.clone(),
        None,
    )
    .expect("loader");
    let indexed =
        StreamedShards::open(&[format!("s3://{BUCKET}/kinds/index.json")], &opts).expect("open");
    assert!(indexed.sample(0).is_none(), "not indexed before the epoch");
    let mut got = BatchLoader::new(indexed, sampler, cfg.clone(), None).expect("loader");
    assert!(
        batches(&mut got, 0) == batches(&mut want, 0),
        "through the shard index"
    );
    // An index whose count is not the tar's: the batches of that shard fail naming it.
    let wrong = index.replacen("\"nsamples\": 40", "\"nsamples\": 41", 1);
    assert_ne!(wrong, index);
    server
        .put("kinds/wrong.json", wrong.as_bytes())
        .expect("put");
    let set =
        StreamedShards::open(&[format!("s3://{BUCKET}/kinds/wrong.json")], &opts).expect("open");
    let mut loader =
        BatchLoader::new(set, Sampler::new(Order::Sequential), cfg.clone(), None).expect("loader");
    let errors: Vec<String> = loader
        .epoch(0)
        .expect("epoch")
        .filter_map(|b| b.err().map(|e| e.to_string()))
        .collect();
    assert!(!errors.is_empty());
    assert!(
        errors
            .iter()
            .all(|e| e.contains("shard-0.tar") && e.contains("41")),
        "{errors:?}"
    );
    // An index in the bucket that lists a local file (absolute, or under a local
    // base_path): refused when opened, nothing of the file read.
    let secret = local.path().join("secret.tar");
    std::fs::write(&secret, &tars[0].1).expect("write");
    for (key, doc) in [
        (
            "kinds/local.json",
            format!(
                r#"{{"shardlist": [{{"url": "{}", "nsamples": 40}}]}}"#,
                secret.display()
            ),
        ),
        (
            "kinds/local-base.json",
            format!(
                r#"{{"base_path": "{}", "shardlist": [{{"url": "secret.tar", "nsamples": 40}}]}}"#,
                local.path().display()
            ),
        ),
    ] {
        server.put(key, doc.as_bytes()).expect("put");
        let err = StreamedShards::open(&[format!("s3://{BUCKET}/{key}")], &opts)
            .expect_err("a local path in a bucket's index")
            .to_string();
        assert!(
            err.contains(key) && err.contains("local path") && err.contains("secret.tar"),
            "{err}"
        );
    }
    // Not a shard index: refused naming it.
    server.put("kinds/other.json", b"{\"a\": 1}").expect("put");
    let err = StreamedShards::open(&[format!("s3://{BUCKET}/kinds/other.json")], &opts)
        .expect_err("not an index")
        .to_string();
    assert!(
        err.contains("other.json") && err.contains("shardlist"),
        "{err}"
    );
    // A name that says nothing of its records, without record_bytes: refused naming it.
    server.put("kinds/raw.dat", &[0u8; 10]).expect("put");
    let err = StreamedShards::open(&[format!("s3://{BUCKET}/kinds/raw.dat")], &opts)
        .expect_err("no record size")
        .to_string();
    assert!(
        err.contains("raw.dat") && err.contains("record_bytes"),
        "{err}"
    );
    // A length that is not a whole number of records: refused naming it.
    let err = StreamedShards::open(
        &[format!("s3://{BUCKET}/kinds/raw.dat")],
        &opts.clone().with_record_bytes(3),
    )
    .expect_err("10 bytes of 3-byte records")
    .to_string();
    assert!(
        err.contains("raw.dat") && err.contains("whole number"),
        "{err}"
    );
}

#[test]
fn a_shard_replaced_after_it_was_opened_fails_its_batches_naming_it() {
    let test = "a_shard_replaced_after_it_was_opened_fails_its_batches_naming_it";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    for s in 0..3u64 {
        server
            .put(
                &format!("swap/p-{s}.bin"),
                &random_bytes(100 * 513, seed + s),
            )
            .expect("put");
    }
    let opts = StreamOptions::default()
        .with_record_bytes(513)
        .with_object_options(object_opts(&server));
    let set = StreamedShards::open(&[format!("s3://{BUCKET}/swap/p-*.bin")], &opts).expect("open");
    // Replaced (same length, other bytes) after its version was pinned.
    server
        .put("swap/p-2.bin", &random_bytes(100 * 513, seed ^ 77))
        .expect("put");
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(50)
        .with_workers(1);
    let mut loader =
        BatchLoader::new(set, Sampler::new(Order::Sequential), cfg, None).expect("loader");
    let results: Vec<_> = loader.epoch(0).expect("epoch").collect();
    assert_eq!(results.len(), 6);
    assert!(
        results[..4].iter().all(Result::is_ok),
        "shards 0 and 1 were not replaced"
    );
    for r in &results[4..] {
        let err = r.as_ref().expect_err("replaced").to_string();
        assert!(err.contains("swap/p-2.bin"), "{err}");
    }
}

#[test]
fn a_server_that_dies_mid_epoch_ends_it_with_errors_not_a_hang() {
    let test = "a_server_that_dies_mid_epoch_ends_it_with_errors_not_a_hang";
    let Some(mut server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    for s in 0..8u64 {
        server
            .put(
                &format!("die/p-{s}.bin"),
                &random_bytes(200 * 1024, seed + s),
            )
            .expect("put");
    }
    let opts = StreamOptions::default()
        .with_record_bytes(1024)
        .with_object_options(
            object_opts(&server).with_connect_timeout(std::time::Duration::from_secs(2)),
        )
        .with_spool_bytes(200 * 1024)
        .with_fetchers(1);
    let set = StreamedShards::open(&[format!("s3://{BUCKET}/die/p-*.bin")], &opts).expect("open");
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(100)
        .with_workers(1)
        .with_prefetch(1);
    let mut loader =
        BatchLoader::new(set, Sampler::new(Order::Sequential), cfg, None).expect("loader");
    let started = std::time::Instant::now();
    let mut epoch = loader.epoch(0).expect("epoch");
    assert!(epoch.next().expect("first").is_ok());
    server.kill();
    let rest: Vec<_> = epoch.collect();
    let failed: Vec<String> = rest
        .iter()
        .filter_map(|r| r.as_ref().err().map(ToString::to_string))
        .collect();
    assert!(!failed.is_empty(), "no batch failed after the server died");
    assert!(failed.iter().all(|e| e.contains("die/p-")), "{failed:?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_fetch_slower_than_the_batch_timeout_is_waited_for() {
    let test = "a_fetch_slower_than_the_batch_timeout_is_waited_for";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let data: Vec<Vec<u8>> = (0..2u64).map(|s| random_bytes(3 << 20, seed + s)).collect();
    for (s, bytes) in data.iter().enumerate() {
        server.put(&format!("slow/p-{s}.bin"), bytes).expect("put");
    }
    // Every read from the server waits 50 ms: a 3 MiB shard takes about a second.
    let proxy = s3::FaultProxy::start(
        server.addr,
        s3::Faults {
            delay: std::time::Duration::from_millis(50),
            ..Default::default()
        },
    )
    .expect("proxy");
    let opts = StreamOptions::default()
        .with_record_bytes(1 << 20)
        .with_object_options(object_opts(&server).with_endpoint(&proxy.endpoint));
    let set = StreamedShards::open(&[format!("s3://{BUCKET}/slow/p-*.bin")], &opts).expect("open");
    let cfg = BatchLoaderOptions::default()
        .with_batch_size(3)
        .with_workers(1)
        .with_batch_timeout(std::time::Duration::from_millis(300));
    let mut loader =
        BatchLoader::new(set, Sampler::new(Order::Sequential), cfg, None).expect("loader");
    let started = std::time::Instant::now();
    let got = batches(&mut loader, 0);
    assert!(
        started.elapsed() > std::time::Duration::from_millis(600),
        "the proxy did not slow the fetches ({:?})",
        started.elapsed()
    );
    assert_eq!(got.len(), 2);
    assert!(got[0].1 == data[0] && got[1].1 == data[1]);
}
