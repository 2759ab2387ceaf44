//! Several GPUs: shard plans (byte ranges, a file per rank, tensor-parallel slices) checked for
//! exact coverage against the files on the CPU; sharded, tensor-parallel and replicated loads
//! byte-exact on every GPU of the machine (one GPU: the N=1 path; two: N=1 and N=2).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpufeed_load::Error as LoadError;
use gpufeed_load::{Gpu, LoadOptions};
use gpufeed_multi::Error;
use gpufeed_multi::{MultiLoader, ShardPlan, Span};
use gpufeed_safetensors::{Split, TensorParallel};
use proptest::prelude::*;
use safetensors::Dtype;
use xxhash_rust::xxh3::xxh3_64;

use crate::random_bytes;

/// Files of the given lengths (random bytes) in `dir`.
fn files(dir: &Path, lens: &[usize], seed: u64) -> Vec<(PathBuf, Vec<u8>)> {
    lens.iter()
        .enumerate()
        .map(|(i, &len)| {
            let path = dir.join(format!("f{i}.bin"));
            let data = random_bytes(len, seed + i as u64);
            std::fs::write(&path, &data).expect("write");
            (path, data)
        })
        .collect()
}

/// The bytes rank `rank` of `plan` should hold, read from the files' contents.
fn expected(plan: &ShardPlan, rank: usize, data: &[Vec<u8>]) -> Vec<u8> {
    plan.spans(rank)
        .iter()
        .flat_map(|s| data[s.file][s.range.start as usize..s.range.end as usize].to_vec())
        .collect()
}

/// How many times each byte of each file is in the plan's spans, over all ranks.
fn coverage(plan: &ShardPlan) -> Vec<Vec<u32>> {
    let mut seen: Vec<Vec<u32>> = plan
        .file_lens()
        .iter()
        .map(|&l| vec![0; l as usize])
        .collect();
    for r in 0..plan.ranks() {
        for s in plan.spans(r) {
            for b in s.range.start..s.range.end {
                seen[s.file][b as usize] += 1;
            }
        }
    }
    seen
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every byte of every file goes to exactly one rank; byte shares differ by at most 4 KiB
    /// (their boundaries are on 4 KiB multiples); a file per rank keeps each file whole.
    #[test]
    fn shard_plans_cover_every_byte_once(
        lens in prop::collection::vec(0usize..20_000, 1..5),
        ranks in 1usize..6,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let paths: Vec<PathBuf> = files(dir.path(), &lens, 1).into_iter().map(|f| f.0).collect();
        let bytes = ShardPlan::split_bytes(&paths, ranks).expect("plan");
        prop_assert_eq!(bytes.ranks(), ranks);
        prop_assert!(coverage(&bytes).iter().flatten().all(|&n| n == 1));
        let total: u64 = lens.iter().map(|&l| l as u64).sum();
        for r in 0..ranks {
            let want = total / ranks as u64;
            prop_assert!(bytes.bytes(r).abs_diff(want) <= 4096, "rank {} has {}", r, bytes.bytes(r));
        }
        let whole = ShardPlan::file_per_rank(&paths, ranks).expect("plan");
        prop_assert!(coverage(&whole).iter().flatten().all(|&n| n == 1));
        for r in 0..ranks {
            for s in whole.spans(r) {
                prop_assert_eq!(s.range.clone(), 0..lens[s.file] as u64);
            }
        }
    }

    /// Each rank's share of each tensor, read from the file through the plan's spans, equals
    /// the slice of the tensor cut element by element; the shares of all ranks together hold
    /// every element once (a tensor without the split dimension: whole on every rank).
    #[test]
    fn tensor_parallel_shares_match_an_element_by_element_cut(
        tensors in prop::collection::vec(
            (prop::collection::vec(1usize..7, 0..4), prop::sample::select(vec![Dtype::U8, Dtype::F16, Dtype::F32, Dtype::F64])),
            1..5,
        ),
        dim in 0usize..3,
        ranks in 1usize..5,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, want) = checkpoint(dir.path(), &tensors, 7);
        let split = Split::Dim(dim);
        let plan = TensorParallel::plan(&path, ranks, split).expect("plan");
        let file = std::fs::read(&path).expect("read");
        let mut counted: BTreeMap<String, usize> = BTreeMap::new();
        for rank in 0..ranks {
            let held: Vec<u8> = plan
                .spans(rank, 0)
                .iter()
                .flat_map(|s| file[s.start as usize..s.end as usize].to_vec())
                .collect();
            prop_assert_eq!(held.len() as u64, plan.bytes(rank));
            for share in plan.shares(rank, 0) {
                let (dtype, shape, bytes) = &want[&share.name];
                let reference = cut(bytes, shape, dtype.bitsize() / 8, dim, share.indices.clone());
                prop_assert_eq!(&held[share.dst.clone()], &reference[..], "{} rank {}", share.name, rank);
                prop_assert_eq!(share.share_shape(split).iter().product::<usize>() * dtype.bitsize() / 8, reference.len());
                *counted.entry(share.name.clone()).or_default() += reference.len();
            }
        }
        for (name, (dtype, shape, bytes)) in &want {
            let copies = if dim < shape.len() { 1 } else { ranks };
            prop_assert_eq!(counted[name], copies * bytes.len(), "{}", name);
            let _ = dtype;
        }
    }
}

/// A safetensors file of `tensors` (shape, dtype) with random bytes; returns its path and each
/// tensor's dtype, shape and bytes.
#[allow(clippy::type_complexity, reason = "a test's table")]
fn checkpoint(
    dir: &Path,
    tensors: &[(Vec<usize>, Dtype)],
    seed: u64,
) -> (PathBuf, BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>) {
    let want: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .enumerate()
        .map(|(i, (shape, dtype))| {
            let n = shape.iter().product::<usize>() * dtype.bitsize() / 8;
            (
                format!("t{i}"),
                (*dtype, shape.clone(), random_bytes(n, seed + i as u64)),
            )
        })
        .collect();
    let views: Vec<_> = want
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"),
            )
        })
        .collect();
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path).expect("serialize");
    (path, want)
}

/// The elements of a row-major tensor (`elem` bytes each) whose index along `dim` lies in
/// `indices`, in row-major order: the reference cut, element by element (`None`: all).
fn cut(
    bytes: &[u8],
    shape: &[usize],
    elem: usize,
    dim: usize,
    indices: Option<std::ops::Range<usize>>,
) -> Vec<u8> {
    let Some(ix) = indices else {
        return bytes.to_vec();
    };
    let count: usize = shape.iter().product();
    let mut out = Vec::new();
    for flat in 0..count {
        // The index along `dim` of element `flat`.
        let stride: usize = shape[dim + 1..].iter().product();
        let i = (flat / stride) % shape[dim];
        if ix.contains(&i) {
            out.extend_from_slice(&bytes[flat * elem..(flat + 1) * elem]);
        }
    }
    out
}

#[test]
fn bad_plans_and_loaders_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = files(dir.path(), &[10], 3).remove(0);
    let e = ShardPlan::split_bytes(&[&path], 0).expect_err("no ranks");
    assert!(
        matches!(e, Error::Load(LoadError::InvalidSetting(_))),
        "{e}"
    );
    let e = ShardPlan::split_bytes(&[dir.path().join("missing.bin")], 2).expect_err("missing");
    assert!(e.to_string().contains("missing.bin"), "{e}");
    let e = ShardPlan::from_spans(
        &[&path],
        vec![vec![Span {
            file: 0,
            range: 5..11,
        }]],
    )
    .expect_err("past the end");
    assert!(e.to_string().contains("not inside the file"), "{e}");
    let e = ShardPlan::from_spans(
        &[&path],
        vec![vec![Span {
            file: 1,
            range: 0..1,
        }]],
    )
    .expect_err("no such file");
    assert!(e.to_string().contains("file 1 of 1"), "{e}");
    // A sub-byte dtype cut off a byte boundary: F4 [2, 3] by columns puts a slice at bit 4.
    let (ckpt, _) = checkpoint(dir.path(), &[(vec![2, 3], Dtype::F4)], 4);
    let e = TensorParallel::plan(&ckpt, 3, Split::Columns).expect_err("sub-byte cut");
    assert!(e.to_string().contains("byte boundary"), "{e}");
    assert!(
        TensorParallel::plan(&ckpt, 1, Split::Columns).is_ok(),
        "one rank holds it whole"
    );
    assert!(matches!(
        TensorParallel::plan(&ckpt, 0, Split::Rows),
        Err(gpufeed_safetensors::Error::Load(LoadError::InvalidSetting(
            _
        )))
    ));
    // Loaders: the GPU list is checked before any GPU is opened.
    for ordinals in [&[][..], &[0, 0][..]] {
        let e = MultiLoader::open(ordinals, LoadOptions::default()).expect_err("bad GPU list");
        assert!(
            matches!(e, Error::Load(LoadError::InvalidSetting(_))),
            "{e}"
        );
    }
    match Gpu::count() {
        Err(_) => {
            let e = MultiLoader::open(&[0, 1], LoadOptions::default()).expect_err("no GPU");
            assert!(e.is_no_gpu(), "{e}");
            assert!(Gpu::peer_links().is_err_and(|e| e.is_no_gpu()), "{e}");
        }
        Ok(n) => {
            let e = MultiLoader::open(&[0, n], LoadOptions::default()).expect_err("GPU n");
            assert!(e.to_string().contains(&n.to_string()), "{e}");
        }
    }
}

#[test]
fn the_host_budget_is_shared_between_gpus() {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let one = LoadOptions::for_gpus(1);
    let default = LoadOptions::default();
    assert_eq!(
        one.transfer, default.transfer,
        "one GPU: the single-GPU default"
    );
    for gpus in [2, 3, 8, 64] {
        let o = LoadOptions::for_gpus(gpus);
        let t = o.transfer.fill_threads;
        assert_eq!(t, (cores / gpus).clamp(2, 16), "{gpus} GPUs");
        assert_eq!(o.transfer.staging_buffers, 2 * t);
        assert_eq!(o.transfer.chunk_bytes, 2 << 20);
    }
}

/// Loaders over GPUs 0..n for every n the machine has, or None after a printed skip.
fn loaders_or_skip(test: &str) -> Option<Vec<MultiLoader>> {
    let count = match Gpu::count() {
        Ok(n) if n > 0 => n,
        Ok(_) => {
            gpufeed_testkit::skip_without_gpu(test, &"no CUDA device");
            return None;
        }
        Err(e) => {
            gpufeed_testkit::skip_without_gpu(test, &e);
            return None;
        }
    };
    if count == 1 {
        eprintln!("{test}: one GPU: only the N=1 path runs here (N=2 on the two-GPU machine)");
    }
    Some(
        (1..=count.min(4))
            .map(|n| {
                let ordinals: Vec<usize> = (0..n).collect();
                MultiLoader::open(&ordinals, LoadOptions::for_gpus(n)).expect("multi loader")
            })
            .collect(),
    )
}

#[test]
fn sharded_loads_are_byte_exact_on_every_gpu() {
    let Some(multis) = loaders_or_skip("sharded_loads_are_byte_exact_on_every_gpu") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let made = files(
        dir.path(),
        &[(5 << 20) + 3, (17 << 20) + 1, 1, 0, (9 << 20) + 4095],
        11,
    );
    let (paths, data): (Vec<PathBuf>, Vec<Vec<u8>>) = made.into_iter().unzip();
    for multi in &multis {
        let n = multi.len();
        for plan in [
            ShardPlan::split_bytes(&paths, n).expect("plan"),
            ShardPlan::file_per_rank(&paths, n).expect("plan"),
        ] {
            let (bufs, report) = multi.load_sharded(&plan).expect("sharded load");
            assert_eq!(bufs.len(), n);
            for (rank, buf) in bufs.iter().enumerate() {
                let gpu = multi.loaders()[rank].gpu();
                let want = expected(&plan, rank, &data);
                let got = gpu.to_vec(buf).expect("copy back");
                assert_eq!(
                    xxh3_64(&got),
                    xxh3_64(&want),
                    "N={n} rank {rank}: bytes differ"
                );
                assert_eq!(report.read_bytes[rank], want.len() as u64);
            }
        }
    }
}

#[test]
fn tensor_parallel_loads_match_the_cut_on_every_gpu() {
    let Some(multis) = loaders_or_skip("tensor_parallel_loads_match_the_cut_on_every_gpu") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let tensors = [
        (vec![1027, 515], Dtype::F16),
        (vec![515], Dtype::F32),
        (vec![3, 1001, 7], Dtype::BF16),
        (vec![1], Dtype::U8),
        (vec![4096, 1024], Dtype::F32),
    ];
    let (path, want) = checkpoint(dir.path(), &tensors, 21);
    for multi in &multis {
        for split in [Split::Rows, Split::Columns] {
            let plan = TensorParallel::plan(&path, multi.len(), split).expect("plan");
            let (ckpts, _) = multi.load_tensor_parallel(&plan).expect("load");
            for (rank, ckpt) in ckpts.iter().enumerate() {
                for share in plan.shares(rank, 0) {
                    let (dtype, shape, bytes) = &want[&share.name];
                    let (info, view) = ckpt.get(&share.name).expect("tensor");
                    assert_eq!(info.shape, share.share_shape(split));
                    let mut host = vec![0u8; view.len()];
                    ckpt.gpu()
                        .default_stream()
                        .memcpy_dtoh(&view, &mut host)
                        .expect("copy back");
                    let reference = cut(
                        bytes,
                        shape,
                        dtype.bitsize() / 8,
                        split.dim(),
                        share.indices.clone(),
                    );
                    assert!(
                        host == reference,
                        "N={} {split:?} rank {rank} {}: bytes differ",
                        multi.len(),
                        share.name
                    );
                }
            }
        }
    }
}

#[test]
fn replicated_loads_are_byte_exact_on_every_gpu() {
    let Some(multis) = loaders_or_skip("replicated_loads_are_byte_exact_on_every_gpu") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let (path, data) = files(dir.path(), &[(48 << 20) + 5], 31).remove(0);
    let (ckpt, want) = checkpoint(
        dir.path(),
        &[(vec![3001, 1025], Dtype::F32), (vec![7], Dtype::U8)],
        41,
    );
    for multi in multis {
        let n = multi.len();
        // Rounds of 4 MiB: several rounds per GPU, the last one short.
        let multi = multi.with_round_bytes(4 << 20);
        let (bufs, report) = multi.load_replicated(&path).expect("replicated load");
        assert_eq!(bufs.len(), n);
        for (g, buf) in bufs.iter().enumerate() {
            let got = multi.loaders()[g].gpu().to_vec(buf).expect("copy back");
            assert_eq!(xxh3_64(&got), xxh3_64(&data), "N={n} GPU {g}: bytes differ");
            assert_eq!(
                report.read_bytes[g] + report.peer_bytes[g],
                data.len() as u64
            );
        }
        assert_eq!(report.read_bytes.iter().sum::<u64>(), data.len() as u64);
        let (ckpts, _) = multi
            .load_replicated_safetensors(&ckpt)
            .expect("replicated checkpoint");
        for c in &ckpts {
            for (name, (_, shape, bytes)) in &want {
                let (info, view) = c.get(name).expect("tensor");
                assert_eq!(&info.shape, shape);
                let mut host = vec![0u8; view.len()];
                c.gpu()
                    .default_stream()
                    .memcpy_dtoh(&view, &mut host)
                    .expect("copy back");
                assert!(
                    &host == bytes,
                    "N={n} {name} on GPU {}",
                    c.gpu().info().ordinal
                );
            }
        }
    }
}

/// The variables `RankLoader::from_env` reads, cleared in the children unless given.
const RANK_VARS: [&str; 9] = [
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GPUFEED_JOB",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "GPUFEED_REPLICATE",
];

fn rank_child(vars: &[(&str, String)]) -> std::process::Command {
    let mut cmd = gpufeed_testkit::child_command("multi::rank_dispatcher", "rank", &[]);
    for v in RANK_VARS {
        cmd.env_remove(v);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd
}

fn run(cmd: &mut std::process::Command) -> (bool, String) {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn a rank");
    run_to_end(child)
}

/// A rank process: `RankLoader::from_env`, then (with `GPUFEED_IT_FILE`) a replicated, a
/// sharded and a tensor-parallel load, each checked against the files, then a plan that
/// differs between ranks.
#[test]
fn rank_dispatcher() {
    if std::env::var(gpufeed_testkit::CHILD_ROLE).as_deref() != Ok("rank") {
        return;
    }
    let rank = match gpufeed_multi::RankLoader::from_env() {
        Ok(r) => r,
        Err(e) => {
            println!("ERR {e}");
            println!("NOGPU {}", e.is_no_gpu());
            return;
        }
    };
    let Ok(file) = std::env::var("GPUFEED_IT_FILE") else {
        println!("JOINED {} of {}", rank.rank(), rank.world());
        return;
    };
    // How replicated loads copy: "1" shared staging, "0" IPC handles, "nccl".
    let via = std::env::var("GPUFEED_IT_STAGING").unwrap_or_else(|_| "1".into());
    let (staged, nccl) = (via == "1", via == "nccl");
    let rank = rank.with_shared_staging(staged).with_nccl(nccl);
    if std::env::var("GPUFEED_IT_UNTIL_ERROR").is_ok() {
        return replicate_until_an_error(rank, &file);
    }
    let rank = rank.with_round_bytes(4 << 20);
    let (r, n) = (rank.rank(), rank.world());
    let gpu = rank.loader().gpu().clone();
    let data = std::fs::read(&file).expect("read");
    assert_eq!(rank.shares_staging(), None);
    let (buf, report) = match rank.load_replicated(&file) {
        Err(e) if nccl => {
            // Through NCCL: ranks sharing a GPU are refused, saying so.
            println!("NCCL ERR {e}");
            return;
        }
        other => other.expect("replicated"),
    };
    assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), xxh3_64(&data));
    assert_eq!(report.read_bytes + report.peer_bytes, data.len() as u64);
    // A GPU machine's driver shares pools; a second load reuses the staging slots (or the
    // NCCL communicator).
    let expect = match (nccl, staged && n > 1) {
        (true, _) => Some(false),
        (false, true) => Some(true),
        (false, false) => None,
    };
    assert_eq!(rank.shares_staging(), expect);
    if nccl {
        assert!(
            report.peer_open_seconds > 0.0,
            "the communicator: {report:?}"
        );
    }
    drop(buf);
    let (buf, report) = rank.load_replicated(&file).expect("replicated again");
    assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), xxh3_64(&data));
    // The breakdown: memory was allocated; through IPC handles the other rank's copy was
    // opened (staging maps the slots once, NCCL's communicator is made once); no part is
    // longer than the whole.
    assert!(report.alloc_seconds > 0.0, "{report:?}");
    assert_eq!(
        report.peer_open_seconds > 0.0,
        n > 1 && via == "0",
        "{report:?}"
    );
    for part in [
        report.alloc_seconds,
        report.peer_open_seconds,
        report.peer_close_seconds,
        report.exchange_seconds,
    ] {
        assert!(part <= report.seconds, "{report:?}");
    }
    rank.barrier().expect("barrier");
    println!("VERIFIED replicated");
    let other = std::env::var("GPUFEED_IT_FILE2").expect("file 2");
    let plan = ShardPlan::split_bytes(&[&file, &other], n).expect("plan");
    let (buf, _) = rank.load_sharded(&plan).expect("sharded");
    let both = [data.clone(), std::fs::read(&other).expect("read")];
    assert_eq!(
        xxh3_64(&gpu.to_vec(&buf).expect("back")),
        xxh3_64(&expected(&plan, r, &both))
    );
    println!("VERIFIED sharded");
    let ckpt = std::env::var("GPUFEED_IT_CKPT").expect("checkpoint");
    let plan = TensorParallel::plan(&ckpt, n, Split::Columns).expect("plan");
    let (shard, _) = rank.load_tensor_parallel(&plan).expect("tensor-parallel");
    let header = gpufeed_safetensors::inspect(&ckpt).expect("inspect");
    let bytes = std::fs::read(&ckpt).expect("read");
    for share in plan.shares(r, 0) {
        let gpufeed_safetensors::HeaderEntry {
            dtype,
            shape,
            range,
            ..
        } = header[0]
            .tensors
            .iter()
            .find(|t| t.name == share.name)
            .expect("tensor");
        let start = header[0].data_start as usize;
        let whole = &bytes[start + range.start..start + range.end];
        let want = cut(whole, shape, dtype.bitsize() / 8, 1, share.indices.clone());
        let (_, view) = shard.get(&share.name).expect("tensor");
        let mut host = vec![0u8; view.len()];
        gpu.default_stream()
            .memcpy_dtoh(&view, &mut host)
            .expect("back");
        assert!(host == want, "rank {r} {}", share.name);
    }
    println!("VERIFIED tensor-parallel");
    if n > 1 {
        // Rank 0 plans over one file, the others over the other: every rank is told.
        let mine = if r == 0 { &file } else { &other };
        let plan = ShardPlan::split_bytes(&[mine], n).expect("plan");
        match rank.load_sharded(&plan) {
            Err(Error::RanksDisagree { rank, .. }) => println!("DISAGREE {rank}"),
            other => panic!("expected a disagreement, got {other:?}"),
        }
        match rank.load_replicated(&file) {
            Err(e) => println!("AFTER {e}"),
            Ok(_) => panic!("a rank that left still loads"),
        }
    }
    // With shared staging a rank frees its slots only once every other rank has let go of
    // them: the last rank keeps its loader a second longer, and the others' drops wait.
    if r + 1 == n {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    let t = std::time::Instant::now();
    drop(rank);
    println!("DROPPED {}", t.elapsed().as_millis());
}

/// A rank's part in `a_rank_killed_during_replicated_loads_is_named_and_the_gpu_still_works`:
/// replicated loads of `file` (1 MiB rounds: hundreds of meetings per load) until one fails;
/// prints the error, then loads the file through the rank's own loader and checks it.
fn replicate_until_an_error(rank: gpufeed_multi::RankLoader, file: &str) {
    let rank = rank.with_round_bytes(1 << 20);
    let want = xxh3_64(&std::fs::read(file).expect("read"));
    println!("LOADING");
    let e = loop {
        match rank.load_replicated(file) {
            Ok((buf, _)) => drop(buf),
            Err(e) => break e,
        }
    };
    println!("ERR {e}");
    let (buf, _) = rank
        .loader()
        .load_file(file)
        .expect("a load after the error");
    let back = rank.loader().gpu().to_vec(&buf).expect("back");
    assert_eq!(xxh3_64(&back), want);
    println!("GPU OK");
}

/// A rank killed (SIGKILL) in the middle of replicated loads, through shared staging and
/// through IPC handles: the other rank's load fails naming it within a few seconds, and its GPU
/// still loads byte for byte afterwards (the dead rank's memory it was copying out of, or into,
/// leaves no error on its context).
#[test]
fn a_rank_killed_during_replicated_loads_is_named_and_the_gpu_still_works() {
    use std::io::BufRead;
    let test = "a_rank_killed_during_replicated_loads_is_named_and_the_gpu_still_works";
    match Gpu::count() {
        Ok(n) if n > 0 => {}
        Ok(_) => return gpufeed_testkit::skip_without_gpu(test, &"no CUDA device"),
        Err(e) => return gpufeed_testkit::skip_without_gpu(test, &e),
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let made = files(dir.path(), &[(512 << 20) + 4099], 71);
    // Through NCCL too where it can run: a rank killed while the other waits inside NCCL.
    let mut ways = vec!["1", "0"];
    match nccl_ready(test, 2) {
        Ok(()) => ways.push("nccl"),
        Err(why) => println!("{test}: not through NCCL: {why}"),
    }
    for staged in ways {
        let job = format!("it-killed-{}-{staged}", std::process::id());
        let spawn = |r: usize| {
            rank_child(&[
                ("LOCAL_RANK", r.to_string()),
                ("LOCAL_WORLD_SIZE", "2".into()),
                ("GPUFEED_JOB", job.clone()),
                ("GPUFEED_IT_FILE", made[0].0.display().to_string()),
                ("GPUFEED_IT_STAGING", staged.into()),
                ("GPUFEED_IT_UNTIL_ERROR", "1".into()),
                ("GPUFEED_REQUIRE_GPU", "1".into()),
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn a rank")
        };
        let survivor = spawn(0);
        let mut victim = spawn(1);
        let mut lines = std::io::BufReader::new(victim.stdout.take().expect("stdout")).lines();
        assert!(
            lines.any(|l| l.is_ok_and(|l| l == "LOADING")),
            "rank 1 never started loading"
        );
        // Some loads in.
        std::thread::sleep(std::time::Duration::from_millis(700));
        victim.kill().expect("kill rank 1");
        let killed = std::time::Instant::now();
        victim.wait().expect("reap");
        // A survivor that hangs fails the test instead of hanging it.
        let pid = survivor.id();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(survivor.wait_with_output()));
        let Ok(out) = rx.recv_timeout(std::time::Duration::from_secs(60)) else {
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
            panic!("staged {staged}: rank 0 still waits a minute after rank 1 was killed");
        };
        let out = out.expect("wait");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "staged {staged}:\n{text}");
        assert!(text.contains("ERR rank 1 "), "staged {staged}:\n{text}");
        assert!(text.contains("GPU OK"), "staged {staged}:\n{text}");
        assert!(
            killed.elapsed() < std::time::Duration::from_secs(15),
            "staged {staged}: {:?}",
            killed.elapsed()
        );
    }
}

/// Whether replicated loads through NCCL can run here with `ranks` ranks: NCCL loads, and
/// there is a GPU per rank; else why not. A GPU machine (`GPUFEED_REQUIRE_GPU=1`) without
/// NCCL fails the test.
fn nccl_ready(test: &str, ranks: usize) -> Result<(), String> {
    if let Err(e) = gpufeed_cuda::nccl_version() {
        assert!(
            !gpufeed_testkit::gpu_required(),
            "{test}: GPUFEED_REQUIRE_GPU=1 and {e}"
        );
        return Err(e.to_string());
    }
    match Gpu::count() {
        Ok(n) if n >= ranks => Ok(()),
        Ok(n) => Err(format!("{n} GPU(s) for {ranks} ranks")),
        Err(e) => Err(e.to_string()),
    }
}

/// Replicated loads through NCCL, a process per rank: a job of one rank (every NCCL call of
/// the path: the communicator, broadcast groups, the waits, its teardown), a job of two where
/// there are two GPUs (each rank's bytes checked); with one GPU, two ranks are each told that
/// NCCL needs a GPU per rank; and a rank that cannot load NCCL says so.
#[test]
fn replicated_loads_through_nccl_are_byte_exact_or_say_why_not() {
    let test = "replicated_loads_through_nccl_are_byte_exact_or_say_why_not";
    let gpus = match Gpu::count() {
        Ok(n) if n > 0 => n,
        Ok(_) => return gpufeed_testkit::skip_without_gpu(test, &"no CUDA device"),
        Err(e) => return gpufeed_testkit::skip_without_gpu(test, &e),
    };
    if let Err(why) = nccl_ready(test, 1) {
        return gpufeed_testkit::skip(test, &why);
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let made = files(dir.path(), &[(21 << 20) + 7, (3 << 20) + 1], 53);
    let (ckpt, _) = checkpoint(dir.path(), &[(vec![129, 514], Dtype::F16)], 63);
    let ranks = |n: usize, tag: &str, extra: &[(&str, String)]| -> Vec<String> {
        let job = format!("it-nccl-{}-{tag}", std::process::id());
        let children: Vec<_> = (0..n)
            .map(|r| {
                let mut vars = vec![
                    ("LOCAL_RANK", r.to_string()),
                    ("LOCAL_WORLD_SIZE", n.to_string()),
                    ("GPUFEED_JOB", job.clone()),
                    ("GPUFEED_IT_STAGING", "nccl".into()),
                    ("GPUFEED_IT_FILE", made[0].0.display().to_string()),
                    ("GPUFEED_IT_FILE2", made[1].0.display().to_string()),
                    ("GPUFEED_IT_CKPT", ckpt.display().to_string()),
                    ("GPUFEED_REQUIRE_GPU", "1".into()),
                ];
                vars.extend(extra.iter().cloned());
                rank_child(&vars)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("spawn a rank")
            })
            .collect();
        children
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let (ok, text) = run_to_end(c);
                assert!(ok, "{tag} rank {r}:\n{text}");
                text
            })
            .collect()
    };
    let verified = |text: &str| {
        ["replicated", "sharded", "tensor-parallel"]
            .iter()
            .all(|w| text.contains(&format!("VERIFIED {w}")))
    };
    for text in ranks(1, "one", &[]) {
        assert!(verified(&text), "one rank:\n{text}");
    }
    for text in ranks(2, "two", &[]) {
        if gpus >= 2 {
            assert!(verified(&text), "two ranks:\n{text}");
            assert!(text.contains("DISAGREE 1"), "{text}");
        } else {
            assert!(
                text.contains("NCCL ERR") && text.contains("need a GPU per rank"),
                "two ranks on one GPU:\n{text}"
            );
        }
    }
    let missing = [(
        "GPUFEED_NCCL_LIBRARY",
        "/nonexistent/libnccl.so.2".to_owned(),
    )];
    for text in ranks(1, "missing", &missing) {
        assert!(
            text.contains("NCCL ERR") && text.contains("NCCL could not be loaded (/nonexistent"),
            "no NCCL:\n{text}"
        );
    }
}

/// A child's exit status and its stdout and stderr together.
fn run_to_end(c: std::process::Child) -> (bool, String) {
    let out = c.wait_with_output().expect("wait");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `cmd` (a rank child) run by a shell of its own with `LOCAL_RANK` set to each of `ranks`: the
/// shell is the ranks' launcher (their parent), as torchrun's agent is, in a process group of
/// its own (killed whole by [`kill_group`]).
fn launched(cmd: &std::process::Command, ranks: &[usize]) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let script: String = ranks
        .iter()
        .map(|r| format!("LOCAL_RANK={r} \"$@\" & "))
        .chain(["wait".to_owned()])
        .collect();
    gpufeed_testkit::wrapped(&["sh", "-c", &script, "sh"], cmd)
        .process_group(0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn a launcher")
}

fn kill_group(c: &std::process::Child) {
    let group = rustix::process::Pid::from_child(c);
    let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
}

/// Two torchrun-like jobs on one machine with torchrun's default run id (`none`) and the same
/// master address never meet (before, both ranks named their rendezvous `gpufeed-rdv-none`
/// and joined each other's job); the ranks of one launcher do.
#[test]
fn two_jobs_with_torchruns_default_run_id_never_meet() {
    let port = (20_000 + std::process::id() % 40_000).to_string();
    let rank = rank_child(&[
        ("LOCAL_WORLD_SIZE", "2".into()),
        ("TORCHELASTIC_RUN_ID", "none".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.clone()),
    ]);
    // Job A's rank 0 and job B's rank 1, each started by its own launcher.
    let (a, b) = (launched(&rank, &[0]), launched(&rank, &[1]));
    let t = std::time::Instant::now();
    let mut a_b = [a, b];
    while t.elapsed() < std::time::Duration::from_secs(4) {
        for c in &mut a_b {
            if let Some(status) = c.try_wait().expect("wait") {
                panic!("a rank finished ({status}): ranks of two jobs met");
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    for c in a_b {
        kill_group(&c);
        let (_, out) = run_to_end(c);
        assert!(!out.contains("JOINED") && !out.contains("NOGPU"), "{out}");
    }
    // Rank 0 of job A created its rendezvous before it was killed.
    for e in std::fs::read_dir("/dev/shm")
        .expect("ls /dev/shm")
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("gpufeed-rdv-none-127.0.0.1-{port}-")) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    // Both ranks from one launcher: one job, they meet (and without a GPU both say so).
    let (ok, out) = run_to_end(launched(&rank, &[0, 1]));
    assert!(ok, "{out}");
    let met = match Gpu::count() {
        Ok(n) if n > 0 => out.matches("JOINED").count(),
        _ => out.matches("NOGPU true").count(),
    };
    assert_eq!(met, 2, "{out}");
}

#[test]
fn a_rank_loader_names_what_is_missing() {
    let (_, out) = run(&mut rank_child(&[]));
    assert!(
        out.contains("ERR invalid setting: LOCAL_RANK is not set"),
        "{out}"
    );
    let (_, out) = run(&mut rank_child(&[
        ("LOCAL_RANK", "x".into()),
        ("LOCAL_WORLD_SIZE", "1".into()),
    ]));
    assert!(out.contains("LOCAL_RANK=\"x\" is not a number"), "{out}");
    let (_, out) = run(&mut rank_child(&[
        ("LOCAL_RANK", "0".into()),
        ("LOCAL_WORLD_SIZE", "1".into()),
    ]));
    assert!(out.contains("no job name"), "{out}");
    let (_, out) = run(&mut rank_child(&[
        ("LOCAL_RANK", "0".into()),
        ("LOCAL_WORLD_SIZE", "1".into()),
        ("GPUFEED_JOB", "it-env-bogus".into()),
        ("GPUFEED_REPLICATE", "carrier-pigeon".into()),
    ]));
    assert!(
        out.contains(
            "GPUFEED_REPLICATE=\"carrier-pigeon\": use staging (the default), ipc or nccl"
        ),
        "{out}"
    );
    let job = format!("it-env-{}", std::process::id());
    let (ok, out) = run(&mut rank_child(&[
        ("LOCAL_RANK", "0".into()),
        ("LOCAL_WORLD_SIZE", "1".into()),
        ("GPUFEED_JOB", job),
    ]));
    assert!(ok, "{out}");
    match Gpu::count() {
        Ok(n) if n > 0 => assert!(out.contains("JOINED 0 of 1"), "{out}"),
        _ => assert!(out.contains("NOGPU true"), "without a GPU: {out}"),
    }
}

#[test]
fn one_process_per_gpu_loads_replicated_sharded_and_tensor_parallel() {
    let test = "one_process_per_gpu_loads_replicated_sharded_and_tensor_parallel";
    let n = match Gpu::count() {
        // One GPU: two ranks share it (`from_env` maps LOCAL_RANK modulo the GPUs).
        Ok(n) if n > 0 => n.clamp(2, 4),
        Ok(_) => return gpufeed_testkit::skip_without_gpu(test, &"no CUDA device"),
        Err(e) => return gpufeed_testkit::skip_without_gpu(test, &e),
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let made = files(dir.path(), &[(21 << 20) + 7, (3 << 20) + 1], 51);
    let (ckpt, _) = checkpoint(
        dir.path(),
        &[(vec![513, 1030], Dtype::F16), (vec![77], Dtype::F32)],
        61,
    );
    // Replicated loads through shared staging slots, then through CUDA IPC handles.
    for staged in ["1", "0"] {
        let job = format!("it-ranks-{}-{staged}", std::process::id());
        let children: Vec<_> = (0..n)
            .map(|r| {
                rank_child(&[
                    ("LOCAL_RANK", r.to_string()),
                    ("LOCAL_WORLD_SIZE", n.to_string()),
                    ("GPUFEED_JOB", job.clone()),
                    ("GPUFEED_IT_STAGING", staged.into()),
                    ("GPUFEED_IT_FILE", made[0].0.display().to_string()),
                    ("GPUFEED_IT_FILE2", made[1].0.display().to_string()),
                    ("GPUFEED_IT_CKPT", ckpt.display().to_string()),
                    ("GPUFEED_REQUIRE_GPU", "1".into()),
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn a rank")
            })
            .collect();
        for (r, c) in children.into_iter().enumerate() {
            let (ok, text) = run_to_end(c);
            assert!(ok, "rank {r}:\n{text}");
            for what in ["replicated", "sharded", "tensor-parallel"] {
                assert!(
                    text.contains(&format!("VERIFIED {what}")),
                    "rank {r}: {what}\n{text}"
                );
            }
            assert!(text.contains("DISAGREE 1"), "rank {r}\n{text}");
            assert!(text.contains("AFTER "), "rank {r}\n{text}");
            let dropped: u64 = text
                .lines()
                .find_map(|l| l.strip_prefix("DROPPED "))
                .and_then(|ms| ms.trim().parse().ok())
                .unwrap_or_else(|| panic!("rank {r}: no DROPPED\n{text}"));
            if staged == "1" && r + 1 < n {
                assert!(
                    dropped >= 500,
                    "rank {r} freed its slots after {dropped} ms\n{text}"
                );
            }
        }
    }
}
