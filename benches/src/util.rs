//! Helpers shared by the measurements: clocks, random data, statistics, sizes.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the machine, so a time
/// taken in one process can be compared with a time taken in another.
pub fn now_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Seconds taken by `f`, and its result.
pub fn timed<T>(f: impl FnOnce() -> T) -> (f64, T) {
    let start = std::time::Instant::now();
    let out = f();
    (start.elapsed().as_secs_f64(), out)
}

/// splitmix64: fast, seeded, never produces long runs of zeros.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for chunk in &mut chunks {
            chunk.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }

    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Writes `len` random bytes to `path` unless a file of that size is already there.
pub fn ensure_random_file(path: &Path, len: u64, seed: u64) -> Result<()> {
    if path.metadata().map(|m| m.len() == len).unwrap_or(false) {
        return Ok(());
    }
    let mut file = File::create(path).with_context(|| format!("create {}", path.display()))?;
    let mut rng = SplitMix(seed);
    let mut buf = vec![0u8; 8 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill(&mut buf[..n]);
        file.write_all(&buf[..n])
            .with_context(|| format!("write {}", path.display()))?;
        left -= n as u64;
    }
    file.sync_all().context("fsync data set")?;
    Ok(())
}

/// Median and spread of repeated measurements.
#[derive(Debug, Clone, Serialize)]
pub struct Samples {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub all: Vec<f64>,
}

impl Samples {
    pub fn new(mut all: Vec<f64>) -> Self {
        all.sort_by(f64::total_cmp);
        let n = all.len();
        let median = match n {
            0 => f64::NAN,
            _ if n % 2 == 1 => all[n / 2],
            _ => (all[n / 2 - 1] + all[n / 2]) / 2.0,
        };
        Samples {
            median,
            min: all.first().copied().unwrap_or(f64::NAN),
            max: all.last().copied().unwrap_or(f64::NAN),
            all,
        }
    }

    /// The same samples mapped through `f` (e.g. seconds -> GB/s); min and max follow `f`.
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Samples {
        Samples::new(self.all.iter().map(|&x| f(x)).collect())
    }

    /// `median (min-max)` with `digits` decimals.
    pub fn show(&self, digits: usize) -> String {
        format!(
            "{:.d$} ({:.d$}-{:.d$})",
            self.median,
            self.min,
            self.max,
            d = digits
        )
    }
}

pub use gpufeed::os::gbps;

/// Parses a size for clap (see `gpufeed::units::parse_size`).
pub fn parse_size(text: &str) -> Result<u64> {
    gpufeed::units::parse_size(text).map_err(Into::into)
}

pub use gpufeed::units::show_size;

/// `v[key]` of a peer script's JSON as samples, where it is an array (its numbers).
pub fn samples_at(v: &serde_json::Value, key: &str) -> Option<Samples> {
    v.get(key)
        .and_then(|x| x.as_array())
        .map(|runs| Samples::new(runs.iter().filter_map(|x| x.as_f64()).collect()))
}

/// Why a row of a peer script's JSON has no figures: its `error`, else `fallback`.
pub fn error_at(v: Option<&serde_json::Value>, fallback: &str) -> String {
    v.and_then(|v| v.get("error"))
        .and_then(|e| e.as_str())
        .unwrap_or(fallback)
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        let s = Samples::new(vec![3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Samples::new(vec![4.0, 1.0, 2.0, 3.0]).median, 2.5);
        assert_eq!(s.map(|x| 1.0 / x).max, 1.0);
    }

    #[test]
    fn random_fill_is_seeded_and_not_zero() {
        let (mut a, mut b) = (vec![0u8; 1001], vec![0u8; 1001]);
        SplitMix(5).fill(&mut a);
        SplitMix(5).fill(&mut b);
        assert_eq!(a, b);
        assert!(a.iter().filter(|&&x| x == 0).count() < 20);
    }
}
