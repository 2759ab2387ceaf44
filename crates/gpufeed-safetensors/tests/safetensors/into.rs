//! `LoadInto` / `load_into` on a GPU: tensors of random bytes at odd sizes (an empty one, ones
//! larger than the staging, pieces crossing both staging buffers) written byte for byte into
//! the caller's device memory, from a file and from an index of shards; bad destinations
//! refused before a byte moves.

use std::collections::HashMap;
use std::path::Path;

use gpufeed_load::{LoadOptions, Loader};
use gpufeed_safetensors::{Dtype, Error, LoadInto, LoadIntoOptions, load_into};

use crate::{file, gpu_or_skip};

/// Writes a safetensors file of `tensors` (name, dtype, shape) with random bytes; returns
/// each tensor's bytes.
fn write(
    path: &Path,
    tensors: &[(&str, Dtype, Vec<usize>)],
    seed: u64,
) -> HashMap<String, Vec<u8>> {
    let (bytes, by_name) = file(tensors, seed, None);
    std::fs::write(path, bytes).expect("write");
    by_name
}

fn tensors_a() -> Vec<(&'static str, Dtype, Vec<usize>)> {
    vec![
        ("a.odd", Dtype::U8, vec![1_000_003]),
        ("a.empty", Dtype::F32, vec![0, 7]),
        ("a.large", Dtype::BF16, vec![1_500_001]),
        ("a.small", Dtype::F64, vec![3, 5]),
        ("a.mid", Dtype::F16, vec![777, 1_001]),
    ]
}

#[test]
fn tensors_land_byte_for_byte_in_the_callers_memory() {
    let Some(gpu) = gpu_or_skip("tensors_land_byte_for_byte_in_the_callers_memory") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let one = dir.path().join("one.safetensors");
    let want_a = write(&one, &tensors_a(), 71);
    // An index of two shards (as transformers writes them).
    let (s1, s2) = (
        dir.path().join("m-1.safetensors"),
        dir.path().join("m-2.safetensors"),
    );
    let want_1 = write(
        &s1,
        &[
            ("b.x", Dtype::I32, vec![333_333]),
            ("b.y", Dtype::U8, vec![5]),
        ],
        72,
    );
    let want_2 = write(&s2, &[("c.z", Dtype::F32, vec![2, 700_001])], 73);
    let index = dir.path().join("m.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"metadata": {}, "weight_map": {"b.x": "m-1.safetensors", "b.y": "m-1.safetensors", "c.z": "m-2.safetensors"}}"#,
    )
    .expect("index");
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let stream = gpu.default_stream();
    for (path, want) in [
        (one.as_path(), want_a.clone()),
        (index.as_path(), want_1.into_iter().chain(want_2).collect()),
    ] {
        // Staging of 1 MiB: the large tensors arrive in pieces, through both buffers by turns.
        for staging in [1 << 20, 64 << 20] {
            let mut dsts: HashMap<String, _> = want
                .iter()
                .map(|(n, b)| (n.clone(), stream.alloc_zeros::<u8>(b.len()).expect("alloc")))
                .collect();
            let opts = LoadIntoOptions::default().with_staging_bytes(staging);
            let report = load_into(&loader, path, &mut dsts, &opts).expect("load_into");
            assert_eq!(report.tensors, want.len());
            assert_eq!(
                report.bytes,
                want.values().map(|b| b.len() as u64).sum::<u64>()
            );
            assert!(
                report.staging_bytes <= 2 * staging as u64,
                "{}",
                report.staging_bytes
            );
            for (name, bytes) in &want {
                let got = stream.clone_dtoh(&dsts[name]).expect("copy back");
                assert_eq!(
                    xxhash_rust::xxh3::xxh3_64(&got),
                    xxhash_rust::xxh3::xxh3_64(bytes),
                    "{name} from {} with {staging} B of staging",
                    path.display()
                );
            }
        }
    }

    // Some tensors only: the others' memory is left alone.
    let ckpt = LoadInto::open(&one).expect("open");
    let mut mine = stream
        .alloc_zeros::<u8>(want_a["a.mid"].len())
        .expect("alloc");
    let report = ckpt
        .run(&loader, &["a.mid"], &LoadIntoOptions::default(), |piece| {
            assert_eq!(piece.name, "a.mid");
            let end = piece.offset + piece.bytes.len();
            piece
                .stream
                .memcpy_dtod(&piece.bytes, &mut mine.slice_mut(piece.offset..end))
                .map_err(|e| Error::invalid(e.to_string()))
        })
        .expect("run");
    assert_eq!(report.tensors, 1);
    assert_eq!(
        stream.clone_dtoh(&mine).expect("copy back"),
        want_a["a.mid"]
    );

    // Refused before a byte moves: a name the checkpoint lacks, a destination of the wrong size.
    let mut wrong = HashMap::from([(
        "a.odd".to_owned(),
        stream
            .alloc_zeros::<u8>(want_a["a.odd"].len() - 1)
            .expect("alloc"),
    )]);
    let e = load_into(&loader, &one, &mut wrong, &LoadIntoOptions::default()).expect_err("size");
    assert!(e.to_string().contains("a.odd"), "{e}");
    assert_eq!(
        stream.clone_dtoh(&wrong["a.odd"]).expect("back"),
        vec![0; want_a["a.odd"].len() - 1]
    );
    let mut missing = HashMap::from([(
        "nope".to_owned(),
        stream.alloc_zeros::<u8>(4).expect("alloc"),
    )]);
    let e = load_into(&loader, &one, &mut missing, &LoadIntoOptions::default()).expect_err("name");
    assert!(matches!(e, Error::NoTensor { .. }), "{e}");
}

/// `run_ranges` of row shares (`LoadInto::rows`): each of 3 ranks' rows of 2-d tensors (one
/// larger than the 1 MiB staging) land byte for byte, delivered from offset 0 of each share,
/// and only the shares' bytes are counted; a range past a tensor's end is refused.
#[test]
fn row_shares_land_byte_for_byte_from_their_own_offset() {
    let Some(gpu) = gpu_or_skip("row_shares_land_byte_for_byte_from_their_own_offset") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rows.safetensors");
    let shapes = [
        ("w", Dtype::F32, vec![1001usize, 333]),
        ("v", Dtype::F16, vec![7, 5]),
    ];
    let want = write(&path, &shapes, 74);
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let stream = gpu.default_stream();
    let ckpt = LoadInto::open(&path).expect("open");
    let opts = LoadIntoOptions::default().with_staging_bytes(1 << 20);
    for r in 0..3usize {
        let mut asked = Vec::new();
        for (name, _, shape) in &shapes {
            let n = shape[0];
            let bytes = ckpt.rows(name, r * n / 3..(r + 1) * n / 3).expect("rows");
            asked.push((*name, bytes));
        }
        let mut dsts: HashMap<&str, _> = asked
            .iter()
            .map(|(n, b)| (*n, stream.alloc_zeros::<u8>(b.len()).expect("alloc")))
            .collect();
        let report = ckpt
            .run_ranges(&loader, &asked, &opts, |piece| {
                let dst = dsts.get_mut(piece.name).expect("asked for");
                let end = piece.offset + piece.bytes.len();
                piece
                    .stream
                    .memcpy_dtod(&piece.bytes, &mut dst.slice_mut(piece.offset..end))
                    .map_err(|e| Error::invalid(e.to_string()))
            })
            .expect("run_ranges");
        let total: usize = asked.iter().map(|(_, b)| b.len()).sum();
        assert_eq!(report.bytes, total as u64, "rank {r}: only its shares read");
        for (name, bytes) in &asked {
            let got = gpu.to_vec(&dsts[name]).expect("back");
            assert!(
                got == want[*name][bytes.clone()],
                "rank {r}: {name}'s rows differ"
            );
        }
    }
    let past = ckpt
        .run_ranges(&loader, &[("v", 0..71)], &opts, |_| Ok(()))
        .expect_err("past the end");
    assert!(past.to_string().contains("tensor v"), "{past}");
}

#[test]
fn column_shares_land_byte_for_byte_through_pitched_copies() {
    let Some(gpu) = gpu_or_skip("column_shares_land_byte_for_byte_through_pitched_copies") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("columns.safetensors");
    // Rows of 1,332 and 666 bytes: a 1 MiB staging cuts the spans inside runs.
    let shapes = [
        ("w", Dtype::F32, vec![1001usize, 333]),
        ("h", Dtype::F16, vec![4099, 333]),
        ("c", Dtype::BF16, vec![10, 4, 37]),
    ];
    let want = write(&path, &shapes, 75);
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let stream = gpu.default_stream();
    let ckpt = LoadInto::open(&path).expect("open");
    let opts = LoadIntoOptions::default().with_staging_bytes(1 << 20);
    for ranks in [1usize, 2, 3] {
        for r in 0..ranks {
            let mut asked = Vec::new();
            let mut shares = HashMap::new();
            for (name, _, shape) in &shapes {
                let dim = shape.len() - 1;
                let n = shape[dim];
                let cols = r * n / ranks..(r + 1) * n / ranks;
                let (bytes, share) = ckpt.narrow(name, dim, cols.clone()).expect("narrow");
                asked.push((*name, bytes));
                // The part on the CPU: for each run (the leading indices), its columns.
                let elem = want[*name].len() / shape.iter().product::<usize>();
                let row = n * elem;
                let part: Vec<u8> = want[*name]
                    .chunks(row)
                    .flat_map(|run| run[cols.start * elem..cols.end * elem].to_vec())
                    .collect();
                assert_eq!(part.len(), share.bytes());
                shares.insert(*name, (share, part));
            }
            let dsts: HashMap<&str, _> = shares
                .iter()
                .map(|(n, (s, _))| {
                    (
                        *n,
                        stream.alloc_zeros::<u8>(s.bytes().max(1)).expect("alloc"),
                    )
                })
                .collect();
            let addr: HashMap<&str, u64> = dsts
                .iter()
                .map(|(n, d)| {
                    let (ptr, _rec) =
                        gpufeed_cuda::cudarc::driver::DevicePtr::device_ptr(d, &stream);
                    (*n, ptr)
                })
                .collect();
            ckpt.run_ranges(&loader, &asked, &opts, |piece| {
                let (share, _) = &shares[piece.name];
                #[allow(unsafe_code, reason = "the test's own allocations, held to the end")]
                // SAFETY: `addr[name]` is a live allocation of `share.bytes()` bytes (or 1),
                // freed only after `run_ranges` has waited for its stream.
                unsafe {
                    share.copy_piece(&piece, addr[piece.name])
                }
            })
            .expect("run_ranges");
            for (name, (share, part)) in &shares {
                let got = gpu.to_vec(&dsts[name]).expect("back");
                assert!(
                    got[..share.bytes()] == part[..],
                    "{ranks} ranks, rank {r}: {name}'s columns differ"
                );
            }
        }
    }
}
