//! What each rank loads: [`ShardPlan`] (files or byte ranges per rank, split evenly on page
//! boundaries) and the rounds of a replicated load.

use std::ops::Range;
use std::path::{Path, PathBuf};

use gpufeed_load::internal::file_len;

use crate::error::{Error, Result};

/// Rank boundaries of a split fall on multiples of this (so `O_DIRECT` reads of a share stay
/// aligned and no two GPUs read the same page).
pub(crate) const ALIGN: u64 = 4096;

/// A piece of a sharded load: bytes `range` of file `file` of the plan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Span {
    /// Index into [`ShardPlan::files`].
    pub file: usize,
    /// Byte range in that file.
    pub range: Range<u64>,
}

/// Which bytes each GPU (rank) of a sharded load gets: for every rank a list of [`Span`]s,
/// loaded back to back in that order into one device buffer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShardPlan {
    pub(crate) files: Vec<PathBuf>,
    pub(crate) lens: Vec<u64>,
    ranks: Vec<Vec<Span>>,
}

impl ShardPlan {
    /// The files read one after another as one stream of bytes, cut into `ranks` contiguous
    /// shares of nearly equal size (boundaries on 4 KiB multiples of the stream): for one
    /// large file or a set of shards that every GPU should share evenly.
    ///
    /// # Errors
    /// A missing or unreadable file; [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for no ranks.
    pub fn split_bytes(files: &[impl AsRef<Path>], ranks: usize) -> Result<Self> {
        let (files, lens) = stat_all(files, ranks)?;
        let total: u64 = lens.iter().sum();
        let shares = Self::split_len(total, ranks);
        let bounds: Vec<u64> = std::iter::once(0)
            .chain(shares.iter().map(|s| s.end))
            .collect();
        let mut plan = Vec::with_capacity(ranks);
        for w in bounds.windows(2) {
            let (lo, hi) = (w[0], w[1]);
            let mut spans = Vec::new();
            let mut at = 0u64;
            for (file, &len) in lens.iter().enumerate() {
                let (a, b) = (lo.max(at), hi.min(at + len));
                if a < b {
                    spans.push(Span {
                        file,
                        range: a - at..b - at,
                    });
                }
                at += len;
            }
            plan.push(spans);
        }
        Ok(ShardPlan {
            files,
            lens,
            ranks: plan,
        })
    }

    /// Whole files shared out between `ranks`: the largest first, each to the rank with the
    /// fewest bytes so far (the lowest rank on a tie), each rank's files in the given order.
    /// For data stored a file per rank, or many shards.
    ///
    /// # Errors
    /// As [`ShardPlan::split_bytes`].
    pub fn file_per_rank(files: &[impl AsRef<Path>], ranks: usize) -> Result<Self> {
        let (files, lens) = stat_all(files, ranks)?;
        let mut order: Vec<usize> = (0..files.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
        let mut load = vec![0u64; ranks];
        let mut owner = vec![0usize; files.len()];
        for i in order {
            let r = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            load[r] += lens[i];
            owner[i] = r;
        }
        let ranks = (0..ranks)
            .map(|r| {
                (0..files.len())
                    .filter(|&i| owner[i] == r && lens[i] > 0)
                    .map(|i| Span {
                        file: i,
                        range: 0..lens[i],
                    })
                    .collect()
            })
            .collect();
        Ok(ShardPlan { files, lens, ranks })
    }

    /// A plan of your own: `ranks[r]` is rank r's spans of `files`.
    ///
    /// # Errors
    /// A missing file; [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for a span naming no file, or past the end of
    /// its file, and for no ranks.
    pub fn from_spans(files: &[impl AsRef<Path>], ranks: Vec<Vec<Span>>) -> Result<Self> {
        let (files, lens) = stat_all(files, ranks.len())?;
        for (r, spans) in ranks.iter().enumerate() {
            for s in spans {
                let Some(&len) = lens.get(s.file) else {
                    return Err(Error::invalid(format!(
                        "rank {r}: a span of file {} of {}",
                        s.file,
                        files.len()
                    )));
                };
                if s.range.start > s.range.end || s.range.end > len {
                    return Err(Error::invalid(format!(
                        "rank {r}: span {:?} of {} ({len} bytes) is not inside the file",
                        s.range,
                        files[s.file].display()
                    )));
                }
            }
        }
        Ok(ShardPlan { files, lens, ranks })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The files.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The files' lengths when the plan was made.
    pub fn file_lens(&self) -> &[u64] {
        &self.lens
    }

    /// Rank `rank`'s spans (empty past the last rank).
    pub fn spans(&self, rank: usize) -> &[Span] {
        self.ranks.get(rank).map_or(&[], Vec::as_slice)
    }

    /// Bytes rank `rank` loads.
    pub fn bytes(&self, rank: usize) -> u64 {
        self.spans(rank)
            .iter()
            .map(|s| s.range.end - s.range.start)
            .sum()
    }
}

/// The files' lengths, checking that there is at least one rank.
pub(crate) fn stat_all(
    files: &[impl AsRef<Path>],
    ranks: usize,
) -> Result<(Vec<PathBuf>, Vec<u64>)> {
    if ranks == 0 {
        return Err(Error::invalid(
            "a shard plan needs at least one rank".into(),
        ));
    }
    let paths: Vec<PathBuf> = files.iter().map(|f| f.as_ref().to_path_buf()).collect();
    let lens = paths
        .iter()
        .map(|p| file_len(p))
        .collect::<Result<_, _>>()?;
    Ok((paths, lens))
}

impl ShardPlan {
    /// `len` bytes cut into `ranks` contiguous shares, each boundary the 4 KiB multiple
    /// nearest to an even cut (so a share is within 4 KiB of `len / ranks`).
    pub(crate) fn split_len(len: u64, ranks: usize) -> Vec<Range<u64>> {
        let at = |r: usize| {
            if r == ranks {
                len
            } else {
                let even = u128::from(len) * r as u128 / ranks as u128;
                let nearest =
                    (even + u128::from(ALIGN) / 2) / u128::from(ALIGN) * u128::from(ALIGN);
                nearest.min(u128::from(len)) as u64
            }
        };
        (0..ranks).map(|r| at(r)..at(r + 1)).collect()
    }
}

/// How many rounds of `round` bytes the largest of `shares` takes.
pub(crate) fn rounds_of(shares: &[Range<u64>], round: u64) -> u64 {
    shares
        .iter()
        .map(|s| (s.end - s.start).div_ceil(round))
        .max()
        .unwrap_or(0)
}

/// Round `i` (of `round` bytes) of `share`, if it has one.
pub(crate) fn round_part(share: &Range<u64>, i: u64, round: u64) -> Option<Range<u64>> {
    let start = share.start + i * round;
    (start < share.end).then(|| start..share.end.min(start + round))
}

/// Consecutive spans of the same file, grouped: `(file, ranges)`.
pub(crate) fn runs(spans: &[Span]) -> Vec<(usize, Vec<Range<u64>>)> {
    let mut out: Vec<(usize, Vec<Range<u64>>)> = Vec::new();
    for s in spans {
        match out.last_mut() {
            Some((f, ranges)) if *f == s.file => ranges.push(s.range.clone()),
            _ => out.push((s.file, vec![s.range.clone()])),
        }
    }
    out
}

/// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) unless a plan of `ranks` ranks fits `have` GPUs (`on`: where
/// they are, "on a loader of", "in a job on this machine of").
pub(crate) fn check_ranks(ranks: usize, have: usize, on: &str) -> Result<()> {
    if ranks != have {
        return Err(Error::invalid(format!(
            "a plan for {ranks} ranks {on} {have} GPUs; plan for {have}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_len_covers_in_aligned_shares() {
        let s = ShardPlan::split_len(10 * 4096 + 3, 3);
        assert_eq!(s, vec![0..12288, 12288..28672, 28672..40963]);
        assert_eq!(ShardPlan::split_len(100, 2), vec![0..0, 0..100]);
        assert_eq!(ShardPlan::split_len(6000, 2), vec![0..4096, 4096..6000]);
    }
}
