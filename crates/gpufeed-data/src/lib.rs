//! # gpufeed-data — layer 3 of gpufeed: the batch loader, from record files, image folders and shards to GPU batches
//!
//! The hybrid data loader of the source material: a record file mapped read-only (or an
//! [`ImageFolder`]: one file per sample in class folders), a sampler (sequential, shuffled by
//! seed, sharded by rank; or elastic, whose [`Position`] resumes a run mid-epoch with another
//! world size; or in shuffled blocks of neighbouring records, [`Order::Blocks`]; or shard by
//! shard, [`Order::Shards`]), and a
//! [`BatchLoader`] whose worker threads gather records (out of the mapping, or with
//! `O_DIRECT`: [`BatchLoaderOptions::direct`]) into pinned (or, without a GPU, locked) buffers and
//! issue their uploads (or have the GPU gather them out of the registered mapping, or out of
//! a folder's files mapped side by side:
//! [`BatchLoaderOptions::gpu_gather`]), several batches in flight, and which yields the batches in a fixed
//! order once each is on the GPU. Records come from a file of fixed or indexed records, an
//! `.npy` array, a WebDataset tar shard ([`sources`]), or a [`ShardSet`] of them. Worker
//! processes hand batches to a trainer through a shared-memory ring ([`ring`]).
//!
//! | module | what |
//! |---|---|
//! | `records` | [`RecordFile`], [`Dataset`], [`ShardSet`]: what a batch is gathered from |
//! | `stream` | [`StreamedShards`]: shards fetched (from object storage, the `object` feature) as the epoch needs them |
//! | `sampler` | [`Sampler`], [`Order`], [`Position`]: which records, in which order |
//! | `loader` | [`BatchLoader`], [`BatchLoaderOptions`], [`Batch`]: the loader and its settings |
//! | `gather` | the worker threads: gather, transform, upload |
//! | `epoch` | [`Epoch`], [`OwnedEpoch`]: the batches of an epoch, in order |
//! | [`sources`] | `.npy` arrays and WebDataset tar shards as records |
//! | [`ring`] | batches of worker processes through a shared-memory ring |
//! | `folder` | [`ImageFolder`]: class folders of files |
//! | `images` | [`decode_jpeg`], [`jpeg_header`], [`OnBadImage`]: JPEGs decoded on the CPU |
//! | `augment` | [`random_resized_crop`], [`center_crop`], [`resize_crop`], [`normalize_chw`]: training crops on the CPU |
//! | `decode` | [`ImageDecoder`], [`decode_on_cpu`]: batches of JPEGs decoded into device memory (nvJPEG, the CPU decoder for what it refuses), or on the host |
//! | `image_loader` | [`ImageLoader`], [`ImageOptions`], [`ImageBatch`]: training batches of decoded, augmented images from image folders and WebDataset shards |
//!
//! Without a GPU the loader yields host batches; every CPU path keeps working.
//!
//! Depends on `gpufeed-load` (file lists, device buffers), `gpufeed-os`, `gpufeed-uring`,
//! `gpufeed-pinned`, `gpufeed-cuda` and `gpufeed-ipc` (the batch ring); not on the checkpoint
//! or multi-GPU crates.
//!
//! The `gpufeed` facade re-exports it as `gpufeed::dataset`.
//!
//! # Example
//! ```
//! use gpufeed_data::{BatchLoader, BatchLoaderOptions, Order, RecordFile, Sampler};
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("train.bin");
//! std::fs::write(&path, vec![7u8; 100 * 64])?; // 100 records of 64 bytes
//! // SAFETY: the file is not changed while it is used.
//! let records = unsafe { RecordFile::open_fixed(&path, 64)? };
//! let sampler = Sampler::new(Order::Shuffled { seed: 7 });
//! let cfg = BatchLoaderOptions::default().with_batch_size(32);
//! // `Some(&gpu)` puts the batches on a GPU; `None` gives host batches.
//! let mut loader = BatchLoader::new(records, sampler, cfg, None)?;
//! let mut seen = 0;
//! for batch in loader.epoch(0)? {
//!     seen += batch?.indices.len();
//! }
//! assert_eq!(seen, 100);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_code)]

mod augment;
mod decode;
mod device_batch;
mod epoch;
mod error;
mod folder;
mod gather;
mod image_loader;
mod images;
mod loader;
mod records;
pub mod ring;
mod sampler;
pub mod sources;
mod stream;

pub use augment::{
    Augmentation, Crop, center_crop, normalize_chw, random_flip, random_resized_crop, resize_crop,
    to_u8,
};
pub use decode::{AugmentedBatch, DecodedBatch, DecodedWith, ImageDecoder, Layout, decode_on_cpu};
pub use device_batch::DeviceBatch;
pub use epoch::{Epoch, NotStarted, OwnedEpoch};
pub use error::{Error, Result};
pub use folder::ImageFolder;
pub use image_loader::{
    ImageBatch, ImageData, ImageEpoch, ImageLoader, ImageOptions, OwnedImageEpoch,
};
pub use images::{
    DecodedImage, ImageError, JpegHeader, MAX_JPEG_PIXELS, OnBadImage, SkippedImage, decode_jpeg,
    decode_jpeg_into, jpeg_header,
};
pub use loader::{
    Batch, BatchData, BatchLoader, BatchLoaderOptions, LoaderStats, Position, Transform,
    TransformInto,
};

/// The old name of [`BatchLoaderOptions`] (renamed: gpufeed's settings structs end in `Options`).
#[deprecated(note = "renamed BatchLoaderOptions")]
pub type LoaderConfig = BatchLoaderOptions;
pub use records::{Dataset, RecordFile, ShardSet};
pub use sampler::{Order, Sampler};
pub use sources::{NpyLayout, SourceError, TarSample, own_layout, shard_paths};
#[cfg(feature = "object")]
pub use stream::StreamOptions;
pub use stream::{StreamStats, StreamedShards};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::*;
    use crate::records::*;
    use crate::sampler::*;

    proptest::proptest! {
        /// Any index bytes and data length: offsets that never decrease and end inside the
        /// data, or an error; never a panic.
        #[test]
        fn arbitrary_record_indexes_never_panic(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            data_len in proptest::prelude::any::<u64>(),
        ) {
            if let Ok(offsets) = parse_record_index(&raw, data_len) {
                proptest::prop_assert!(offsets.len() >= 2);
                proptest::prop_assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
                proptest::prop_assert!(*offsets.last().expect("two") <= data_len);
                proptest::prop_assert!(offsets.len() as u64 - 1 <= data_len, "a record per byte at most");
            }
        }

        /// Valid indexes (at most a record per byte of data) are accepted as they are.
        #[test]
        fn valid_record_indexes_round_trip(mut lens in proptest::collection::vec(0u64..1000, 1..50)) {
            let mut offsets = vec![0u64];
            for l in lens.drain(..) {
                offsets.push(offsets.last().expect("one") + l);
            }
            let raw: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
            let end = *offsets.last().expect("one");
            let data_len = end.max(offsets.len() as u64 - 1);
            proptest::prop_assert_eq!(parse_record_index(&raw, data_len), Ok(offsets));
        }
    }

    /// Each step's records, the union of every rank's batch of that step (sorted), for an
    /// elastic sampler of `world` ranks from sample `start`.
    fn steps(
        n: usize,
        global: usize,
        world: usize,
        start: usize,
        drop_last: bool,
    ) -> Vec<Vec<usize>> {
        let order = Order::Shuffled { seed: 11 };
        let per_rank: Vec<Vec<usize>> = (0..world)
            .map(|r| {
                Sampler::elastic(order, global, r, world, drop_last)
                    .expect("elastic")
                    .epoch_from(n, 2, start as u64)
            })
            .collect();
        let b = global / world;
        let count = per_rank[0].len().div_ceil(b);
        (0..count)
            .map(|k| {
                let mut step: Vec<usize> = per_rank
                    .iter()
                    .flat_map(|p| p.chunks(b).nth(k).unwrap_or(&[]).iter().copied())
                    .collect();
                step.sort_unstable();
                step
            })
            .collect()
    }

    fn divisors(n: usize) -> Vec<usize> {
        (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
    }

    proptest::proptest! {
        /// The records of each step are the same whatever the world size (one that divides the
        /// global batch); every rank gets as many as the others.
        #[test]
        fn elastic_steps_do_not_depend_on_the_world_size(
            n in 0usize..400,
            global in proptest::sample::select(vec![1usize, 6, 12, 24, 60]),
            pick in (0usize..100, 0usize..100),
        ) {
            let d = divisors(global);
            let (w1, w2) = (d[pick.0 % d.len()], d[pick.1 % d.len()]);
            let (a, b) = (steps(n, global, w1, 0, true), steps(n, global, w2, 0, true));
            proptest::prop_assert_eq!(&a, &b);
            proptest::prop_assert_eq!(a.len(), n / global);
            // Without drop_last the last step differs only in the padding taken from the
            // order's start; every record of the epoch is in some step.
            let full = steps(n, global, w1, 0, false);
            let mut seen: Vec<usize> = full.concat();
            seen.sort_unstable();
            seen.dedup();
            proptest::prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
            for r in 0..w1 {
                let len = Sampler::elastic(Order::Sequential, global, r, w1, false)
                    .expect("elastic")
                    .epoch(n, 0)
                    .len();
                // Full steps of global / w1 each, then an even share of the partial one.
                proptest::prop_assert_eq!(len, n / global * (global / w1) + (n % global).div_ceil(w1));
            }
        }

        /// `Order::Shards` is a permutation of whole shards of any sizes (empty ones too),
        /// each shard's records next to each other, the same for the same seed and epoch.
        #[test]
        fn shard_orders_keep_shards_together(
            sizes in proptest::collection::vec(0usize..40, 0..12),
            seed in 0u64..1000,
            epoch in 0u64..4,
        ) {
            let mut starts = vec![0];
            for s in &sizes {
                starts.push(starts.last().copied().unwrap_or(0) + s);
            }
            let n = *starts.last().expect("a start");
            let order = Order::Shards { seed };
            let all = sampler::permutation_of(&starts, order, epoch);
            let mut sorted = all.clone();
            sorted.sort_unstable();
            proptest::prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            let shard = |i: usize| starts.partition_point(|&s| s <= i) - 1;
            // Each shard's records form one run: the shard changes once per shard at most.
            let changes = all.windows(2).filter(|w| shard(w[0]) != shard(w[1])).count();
            let nonempty = sizes.iter().filter(|&&s| s > 0).count();
            proptest::prop_assert_eq!(changes, nonempty.saturating_sub(1));
            proptest::prop_assert_eq!(&all, &sampler::permutation_of(&starts, order, epoch));
            let via = Sampler::new(order).epoch_of_shards(&starts, epoch, 0);
            proptest::prop_assert_eq!(via, all);
        }

        /// `Order::Blocks` is a permutation of whole blocks, each starting at a multiple of
        /// `block`, a shorter last block at the end; an elastic rank's batches whose size
        /// `block` divides hold whole blocks only.
        #[test]
        fn block_orders_keep_blocks_together(
            n in 0usize..500,
            block in 1usize..20,
            seed in 0u64..1000,
            epoch in 0u64..4,
        ) {
            let order = Order::Blocks { seed, block };
            let all = permutation(n, order, epoch);
            let mut sorted = all.clone();
            sorted.sort_unstable();
            proptest::prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            for chunk in all.chunks(block) {
                let first = chunk.iter().min().copied().unwrap_or(0);
                proptest::prop_assert_eq!(first % block, 0, "{:?}", chunk);
                proptest::prop_assert!(chunk.iter().all(|&i| i / block == first / block), "{:?}", chunk);
            }
            // The same seed and epoch give the same order; another epoch, another (mostly).
            proptest::prop_assert_eq!(&all, &permutation(n, order, epoch));
            let (world, per) = (2usize, 2 * block);
            for r in 0..world {
                let mine = Sampler::elastic(order, per * world, r, world, true)
                    .expect("elastic")
                    .epoch(n, epoch);
                for batch in mine.chunks(per) {
                    let mut b = batch.to_vec();
                    b.sort_unstable();
                    for whole in b.chunks(block) {
                        proptest::prop_assert_eq!(whole[0] % block, 0);
                        proptest::prop_assert_eq!(whole[whole.len() - 1], whole[0] + block - 1);
                    }
                }
            }
        }

        /// A run stopped after any step and resumed with another world size sees every
        /// remaining record of the epoch once, and none it saw before.
        #[test]
        fn an_elastic_resume_yields_exactly_the_rest(
            n in 0usize..400,
            global in proptest::sample::select(vec![6usize, 12, 24]),
            pick in (0usize..100, 0usize..100),
            cut in 0usize..80,
        ) {
            let d = divisors(global);
            let (w1, w2) = (d[pick.0 % d.len()], d[pick.1 % d.len()]);
            let before = steps(n, global, w1, 0, true);
            let cut = cut.min(before.len());
            let after = steps(n, global, w2, cut * global, true);
            let mut all: Vec<usize> = before[..cut].concat();
            all.extend(after.concat());
            let len = all.len();
            all.sort_unstable();
            all.dedup();
            proptest::prop_assert_eq!(all.len(), len, "a record seen twice");
            proptest::prop_assert_eq!(len, n / global * global);
        }
    }

    /// Worker processes (`ring::epoch_batches`) cut an elastic epoch as the in-process loader
    /// does: the sampler's per-rank batch, whatever the config says.
    #[test]
    fn ring_batches_follow_an_elastic_sampler() {
        let sampler =
            Sampler::elastic(Order::Shuffled { seed: 3 }, 24, 1, 2, true).expect("elastic");
        let cfg = BatchLoaderOptions::default().with_batch_size(50);
        let batches = ring::epoch_batches(250, &sampler, &cfg, 0);
        assert_eq!(batches.len(), 10, "250 records: 10 full steps of 24");
        assert!(batches.iter().all(|(_, b)| b.len() == 12));
        let flat: Vec<usize> = batches.into_iter().flat_map(|(_, b)| b).collect();
        assert_eq!(flat, sampler.epoch(250, 0));
    }

    #[test]
    fn samplers_shuffle_by_seed_and_shard_evenly() {
        let seq = Sampler::new(Order::Sequential);
        assert_eq!(seq.epoch(5, 0), vec![0, 1, 2, 3, 4]);
        let a = Sampler::new(Order::Shuffled { seed: 1 });
        assert_eq!(
            a.epoch(100, 3),
            a.epoch(100, 3),
            "same seed and epoch, same order"
        );
        assert_ne!(
            a.epoch(100, 3),
            a.epoch(100, 4),
            "another epoch, another order"
        );
        let mut sorted = a.epoch(100, 3);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>(), "a permutation");
        // 10 records over 3 ranks: 4 each, wrapping around; all records covered.
        let shards: Vec<Vec<usize>> = (0..3)
            .map(|r| seq.shard(r, 3, false).expect("shard").epoch(10, 0))
            .collect();
        assert!(shards.iter().all(|s| s.len() == 4));
        let mut all: Vec<usize> = shards.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 10);
        let dropped: Vec<usize> = (0..3)
            .map(|r| seq.shard(r, 3, true).expect("shard").epoch(10, 0).len())
            .collect();
        assert_eq!(dropped, vec![3, 3, 3]);
        assert!(seq.shard(3, 3, false).is_err());
    }
}
