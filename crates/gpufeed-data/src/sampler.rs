//! The sampler: which records each rank takes in which order, by epoch and seed ([`Sampler`],
//! [`Order`]); the elastic order resumes from a [`Position`] with another world size.

use crate::error::{Error, Result};
use crate::loader::{BatchLoaderOptions, Position};

/// The order records are visited in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
#[non_exhaustive]
pub enum Order {
    /// 0, 1, 2, ...
    Sequential,
    /// A permutation drawn from `seed` and the epoch: the same seed gives the same order.
    Shuffled {
        /// The seed.
        seed: u64,
    },
    /// A quasi-random order for data read from the disk ([`BatchLoaderOptions::direct`]), as FFCV's
    /// `QUASI_RANDOM`: the records are cut into blocks of `block` consecutive records; the
    /// epoch visits the blocks in a permutation drawn from `seed` and the epoch, and each
    /// block's records in a permutation of their own (a last, shorter block, where `block`
    /// does not divide the number of records, comes last). So a block's records
    /// are always next to each other in the order: with an elastic sampler whose per-rank
    /// batch is a multiple of `block` they always land in the same batch, which reads each
    /// block as one run of the file. Its randomness, stated: the order of the blocks and the
    /// order within each block are uniform; which records share a batch is not (a batch holds
    /// `batch / block` whole blocks, never a record of one block without the others). Like
    /// the others it depends only on the seed, the epoch and the number of records. A `block`
    /// of 0 counts as 1 (then it is a plain shuffle).
    Blocks {
        /// The seed.
        seed: u64,
        /// Records per block.
        block: usize,
    },
    /// Shard by shard, as WebDataset's shard shuffle: the data set's shards (a
    /// [`ShardSet`](crate::ShardSet)'s files, [`StreamedShards`](crate::StreamedShards)' objects;
    /// a data set of one file is one shard) visited in a permutation drawn from `seed` and the
    /// epoch, each shard's records in a permutation of their own. A shard's records are next
    /// to each other in the order, so each shard is needed for a short stretch of the epoch:
    /// the order that streams shards from object storage under a small cap. It depends on the
    /// seed, the epoch and the shards' record counts. (A [`Sampler`] given only a number of
    /// records, [`Sampler::epoch_from`], sees one shard.)
    Shards {
        /// The seed.
        seed: u64,
    },
}

/// Chooses the records of each epoch for this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampler {
    pub(crate) order: Order,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) drop_last: bool,
    /// Records per global batch, for an elastic sampler ([`Sampler::elastic`]).
    pub(crate) global_batch: Option<usize>,
}

impl Sampler {
    /// All records, in `order`, on one rank.
    pub fn new(order: Order) -> Self {
        Sampler {
            order,
            rank: 0,
            world_size: 1,
            drop_last: false,
            global_batch: None,
        }
    }

    /// This rank's share of `world_size` ranks. Without `drop_last` every rank gets the same
    /// number of records, the last ones wrapping around to the start (as PyTorch's
    /// `DistributedSampler` does); with it the remainder is dropped.
    pub fn shard(mut self, rank: usize, world_size: usize, drop_last: bool) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(format!(
                "rank {rank} of world size {world_size}"
            )));
        }
        self.rank = rank;
        self.world_size = world_size;
        self.drop_last = drop_last;
        Ok(self)
    }

    /// Sharded by `RANK` and `WORLD_SIZE` as torchrun sets them (one rank when unset).
    pub fn from_env(order: Order) -> Result<Self> {
        let (rank, world) = rank_from_env()?;
        Self::new(order).shard(rank, world, false)
    }

    /// An order that survives the cluster changing size (elastic training): the epoch's global
    /// order depends only on `order`, the epoch and the number of records; each step takes the
    /// next `global_batch` records of it and cuts them into `world_size` contiguous per-rank
    /// batches of `global_batch / world_size`, so the records of step k are the same for every
    /// world size that divides `global_batch`. The loader's batch size is then that per-rank
    /// size. The last, partial global batch is dropped with `drop_last`; otherwise it is split
    /// evenly, ranks short of records taking them again from the start of the order (as
    /// PyTorch's `DistributedSampler` pads). Its position ([`Position`]) resumes a run with
    /// the same or another world size ([`BatchLoader::resume`](crate::BatchLoader::resume)).
    ///
    /// # Errors
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) when `rank >= world_size` or `world_size` does not divide
    /// `global_batch`.
    pub fn elastic(
        order: Order,
        global_batch: usize,
        rank: usize,
        world_size: usize,
        drop_last: bool,
    ) -> Result<Self> {
        if global_batch == 0 || world_size == 0 || !global_batch.is_multiple_of(world_size) {
            return Err(Error::invalid(format!(
                "a global batch of {global_batch} records cannot be split between {world_size} \
                 ranks: use a world size that divides it"
            )));
        }
        let mut s = Self::new(order).shard(rank, world_size, drop_last)?;
        s.global_batch = Some(global_batch);
        Ok(s)
    }

    /// [`Sampler::elastic`] with this process's `RANK` and `WORLD_SIZE` (one rank when unset).
    pub fn elastic_from_env(order: Order, global_batch: usize, drop_last: bool) -> Result<Self> {
        let (rank, world) = rank_from_env()?;
        Self::elastic(order, global_batch, rank, world, drop_last)
    }

    /// Records per rank per step, for an elastic sampler.
    pub fn rank_batch(&self) -> Option<usize> {
        self.global_batch.map(|g| g / self.world_size)
    }

    /// Where a run over `records` records stands after `steps` steps of `epoch` begun at sample
    /// `start` (an elastic sampler's [`Position`]; `None` for others): after the epoch's last
    /// step, the start of the next epoch. What [`Epoch::position`](crate::Epoch::position) says; for a caller that
    /// counts the batches it consumed itself (one fed by a thread that runs ahead).
    pub fn position_after(
        &self,
        records: usize,
        epoch: u64,
        start: u64,
        steps: usize,
    ) -> Option<Position> {
        let global = self.global_batch?;
        let left = records.saturating_sub(start as usize);
        let total = if self.drop_last {
            left / global
        } else {
            left.div_ceil(global)
        };
        let (epoch, samples) = if steps >= total {
            // A position read back from a checkpoint may say any epoch: no overflow.
            (epoch.saturating_add(1), 0)
        } else {
            (epoch, start + (steps * global) as u64)
        };
        Some(Position {
            epoch,
            samples,
            records: records as u64,
            order: self.order,
            global_batch: global,
        })
    }

    /// The batch size and `drop_last` a loader uses with this sampler: an elastic sampler's
    /// own, else `cfg`'s.
    pub(crate) fn batching(&self, cfg: &BatchLoaderOptions) -> (usize, bool) {
        match self.rank_batch() {
            Some(b) => (b, self.drop_last),
            None => (cfg.batch_size, cfg.drop_last),
        }
    }

    /// The record indices of `epoch` for this rank, out of `n` records.
    pub fn epoch(&self, n: usize, epoch: u64) -> Vec<usize> {
        self.epoch_from(n, epoch, 0)
    }

    /// The record indices of `epoch` for this rank from sample `start` of the epoch's global
    /// order on (an elastic sampler's resume point: a multiple of the global batch; other
    /// samplers always start at 0).
    pub fn epoch_from(&self, n: usize, epoch: u64, start: u64) -> Vec<usize> {
        self.epoch_of_shards(&[0, n], epoch, start)
    }

    /// [`Sampler::epoch_from`] over shards whose first records are `starts` (then the total:
    /// `[0, 100, 250]` is two shards of 100 and 150 records), which [`Order::Shards`] visits
    /// one by one.
    pub fn epoch_of_shards(&self, starts: &[usize], epoch: u64, start: u64) -> Vec<usize> {
        let n = starts.last().copied().unwrap_or(0);
        let all = permutation_of(starts, self.order, epoch);
        if let Some(g) = self.global_batch {
            return self.elastic_share(&all, g, start as usize);
        }
        if self.world_size == 1 || n == 0 {
            return all;
        }
        let total = if self.drop_last {
            n / self.world_size * self.world_size
        } else {
            n.div_ceil(self.world_size) * self.world_size
        };
        (0..total)
            .skip(self.rank)
            .step_by(self.world_size)
            .map(|i| all[i % n])
            .collect()
    }

    /// This rank's records of the global `order` from `start`, step by step.
    fn elastic_share(&self, order: &[usize], global: usize, start: usize) -> Vec<usize> {
        let (n, w, r) = (order.len(), self.world_size, self.rank);
        let b = global / w;
        // At most every record from `start` once, plus one batch's repeats: not `b` itself,
        // which a huge global batch makes past memory.
        let mut out = Vec::with_capacity((n.saturating_sub(start) / w).saturating_add(b.min(n)));
        let mut s = start;
        while s < n {
            let m = global.min(n - s);
            if m == global {
                out.extend_from_slice(&order[s + r * b..s + (r + 1) * b]);
            } else if self.drop_last {
                break;
            } else {
                let per = m.div_ceil(w);
                out.extend((0..per).map(|j| {
                    let k = r * per + j;
                    if k < m {
                        order[s + k]
                    } else {
                        order[(k - m) % n]
                    }
                }));
            }
            s = s.saturating_add(global);
        }
        out
    }
}

/// `RANK` and `WORLD_SIZE` as torchrun sets them; `(0, 1)` when neither is set.
pub(crate) fn rank_from_env() -> Result<(usize, usize)> {
    let var = |name: &str| -> Result<Option<usize>> {
        match std::env::var(name) {
            Err(_) => Ok(None),
            Ok(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| Error::invalid(format!("{name}={v:?} is not a number"))),
        }
    };
    match (var("RANK")?, var("WORLD_SIZE")?) {
        (Some(rank), Some(world)) => Ok((rank, world)),
        (None, None) => Ok((0, 1)),
        _ => Err(Error::invalid(
            "RANK and WORLD_SIZE must be set together".into(),
        )),
    }
}

/// The records `0..n` in `order` for `epoch` (seeded Fisher-Yates shuffles), as one shard.
#[cfg(test)]
pub(crate) fn permutation(n: usize, order: Order, epoch: u64) -> Vec<usize> {
    permutation_of(&[0, n], order, epoch)
}

/// The records of shards starting at `starts` (then the total) in `order` for `epoch`.
pub(crate) fn permutation_of(starts: &[usize], order: Order, epoch: u64) -> Vec<usize> {
    let n = starts.last().copied().unwrap_or(0);
    match order {
        Order::Sequential => (0..n).collect(),
        Order::Shuffled { seed } => {
            let mut all: Vec<usize> = (0..n).collect();
            shuffle(&mut all, seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            all
        }
        Order::Blocks { seed, block } => {
            let block = block.max(1);
            // The whole blocks shuffled, a last shorter one after them (so that every whole
            // block starts at a multiple of `block` in the order).
            let mut blocks: Vec<usize> = (0..n / block).collect();
            let state = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            shuffle(&mut blocks, state);
            if !n.is_multiple_of(block) {
                blocks.push(n / block);
            }
            let mut all = Vec::with_capacity(n);
            for b in blocks {
                let first = all.len();
                all.extend(b * block..((b + 1) * block).min(n));
                // Each block's own stream, from the epoch's and the block's number.
                shuffle(
                    &mut all[first..],
                    state ^ (b as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
                );
            }
            all
        }
        Order::Shards { seed } => {
            let state = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut shards: Vec<usize> = (0..starts.len().saturating_sub(1)).collect();
            shuffle(&mut shards, state);
            let mut all = Vec::with_capacity(n);
            for s in shards {
                let first = all.len();
                all.extend(starts[s]..starts[s + 1].max(starts[s]));
                // Each shard's own stream, from the epoch's and the shard's number.
                shuffle(
                    &mut all[first..],
                    state ^ (s as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
                );
            }
            all
        }
    }
}

/// A seeded Fisher-Yates shuffle of `items` (splitmix64 steps from `state`).
pub(crate) fn shuffle(items: &mut [usize], mut state: u64) {
    for i in (1..items.len()).rev() {
        let z = splitmix64(&mut state);
        items.swap(i, (z % (i as u64 + 1)) as usize);
    }
}

/// The next value of the splitmix64 generator at `state` (which it advances).
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
