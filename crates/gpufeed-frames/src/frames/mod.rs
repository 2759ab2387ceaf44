//! Frames between processes — the CPU half of the source's real-time case study (§6.2:
//! "double buffering, 256-byte aligned frames, zero-copy into shared memory"): a producer that
//! behaves like a camera paints frames straight into the slots of a gpufeed-ipc
//! [`BatchRing`] at a frame rate, each stamped with its sequence
//! number and capture time; a consumer takes them in order and measures each frame's latency
//! from capture to its result; the naive baseline passes the same frames through a pipe into a
//! pageable buffer. Here are the parts both sides share: the frame format and header, the
//! paced producer (a camera does not wait: a frame that finds no free slot is dropped and
//! counted), the ring consumer, the pipe's framing, the RGB8 -> planar `f32` transform on the
//! CPU, and latency statistics. [`GpuFrames`] is the GPU consumer: each frame copied
//! straight out of its slot of the registered ring while the previous one is transformed
//! (double buffering), the planar kernel on the GPU, latency to the kernel's end and the GPU's
//! busy time from CUDA events, results checked against the CPU on sampled frames; and the
//! baseline's GPU form (pipe, pageable buffer, staged copy, the same kernel).
//!
//! # Example (two threads here; two processes in `examples/frames.rs`)
//! ```
//! use gpufeed_frames::frames::{FrameFormat, consume, produce, latency_stats};
//! let format = FrameFormat { width: 64, height: 48 };
//! let ring = gpufeed_ipc::BatchRing::anonymous(4, format.slot_bytes())?;
//! let seen = std::thread::scope(|s| {
//!     s.spawn(|| produce(&ring, format, 0.0, 0..20));
//!     consume(&ring, format, 20, std::time::Duration::from_secs(5), |_, _| Ok(()))
//! })?;
//! let stats = latency_stats(&seen, 20, None);
//! assert_eq!((stats.frames, stats.dropped), (20, 0));
//! # Ok::<(), gpufeed_frames::Error>(())
//! ```

mod gpu;

pub use gpu::{GpuFrames, GpuReport, GpuRun};

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use gpufeed_ipc::BatchRing;

use crate::error::{Error, Result};

/// Bytes before a frame's pixels in its slot (and on the pipe): the header, padded so that the
/// pixels start 256-byte aligned.
pub const HEADER_BYTES: usize = 256;

/// Marks a frame header ("gpufeedF").
const MAGIC: u64 = u64::from_le_bytes(*b"gpufeedF");

/// An RGB8 frame's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct FrameFormat {
    /// Pixels per row.
    pub width: u32,
    /// Rows.
    pub height: u32,
}

impl FrameFormat {
    /// 3840 x 2160, the case study's 4K frames (24.9 MB).
    pub const UHD: FrameFormat = FrameFormat {
        width: 3840,
        height: 2160,
    };
    /// 1920 x 1080.
    pub const FHD: FrameFormat = FrameFormat {
        width: 1920,
        height: 1080,
    };

    /// Bytes of the pixels (3 per pixel).
    pub fn bytes(&self) -> usize {
        self.width as usize * self.height as usize * 3
    }

    /// Bytes of a ring slot holding a frame: the header and the pixels, in whole 256 bytes.
    pub fn slot_bytes(&self) -> u64 {
        (HEADER_BYTES + self.bytes()).next_multiple_of(256) as u64
    }
}

/// What precedes a frame's pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The frame's number, from 0.
    pub seq: u64,
    /// When it was captured: `CLOCK_MONOTONIC` nanoseconds ([`monotonic_ns`]), comparable
    /// between the processes of one machine. The producers here stamp a frame once its pixels
    /// are whole (painted into the slot or the buffer), as a camera stamps the frame it
    /// delivers: latency is what the hand-off and the transform add, not the painting.
    pub capture_ns: u64,
    /// Its size.
    pub format: FrameFormat,
}

impl FrameHeader {
    /// The header's bytes (the first 32 of [`HEADER_BYTES`]).
    pub fn encode(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.capture_ns.to_le_bytes());
        b[24..28].copy_from_slice(&self.format.width.to_le_bytes());
        b[28..32].copy_from_slice(&self.format.height.to_le_bytes());
        b
    }

    /// Reads a header back.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) for bytes that are not a frame header.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let word = |at: usize| {
            b.get(at..at + 8)
                .and_then(|s| s.try_into().ok())
                .map(u64::from_le_bytes)
        };
        let half = |at: usize| {
            b.get(at..at + 4)
                .and_then(|s| s.try_into().ok())
                .map(u32::from_le_bytes)
        };
        match (word(0), word(8), word(16), half(24), half(28)) {
            (Some(MAGIC), Some(seq), Some(capture_ns), Some(width), Some(height)) => {
                Ok(FrameHeader {
                    seq,
                    capture_ns,
                    format: FrameFormat { width, height },
                })
            }
            _ => Err(Error::invalid(
                "not a frame: the header's magic is missing".into(),
            )),
        }
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The byte of row `row` of frame `seq`: every byte of a row is the same, so that a frame is
/// painted with one `memset` per row and checked by sampling.
fn row_byte(seq: u64, row: usize) -> u8 {
    (seq.wrapping_mul(31).wrapping_add(row as u64 * 7) % 251) as u8
}

/// Paints frame `seq` into `pixels` (at least `format.bytes()` long).
pub fn paint(seq: u64, format: FrameFormat, pixels: &mut [u8]) {
    let row = format.width as usize * 3;
    for (r, line) in pixels[..format.bytes()].chunks_mut(row).enumerate() {
        line.fill(row_byte(seq, r));
    }
}

/// The rows [`check`] reads: every 16th and the last.
fn checked_rows(rows: usize) -> impl Iterator<Item = usize> {
    (0..rows)
        .step_by(16)
        .chain(rows.checked_sub(1).filter(|r| r % 16 != 0))
}

/// How a producer paints its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[non_exhaustive]
pub enum Paint {
    /// Every row ([`paint`]): what a camera writes.
    #[default]
    Full,
    /// Only the rows [`check`] reads (a 16th of the frame; the others keep what the slot
    /// held): for measuring the most frames a consumer takes, where painting whole 4K frames
    /// would make the producer the bound.
    Checked,
}

/// Whether `pixels` hold frame `seq` (every 16th row and the last, each checked whole).
pub fn check(seq: u64, format: FrameFormat, pixels: &[u8]) -> bool {
    let row = format.width as usize * 3;
    let rows = format.height as usize;
    if pixels.len() < format.bytes() {
        return false;
    }
    checked_rows(rows).all(|r| {
        let b = row_byte(seq, r);
        pixels[r * row..(r + 1) * row].iter().all(|&x| x == b)
    })
}

/// What a producer did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProducerStats {
    /// Frames published.
    pub sent: u64,
    /// Frames that found no free slot at their capture time (dropped, as a camera does).
    pub dropped: u64,
}

/// Produces frames numbered `frames` (`0..n`; a camera started again goes on from where the
/// last stopped) of `format` into `ring` at `fps` frames per second (each claims a slot at its
/// tick, and one that finds none free is dropped; then it is painted and stamped), or with `fps` 0 as fast as the consumer
/// frees slots (waiting for them: nothing dropped).
///
/// # Errors
/// The ring's (its consumer gone, this process judged gone); a slot smaller than
/// [`FrameFormat::slot_bytes`].
pub fn produce(
    ring: &BatchRing,
    format: FrameFormat,
    fps: f64,
    frames: std::ops::Range<u64>,
) -> Result<ProducerStats> {
    produce_with(ring, format, fps, frames, Paint::Full)
}

/// [`produce`] painting each frame as `how` says.
///
/// # Errors
/// [`produce`]'s.
#[allow(
    unsafe_code,
    reason = "paints the frame straight into its claimed slot"
)]
pub fn produce_with(
    ring: &BatchRing,
    format: FrameFormat,
    fps: f64,
    frames: std::ops::Range<u64>,
    how: Paint,
) -> Result<ProducerStats> {
    if ring.slot_bytes() < format.slot_bytes() {
        return Err(Error::invalid(format!(
            "ring slots of {} bytes cannot hold {}x{} frames ({} bytes)",
            ring.slot_bytes(),
            format.width,
            format.height,
            format.slot_bytes()
        )));
    }
    let start = Instant::now();
    let mut stats = ProducerStats::default();
    let first = frames.start;
    for seq in frames {
        let claim = if fps > 0.0 {
            let tick = start + Duration::from_secs_f64((seq - first) as f64 / fps);
            if let Some(wait) = tick.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            ring.try_claim()?
        } else {
            Some(ring.claim(Duration::from_secs(30))?)
        };
        let Some(mut claim) = claim else {
            stats.dropped += 1;
            continue;
        };
        // SAFETY: the slot is this claim's until it is published.
        let slot = unsafe { claim.as_mut_slice() };
        let pixels = &mut slot[HEADER_BYTES..];
        match how {
            Paint::Full => paint(seq, format, pixels),
            Paint::Checked => {
                let row = format.width as usize * 3;
                for r in checked_rows(format.height as usize) {
                    pixels[r * row..(r + 1) * row].fill(row_byte(seq, r));
                }
            }
        }
        // Captured: the frame is whole in its slot (painting stands for the sensor's readout).
        let header = FrameHeader {
            seq,
            capture_ns: monotonic_ns(),
            format,
        };
        slot[..32].copy_from_slice(&header.encode());
        claim.set_len((HEADER_BYTES + format.bytes()) as u64)?;
        claim.publish()?;
        stats.sent += 1;
    }
    Ok(stats)
}

/// One frame as a consumer saw it: its number and its latency from capture to the end of
/// `on_frame` (its result ready).
pub type Seen = (u64, u64);

/// Takes frames of `format` from `ring` in order until frame `frames - 1` went by or none came
/// for `idle`, calling `on_frame(header, pixels)` on each (the transform, an upload); returns
/// each frame's number and latency.
///
/// # Errors
/// A batch that is not a frame of `format`; `on_frame`'s; the ring's other than a timeout.
#[allow(
    unsafe_code,
    reason = "reads the frame where it lies in its taken slot"
)]
pub fn consume(
    ring: &BatchRing,
    format: FrameFormat,
    frames: u64,
    idle: Duration,
    mut on_frame: impl FnMut(&FrameHeader, &[u8]) -> Result<()>,
) -> Result<Vec<Seen>> {
    let consumer = ring.consumer()?;
    let mut seen = Vec::new();
    loop {
        let batch = match consumer.next(idle) {
            Ok(b) => b,
            Err(gpufeed_ipc::Error::Timeout { .. }) => break,
            Err(e) => return Err(e.into()),
        };
        // SAFETY: the slot is this consumer's until the batch drops.
        let (header, pixels) = frame_in(unsafe { batch.as_slice() }, format)?;
        on_frame(&header, pixels)?;
        seen.push((header.seq, monotonic_ns().saturating_sub(header.capture_ns)));
        drop(batch);
        if header.seq + 1 >= frames {
            break;
        }
    }
    Ok(seen)
}

/// A slot's frame: its header and its pixels, checked to be a frame of `format`.
fn frame_in(bytes: &[u8], format: FrameFormat) -> Result<(FrameHeader, &[u8])> {
    let header = FrameHeader::decode(bytes)?;
    if header.format != format || bytes.len() < HEADER_BYTES + format.bytes() {
        return Err(Error::invalid(format!(
            "frame {} is {}x{} in {} bytes, not {}x{}",
            header.seq,
            header.format.width,
            header.format.height,
            bytes.len(),
            format.width,
            format.height
        )));
    }
    Ok((header, &bytes[HEADER_BYTES..HEADER_BYTES + format.bytes()]))
}

/// A consumer's run: each frame's number and latency, the time spent in `on_frame` (the
/// transform), the wall time from the first wait to the last frame.
#[derive(Debug, Clone, Default)]
pub struct Run {
    /// Each frame's number and latency, in the order taken.
    pub seen: Vec<Seen>,
    /// Time inside `on_frame`.
    pub busy: Duration,
    /// Wall time of the run.
    pub wall: Duration,
}

/// What a [`Run`] amounts to against frames `0..expected` captured every `interval`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RunReport {
    /// Latency, drops and late frames.
    pub latency: LatencyStats,
    /// Time transforming over wall time.
    pub busy_fraction: f64,
    /// Frames taken per second of the run.
    pub frames_per_s: f64,
}

impl Run {
    /// The run's figures against frames `0..expected` captured every `interval`.
    pub fn report(&self, expected: u64, interval: Option<Duration>) -> RunReport {
        let wall = self.wall.as_secs_f64();
        RunReport {
            latency: latency_stats(&self.seen, expected, interval),
            busy_fraction: self.busy.as_secs_f64() / wall,
            frames_per_s: self.seen.len() as f64 / wall,
        }
    }
}

/// [`consume`] timed: `on_frame`'s time and the run's wall time beside each frame's latency.
///
/// # Errors
/// [`consume`]'s.
pub fn run_ring(
    ring: &BatchRing,
    format: FrameFormat,
    frames: u64,
    idle: Duration,
    mut on_frame: impl FnMut(&FrameHeader, &[u8]) -> Result<()>,
) -> Result<Run> {
    let mut busy = Duration::ZERO;
    let start = Instant::now();
    let seen = consume(ring, format, frames, idle, |h, px| {
        let t = Instant::now();
        let r = on_frame(h, px);
        busy += t.elapsed();
        r
    })?;
    Ok(Run {
        seen,
        busy,
        wall: start.elapsed(),
    })
}

/// The baseline's consumer: frames of `format` read from `r` (a pipe) into a pageable buffer
/// until the stream ends, `on_frame` called on each, timed as [`run_ring`] does.
///
/// # Errors
/// [`read_frame`]'s; `on_frame`'s.
pub fn run_pipe(
    r: &mut impl Read,
    format: FrameFormat,
    mut on_frame: impl FnMut(&FrameHeader, &[u8]) -> Result<()>,
) -> Result<Run> {
    let mut pixels = vec![0u8; format.bytes()];
    let mut run = Run::default();
    let start = Instant::now();
    while let Some(h) = read_frame(r, format, &mut pixels)? {
        let t = Instant::now();
        on_frame(&h, &pixels)?;
        run.busy += t.elapsed();
        run.seen
            .push((h.seq, monotonic_ns().saturating_sub(h.capture_ns)));
    }
    run.wall = start.elapsed();
    Ok(run)
}

/// The baseline's camera: frames `0..frames` painted into a pageable buffer and written to
/// `w` (a pipe) at `fps`, each flushed; a full pipe blocks the camera, so frames arrive late
/// rather than dropped.
///
/// # Errors
/// The writer's.
pub fn produce_pipe(w: &mut impl Write, format: FrameFormat, fps: f64, frames: u64) -> Result<()> {
    let mut pixels = vec![0u8; format.bytes()];
    let start = Instant::now();
    for seq in 0..frames {
        if fps > 0.0 {
            let tick = start + Duration::from_secs_f64(seq as f64 / fps);
            if let Some(wait) = tick.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        paint(seq, format, &mut pixels);
        let h = FrameHeader {
            seq,
            capture_ns: monotonic_ns(),
            format,
        };
        write_frame(w, &h, &pixels)?;
        w.flush()
            .map_err(|e| Error::invalid(format!("writing frame {seq}: {e}")))?;
    }
    Ok(())
}

/// The CPU consumer's work on each frame: the planar transform ([`to_planar_f32`], into a
/// buffer it keeps) and the sampled pixel check ([`check_some`]) — what the example and the
/// bench pass as `on_frame`.
pub fn cpu_transform(format: FrameFormat) -> impl FnMut(&FrameHeader, &[u8]) -> Result<()> {
    let mut planar = vec![0f32; format.bytes()];
    move |h, px| {
        to_planar_f32(px, format, &mut planar);
        check_some(h, px)
    }
}

/// Checks every 16th frame's pixels against what [`paint`] painted: the consumers' guard.
///
/// # Errors
/// [`Error::InvalidSetting`](gpufeed_load::Error::InvalidSetting) naming a frame that arrived with other pixels.
pub fn check_some(h: &FrameHeader, px: &[u8]) -> Result<()> {
    if h.seq.is_multiple_of(16) && !check(h.seq, h.format, px) {
        return Err(Error::invalid(format!(
            "frame {} arrived with other pixels",
            h.seq
        )));
    }
    Ok(())
}

/// Writes one frame (header and pixels) to a pipe or socket: the baseline's producer side.
///
/// # Errors
/// The writer's.
pub fn write_frame(w: &mut impl Write, header: &FrameHeader, pixels: &[u8]) -> Result<()> {
    let mut head = [0u8; HEADER_BYTES];
    head[..32].copy_from_slice(&header.encode());
    w.write_all(&head)
        .and_then(|()| w.write_all(pixels))
        .map_err(|e| Error::invalid(format!("writing frame {}: {e}", header.seq)))
}

/// Reads one frame of `format` from a pipe into `pixels` (a pageable buffer): the baseline's
/// consumer side; `None` at the end of the stream.
///
/// # Errors
/// A stream that ends inside a frame or holds something else; the reader's.
pub fn read_frame(
    r: &mut impl Read,
    format: FrameFormat,
    pixels: &mut [u8],
) -> Result<Option<FrameHeader>> {
    let mut head = [0u8; HEADER_BYTES];
    match r.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::invalid(format!("reading a frame: {e}"))),
    }
    let header = FrameHeader::decode(&head)?;
    if header.format != format || pixels.len() < format.bytes() {
        return Err(Error::invalid(format!(
            "frame {} is {}x{}, not {}x{}",
            header.seq, header.format.width, header.format.height, format.width, format.height
        )));
    }
    r.read_exact(&mut pixels[..format.bytes()])
        .map_err(|e| Error::invalid(format!("frame {} ends early: {e}", header.seq)))?;
    Ok(Some(header))
}

/// RGB8 pixels (interleaved) to planar `f32` in [0, 1]: `out` holds the red plane, then the
/// green, then the blue (`3 * width * height` values) — the CPU form of the case study's
/// kernel.
pub fn to_planar_f32(rgb: &[u8], format: FrameFormat, out: &mut [f32]) {
    let n = format.width as usize * format.height as usize;
    let (r, rest) = out[..3 * n].split_at_mut(n);
    let (g, b) = rest.split_at_mut(n);
    for (i, px) in rgb[..3 * n].chunks_exact(3).enumerate() {
        r[i] = f32::from(px[0]) / 255.0;
        g[i] = f32::from(px[1]) / 255.0;
        b[i] = f32::from(px[2]) / 255.0;
    }
}

/// Latency and loss of a run.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LatencyStats {
    /// Frames seen.
    pub frames: u64,
    /// Frames of `0..expected` never seen (dropped by the producer or lost).
    pub dropped: u64,
    /// Frames seen later than one frame interval after their capture.
    pub late: u64,
    /// Latency, milliseconds: median, 99th percentile, largest.
    pub p50_ms: f64,
    /// See `p50_ms`.
    pub p99_ms: f64,
    /// See `p50_ms`.
    pub max_ms: f64,
}

/// The statistics of `seen` against frames `0..expected`; `interval` is the frame interval
/// (late frames: latency above it), `None` for a run without a rate.
pub fn latency_stats(seen: &[Seen], expected: u64, interval: Option<Duration>) -> LatencyStats {
    let mut lat: Vec<u64> = seen.iter().map(|&(_, l)| l).collect();
    lat.sort_unstable();
    let pick = |q: f64| -> f64 {
        if lat.is_empty() {
            return f64::NAN;
        }
        let i = ((lat.len() - 1) as f64 * q).round() as usize;
        lat[i] as f64 / 1e6
    };
    let mut numbers: Vec<u64> = seen.iter().map(|&(s, _)| s).collect();
    numbers.sort_unstable();
    numbers.dedup();
    let in_range = numbers.iter().filter(|&&s| s < expected).count() as u64;
    LatencyStats {
        frames: seen.len() as u64,
        dropped: expected.saturating_sub(in_range),
        late: interval.map_or(0, |iv| {
            lat.iter().filter(|&&l| l > iv.as_nanos() as u64).count() as u64
        }),
        p50_ms: pick(0.5),
        p99_ms: pick(0.99),
        max_ms: lat.last().map_or(f64::NAN, |&l| l as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_other_bytes_are_refused() {
        let h = FrameHeader {
            seq: 77,
            capture_ns: 123_456_789,
            format: FrameFormat::FHD,
        };
        assert_eq!(FrameHeader::decode(&h.encode()).expect("decode"), h);
        assert!(FrameHeader::decode(&[0u8; 32]).is_err());
        assert!(FrameHeader::decode(&h.encode()[..20]).is_err());
        assert_eq!(FrameFormat::UHD.bytes(), 24_883_200);
        assert_eq!(FrameFormat::UHD.slot_bytes() % 256, 0);
    }

    #[test]
    fn a_painted_frame_checks_and_another_does_not() {
        let f = FrameFormat {
            width: 33,
            height: 40,
        };
        let mut px = vec![0u8; f.bytes()];
        paint(5, f, &mut px);
        assert!(check(5, f, &px));
        assert!(!check(6, f, &px));
        px[f.bytes() - 1] ^= 1; // the last row is always checked
        assert!(!check(5, f, &px));
    }

    #[test]
    fn the_planar_transform_matches_a_reference() {
        let f = FrameFormat {
            width: 5,
            height: 3,
        };
        let rgb: Vec<u8> = (0..f.bytes()).map(|i| (i * 13 % 256) as u8).collect();
        let mut out = vec![0f32; f.bytes()];
        to_planar_f32(&rgb, f, &mut out);
        for p in 0..15 {
            for c in 0..3 {
                assert_eq!(out[c * 15 + p], f32::from(rgb[3 * p + c]) / 255.0);
            }
        }
    }

    #[test]
    fn statistics_count_drops_and_late_frames() {
        let seen = [
            (0, 1_000_000),
            (1, 3_000_000),
            (3, 20_000_000),
            (4, 2_000_000),
        ];
        let s = latency_stats(&seen, 5, Some(Duration::from_millis(16)));
        assert_eq!((s.frames, s.dropped, s.late), (4, 1, 1));
        assert_eq!(s.max_ms, 20.0);
        assert_eq!(s.p50_ms, 3.0);
    }

    #[test]
    fn the_pipe_camera_and_consumer_run_in_order() {
        let f = FrameFormat {
            width: 64,
            height: 32,
        };
        let (mut r, mut w) = std::io::pipe().expect("pipe");
        let run = std::thread::scope(|s| {
            s.spawn(move || {
                produce_pipe(&mut w, f, 500.0, 25).expect("camera");
            });
            run_pipe(&mut r, f, |h, px| {
                assert!(check(h.seq, f, px), "frame {}", h.seq);
                check_some(h, px)
            })
            .expect("consumer")
        });
        let order: Vec<u64> = run.seen.iter().map(|&(s, _)| s).collect();
        assert_eq!(order, (0..25).collect::<Vec<_>>());
        assert!(run.busy <= run.wall);
        let report = run.report(25, Some(Duration::from_millis(2)));
        assert_eq!(report.latency.dropped, 0);
        assert!(report.frames_per_s > 0.0 && report.busy_fraction <= 1.0);
        // A frame painted as another is caught by the sampled check.
        let mut px = vec![0u8; f.bytes()];
        paint(3, f, &mut px);
        let h = FrameHeader {
            seq: 16,
            capture_ns: 0,
            format: f,
        };
        assert!(check_some(&h, &px).is_err());
    }

    #[test]
    fn frames_pass_through_a_pipe_byte_for_byte() {
        let f = FrameFormat {
            width: 17,
            height: 9,
        };
        let mut wire = Vec::new();
        let mut px = vec![0u8; f.bytes()];
        for seq in 0..3 {
            paint(seq, f, &mut px);
            let h = FrameHeader {
                seq,
                capture_ns: monotonic_ns(),
                format: f,
            };
            write_frame(&mut wire, &h, &px).expect("write");
        }
        let mut r = std::io::Cursor::new(&wire[..wire.len() - 5]);
        let mut got = vec![0u8; f.bytes()];
        for seq in 0..2 {
            let h = read_frame(&mut r, f, &mut got)
                .expect("read")
                .expect("a frame");
            assert_eq!(h.seq, seq);
            assert!(check(seq, f, &got));
        }
        assert!(
            read_frame(&mut r, f, &mut got).is_err(),
            "a frame cut short"
        );
        let mut empty = std::io::Cursor::new(&[][..]);
        assert!(read_frame(&mut empty, f, &mut got).expect("end").is_none());
    }
}
