//! The host cost of reading many small files: `read_parts` (what the `ImageFolder` workers
//! and `load_list` read a batch of files with) against std's `open` + `read_exact` + `close`
//! of each, one thread, warm page cache, no GPU.
//!
//! ```text
//! cargo run --release -p gpufeed-load --example read_parts [FILES] [ROUNDS]
//! ```
//! Writes FILES (default 4,000) files of 60-160 KiB of random bytes in ten class folders of a
//! new temporary directory, reads them all once (warming the cache), then ROUNDS (default 8)
//! times each way, and prints the best round's microseconds per file. Every byte read is
//! checked against what was written (xxh3).

use std::io::Read;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let files: usize = args.next().map_or(Ok(4000), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let dir = tempfile::tempdir()?;
    let mut paths = Vec::with_capacity(files);
    let mut sizes = Vec::with_capacity(files);
    let mut want = 0u64;
    for i in 0..files {
        let len = (60 << 10) + (i * 7919 % (100 << 10));
        let bytes = gpufeed_testkit::random_bytes(len, i as u64);
        want ^= xxhash_rust::xxh3::xxh3_64(&bytes);
        let class = dir.path().join(format!("class-{}", i % 10));
        std::fs::create_dir_all(&class)?;
        let path = class.join(format!("{i:07}.bin"));
        std::fs::write(&path, &bytes)?;
        paths.push(path);
        sizes.push(len);
    }
    let total: usize = sizes.iter().sum();
    let mut out = vec![0u8; total];
    let mut reader = gpufeed_uring::Reader::builder()
        .direct(gpufeed_uring::Direct::Off)
        .queue_depth(32)
        .async_buffered(false)
        .build()?;
    // Each file's bytes in `out`, one after another.
    let check = |out: &[u8]| {
        let mut got = 0u64;
        let mut at = 0;
        for &len in &sizes {
            got ^= xxhash_rust::xxh3::xxh3_64(&out[at..at + len]);
            at += len;
        }
        got == want
    };
    let files_and_sizes: Vec<_> = paths.iter().zip(&sizes).collect();
    for way in ["std", "read_parts", "std", "read_parts"] {
        let mut best = f64::MAX;
        for round in 0..=rounds {
            out.fill(0);
            let t = Instant::now();
            if way == "std" {
                let mut rest = &mut out[..];
                for (path, &len) in paths.iter().zip(&sizes) {
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
                    std::fs::File::open(path)?.read_exact(head)?;
                    rest = tail;
                }
            } else {
                let mut rest = &mut out[..];
                for batch in files_and_sizes.chunks(256) {
                    let mut parts = Vec::with_capacity(batch.len());
                    for &(path, &len) in batch {
                        let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
                        parts.push((path.as_path(), 0u64, head, Some(len as u64)));
                        rest = tail;
                    }
                    gpufeed_load::internal::read_parts(&mut reader, parts)?;
                }
            }
            if round > 0 {
                best = best.min(t.elapsed().as_secs_f64());
            }
            if !check(&out) {
                return Err(format!("{way}: the bytes read differ from those written").into());
            }
        }
        println!(
            "{way:>10}: {:.1} us per file, {:.2} GB/s (best of {rounds} rounds after one untimed, {files} files, one thread)",
            best * 1e6 / files as f64,
            total as f64 / best / 1e9
        );
    }
    Ok(())
}
