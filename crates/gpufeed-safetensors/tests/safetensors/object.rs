//! Checkpoints in a real S3 server (SeaweedFS): headers read by ranged GETs and checked as a
//! file's are (hostile headers, indexes leaving their prefix, shards of two saves), then on a
//! GPU every tensor byte-exact.

use gpufeed_load::object::{Credentials, ObjectOptions};
use gpufeed_safetensors::{
    Error, Split, TensorParallel, inspect_object, inspect_object_opened, load_object,
    load_objects_opened, load_shard,
};
use gpufeed_testkit::s3::{self, ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFs};
use safetensors::Dtype;
use xxhash_rust::xxh3::xxh3_64;

use crate::{file, gpu_or_skip};

fn opts(server: &SeaweedFs) -> ObjectOptions {
    ObjectOptions::default()
        .with_endpoint(&server.endpoint)
        .with_region("us-east-1")
        .with_credentials(Credentials::new(ACCESS_KEY, SECRET_KEY))
}

fn url(key: &str) -> String {
    format!("s3://{BUCKET}/{key}")
}

#[test]
fn checkpoints_in_a_bucket_are_checked_like_files() {
    let test = "checkpoints_in_a_bucket_are_checked_like_files";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let o = opts(&server);
    // One object, with a header over the first read's 1 MiB (15,000 tensors): two GETs.
    let many: Vec<(String, Dtype, Vec<usize>)> = (0..15_000)
        .map(|i| {
            (
                format!("layer.{i:05}.weight_with_a_long_name"),
                Dtype::BF16,
                vec![3],
            )
        })
        .collect();
    let refs: Vec<_> = many
        .iter()
        .map(|(n, d, s)| (n.as_str(), *d, s.clone()))
        .collect();
    let (bytes, _) = file(&refs, seed, None);
    assert!(u64::from_le_bytes(bytes[..8].try_into().unwrap()) > 1 << 20);
    server
        .put("big-header/model.safetensors", &bytes)
        .expect("put");
    let layouts = inspect_object(&url("big-header/model.safetensors"), &o).expect("inspect");
    assert_eq!(layouts.len(), 1);
    assert_eq!(layouts[0].tensors.len(), 15_000);
    assert_eq!(layouts[0].data_bytes, 15_000 * 6);

    // Two shards and an index beside them.
    let (a, _) = file(&[("a", Dtype::F32, vec![1001])], seed, Some("s1"));
    let (b, _) = file(&[("b", Dtype::U8, vec![77])], seed + 9, Some("s1"));
    server.put("sharded/m-1.safetensors", &a).expect("put");
    server.put("sharded/m-2.safetensors", &b).expect("put");
    let index = serde_json::json!({"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}});
    server
        .put(
            "sharded/m.safetensors.index.json",
            index.to_string().as_bytes(),
        )
        .expect("put");
    let layouts = inspect_object(&url("sharded/m.safetensors.index.json"), &o).expect("index");
    let paths: Vec<_> = layouts
        .iter()
        .map(|l| l.path.to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        paths,
        [
            url("sharded/m-1.safetensors"),
            url("sharded/m-2.safetensors")
        ]
    );

    // A shard of another save: refused, naming it.
    let (b2, _) = file(&[("b", Dtype::U8, vec![77])], seed + 9, Some("s2"));
    server.put("sharded/m-2.safetensors", &b2).expect("put");
    match inspect_object(&url("sharded/m.safetensors.index.json"), &o) {
        Err(Error::MixedCheckpoint { files, .. }) => {
            assert_eq!(files.len(), 1, "{files:?}");
        }
        other => panic!("shards of two saves: {other:?}"),
    }
    // A tensor in two shards (the index maps it to one): refused, naming both.
    let (b3, _) = file(
        &[("b", Dtype::U8, vec![77]), ("a", Dtype::F32, vec![1001])],
        seed + 5,
        Some("s1"),
    );
    server.put("sharded/m-2.safetensors", &b3).expect("put");
    match inspect_object(&url("sharded/m.safetensors.index.json"), &o) {
        Err(Error::Index { reason, .. }) => assert!(
            reason.contains("tensor a is in two shards")
                && reason.contains(&url("sharded/m-1.safetensors"))
                && reason.contains(&url("sharded/m-2.safetensors")),
            "{reason}"
        ),
        other => panic!("a tensor in two shards: {other:?}"),
    }
    // An index naming a shard outside its prefix, and one naming a missing tensor's file.
    let escape = serde_json::json!({"weight_map": {"a": "../other/m-1.safetensors"}});
    server
        .put(
            "bad/escape.safetensors.index.json",
            escape.to_string().as_bytes(),
        )
        .expect("put");
    let e = inspect_object(&url("bad/escape.safetensors.index.json"), &o).unwrap_err();
    assert!(matches!(e, Error::Index { .. }), "{e}");
    let encoded = serde_json::json!({"weight_map": {"a": "..%2F..%2Fother.safetensors"}});
    server
        .put(
            "bad/encoded.safetensors.index.json",
            encoded.to_string().as_bytes(),
        )
        .expect("put");
    let e = inspect_object(&url("bad/encoded.safetensors.index.json"), &o).unwrap_err();
    assert!(
        matches!(e, Error::Index { .. }) && e.to_string().contains("refused"),
        "{e}"
    );
    for (key, shard) in [
        (
            "bad/backslash.safetensors.index.json",
            "..\\m-1.safetensors",
        ),
        ("bad/space.safetensors.index.json", "m-1.safetensors "),
        ("bad/tab.safetensors.index.json", "m-1.safe\ttensors"),
    ] {
        let doc = serde_json::json!({"weight_map": {"a": shard}});
        server.put(key, doc.to_string().as_bytes()).expect("put");
        let e = inspect_object(&url(key), &o).unwrap_err();
        assert!(
            matches!(e, Error::Index { .. }) && e.to_string().contains("refused"),
            "{shard:?}: {e}"
        );
    }
    // The sharded index again, named with an encoded '/': refused, not read with the
    // bucket root's shards.
    let e = inspect_object(&url("sharded%2Fm.safetensors.index.json"), &o).unwrap_err();
    assert!(
        matches!(e, Error::Index { .. }) && e.to_string().contains("%2F"),
        "{e}"
    );
    let missing = serde_json::json!({"weight_map": {"a": "nowhere.safetensors"}});
    server
        .put(
            "bad/missing.safetensors.index.json",
            missing.to_string().as_bytes(),
        )
        .expect("put");
    let e = inspect_object(&url("bad/missing.safetensors.index.json"), &o).unwrap_err();
    assert!(e.to_string().contains("nowhere.safetensors"), "{e}");
    // Hostile headers: a length past the object, garbage JSON; a missing object.
    let mut lying = (1u64 << 40).to_le_bytes().to_vec();
    lying.extend_from_slice(b"{}");
    server.put("bad/lying.safetensors", &lying).expect("put");
    let e = inspect_object(&url("bad/lying.safetensors"), &o).unwrap_err();
    assert!(matches!(e, Error::Safetensors { .. }), "{e}");
    let mut garbage = 20u64.to_le_bytes().to_vec();
    garbage.extend_from_slice(&[0xff; 20]);
    server
        .put("bad/garbage.safetensors", &garbage)
        .expect("put");
    let e = inspect_object(&url("bad/garbage.safetensors"), &o).unwrap_err();
    assert!(matches!(e, Error::Safetensors { .. }), "{e}");
    let e = inspect_object(&url("bad/none.safetensors"), &o).unwrap_err();
    assert!(e.to_string().contains("not found"), "{e}");
}

#[test]
fn a_checkpoint_in_a_bucket_loads_every_tensor_byte_exact() {
    let test = "a_checkpoint_in_a_bucket_loads_every_tensor_byte_exact";
    let Some(gpu) = gpu_or_skip(test) else { return };
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let (a, mut want) = file(
        &[
            ("x.weight", Dtype::F32, vec![1023, 517]),
            ("x.bias", Dtype::BF16, vec![4099]),
        ],
        seed,
        None,
    );
    let (b, more) = file(&[("y.table", Dtype::U8, vec![3 << 20, 3])], seed + 5, None);
    want.extend(more);
    server.put("gpu/m-1.safetensors", &a).expect("put");
    server.put("gpu/m-2.safetensors", &b).expect("put");
    let index = serde_json::json!({"weight_map": {
        "x.weight": "m-1.safetensors", "x.bias": "m-1.safetensors", "y.table": "m-2.safetensors"}});
    server
        .put("gpu/m.safetensors.index.json", index.to_string().as_bytes())
        .expect("put");
    let loader =
        gpufeed_load::Loader::new(&gpu, gpufeed_load::LoadOptions::default()).expect("loader");
    let ckpt = load_object(
        &loader,
        &url("gpu/m.safetensors.index.json"),
        &opts(&server),
    )
    .expect("load");
    assert_eq!(ckpt.len(), 3);
    let byte_exact = |ckpt: &gpufeed_safetensors::Checkpoint| {
        for (name, bytes) in &want {
            let info = ckpt.info(name).expect("tensor");
            let back = gpu
                .to_vec(ckpt.buffer(info.file).expect("buffer"))
                .expect("back");
            assert_eq!(xxh3_64(&back[info.range.clone()]), xxh3_64(bytes), "{name}");
        }
    };
    byte_exact(&ckpt);
    // The objects opened (and their headers read) first, loaded later: the same bytes, the
    // headers not read again; a shard replaced in between is an error naming it, not a mix.
    let index_url = url("gpu/m.safetensors.index.json");
    let opened = inspect_object_opened(&index_url, &opts(&server)).expect("opened");
    let ckpt = load_objects_opened(&loader, &index_url, opened).expect("load opened");
    assert_eq!(ckpt.len(), 3);
    byte_exact(&ckpt);
    let opened = inspect_object_opened(&index_url, &opts(&server)).expect("opened");
    let (other, _) = file(&[("y.table", Dtype::U8, vec![3 << 20, 3])], seed + 6, None);
    server.put("gpu/m-2.safetensors", &other).expect("put");
    let e = load_objects_opened(&loader, &index_url, opened).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Load(gpufeed_load::Error::Object(
                gpufeed_load::object::ObjectError::ObjectChanged { .. }
            ))
        ) && e.to_string().contains("m-2.safetensors"),
        "{e}"
    );
}

/// A sharded checkpoint of tensors with odd shapes (3 ranks cut them unevenly) put in the
/// bucket under `prefix` and written to `dir` under the same names; returns the index's name.
fn sharded_in_both(server: &SeaweedFs, prefix: &str, dir: &std::path::Path, seed: u64) -> String {
    let (a, _) = file(
        &[
            ("l.weight", Dtype::F32, vec![1023, 517]),
            ("l.bias", Dtype::BF16, vec![4099]),
            ("scalar", Dtype::F64, vec![]),
        ],
        seed,
        Some("tp"),
    );
    let (b, _) = file(
        &[
            ("emb", Dtype::U8, vec![7, 3 << 18]),
            ("one", Dtype::I16, vec![1, 5]),
        ],
        seed + 3,
        Some("tp"),
    );
    let index = serde_json::json!({"weight_map": {
        "l.weight": "m-1.safetensors", "l.bias": "m-1.safetensors", "scalar": "m-1.safetensors",
        "emb": "m-2.safetensors", "one": "m-2.safetensors"}})
    .to_string();
    for (name, bytes) in [
        ("m-1.safetensors", &a[..]),
        ("m-2.safetensors", &b[..]),
        ("m.safetensors.index.json", index.as_bytes()),
    ] {
        server.put(&format!("{prefix}/{name}"), bytes).expect("put");
        std::fs::write(dir.join(name), bytes).expect("write");
    }
    "m.safetensors.index.json".into()
}

#[test]
fn a_tensor_parallel_plan_of_a_bucket_is_the_plan_of_the_same_files() {
    let test = "a_tensor_parallel_plan_of_a_bucket_is_the_plan_of_the_same_files";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let index = sharded_in_both(&server, "tp-plan", dir.path(), gpufeed_testkit::seed(test));
    for split in [Split::Rows, Split::Columns, Split::Dim(2)] {
        let local = TensorParallel::plan(dir.path().join(&index), 3, split).expect("plan");
        let remote = TensorParallel::plan_object(
            &url(&format!("tp-plan/{index}")),
            &opts(&server),
            3,
            split,
        )
        .expect("plan of the bucket");
        assert_eq!(remote.files().len(), 2);
        assert!(remote.files()[0].to_string_lossy().starts_with("s3://"));
        for rank in 0..3 {
            assert_eq!(
                remote.bytes(rank),
                local.bytes(rank),
                "{split:?} rank {rank}"
            );
            for f in 0..2 {
                assert_eq!(
                    remote.spans(rank, f),
                    local.spans(rank, f),
                    "{split:?} {rank} {f}"
                );
                assert_eq!(remote.shares(rank, f), local.shares(rank, f));
            }
        }
    }
    let e = TensorParallel::plan_object(
        &url("tp-plan/m.safetensors.index.json"),
        &opts(&server),
        0,
        Split::Rows,
    )
    .unwrap_err();
    assert!(e.to_string().contains("at least one rank"), "{e}");
    let e = TensorParallel::plan_object(
        &url("tp-plan/none.safetensors"),
        &opts(&server),
        2,
        Split::Rows,
    )
    .unwrap_err();
    assert!(e.to_string().contains("not found"), "{e}");
}

#[test]
fn each_rank_of_a_bucket_plan_loads_its_share_byte_exact() {
    let test = "each_rank_of_a_bucket_plan_loads_its_share_byte_exact";
    let Some(gpu) = gpu_or_skip(test) else { return };
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let index = sharded_in_both(&server, "tp-load", dir.path(), gpufeed_testkit::seed(test));
    let loader =
        gpufeed_load::Loader::new(&gpu, gpufeed_load::LoadOptions::default()).expect("loader");
    for split in [Split::Rows, Split::Columns] {
        let local = TensorParallel::plan(dir.path().join(&index), 3, split).expect("plan");
        let remote = TensorParallel::plan_object(
            &url(&format!("tp-load/{index}")),
            &opts(&server),
            3,
            split,
        )
        .expect("plan of the bucket");
        for rank in 0..3 {
            let want = load_shard(&loader, &local, rank).expect("local shard");
            let got = load_shard(&loader, &remote, rank).expect("bucket shard");
            assert_eq!(got.len(), want.len());
            for name in want.names() {
                let (w, g) = (want.info(name).unwrap(), got.info(name).unwrap());
                assert_eq!((&g.shape, g.dtype), (&w.shape, w.dtype), "{name}");
                let back = |c: &gpufeed_safetensors::Checkpoint,
                            i: &gpufeed_safetensors::TensorInfo| {
                    let all = gpu.to_vec(c.buffer(i.file).expect("buffer")).expect("back");
                    xxh3_64(&all[i.range.clone()])
                };
                assert_eq!(
                    back(&got, g),
                    back(&want, w),
                    "{split:?} rank {rank} {name}"
                );
            }
        }
    }
    // An object replaced after the plan read its header: the load names it, mixes nothing.
    let remote = TensorParallel::plan_object(
        &url(&format!("tp-load/{index}")),
        &opts(&server),
        2,
        Split::Rows,
    )
    .expect("plan");
    let (other, _) = file(&[("l.weight", Dtype::F32, vec![1023, 517])], 99, Some("tp"));
    server.put("tp-load/m-1.safetensors", &other).expect("put");
    let e = load_shard(&loader, &remote, 1).unwrap_err();
    assert!(e.to_string().contains("m-1.safetensors"), "{e}");
}
