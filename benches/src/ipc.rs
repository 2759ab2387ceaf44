//! Table 5: gpufeed-ipc's batch ring between two processes, against a single-thread memcpy of
//! the same run and a Unix socket moving the same bytes; and the wake-up latency of 64-byte
//! messages.
//!
//! Throughput: the producer process copies each 1 MiB batch into a slot and publishes it; the
//! consumer process takes it (zero copy: the batch is in its mapping, as it is for a GPU copy
//! from a registered segment), checks the batch's sequence stamp and releases the slot.
//! Socket: the producer `write`s each 1 MiB batch, the consumer `read`s it into its buffer.
//! Latency: the producer stamps CLOCK_MONOTONIC into a 64-byte message and publishes it while
//! the consumer sleeps in `next`; the consumer subtracts the stamp when it wakes. The producer
//! pauses 200 us between messages so that every message finds the consumer asleep.
//! Rendezvous: two ranks of a `gpufeed_ipc::Rendezvous` meet [`BARRIERS`] times; the other
//! process arrives 5 ms after this one (as a rank finishing its round of a replicated load
//! does) and stamps CLOCK_MONOTONIC into its payload; this one subtracts it when its
//! `exchange` returns.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpufeed_ipc::BatchRing;
use serde::Serialize;

use crate::util::{Samples, SplitMix, gbps, now_ns, timed};

pub const BATCH: usize = 1 << 20;
const SLOTS: u32 = 8;
const LATENCY_MESSAGES: usize = 2000;
/// Meetings of the rendezvous latency row.
pub const BARRIERS: usize = 400;
/// How long the late rank of the rendezvous latency row works before each meeting.
pub const BARRIER_LAG: Duration = Duration::from_millis(5);

#[derive(Debug, Serialize)]
pub struct IpcBench {
    pub batches: usize,
    pub ring_gbps: Samples,
    pub socket_gbps: Samples,
    pub latency_us: Samples,
    pub latency_p50_us: f64,
    pub latency_p99_us: f64,
    /// The rendezvous: from the late rank's arrival at a meeting until the waiting rank's
    /// `exchange` returns, microseconds.
    pub barrier_us: Samples,
    pub barrier_p50_us: f64,
    pub barrier_p99_us: f64,
}

/// Which measurement a producer process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Ring,
    Socket,
    Latency,
    Rendezvous,
}

fn spawn(exe: &Path, role: &str, target: &str, count: usize) -> Result<Child> {
    Command::new(exe)
        .args([
            "ipc-child",
            "--role",
            role,
            "--target",
            target,
            "--count",
            &count.to_string(),
        ])
        .stdin(Stdio::null())
        .spawn()
        .context("start the producer process")
}

fn finish(mut child: Child) -> Result<()> {
    let status = child.wait()?;
    ensure!(status.success(), "producer exited with {status}");
    Ok(())
}

pub fn measure(exe: &Path, dir: &Path, total_bytes: u64, reps: usize) -> Result<IpcBench> {
    let batches = (total_bytes as usize / BATCH).max(16);
    let (mut ring_runs, mut socket_runs) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        // Ring.
        let ring = BatchRing::create_unique(SLOTS, BATCH as u64)?;
        let consumer = ring.consumer()?;
        let name = ring.segment().name().context("named ring")?.to_owned();
        let child = spawn(exe, "ring", &name, batches)?;
        let first = consumer.next(Duration::from_secs(30))?;
        let t0 = std::time::Instant::now();
        drop(first);
        for i in 1..batches {
            let batch = consumer.next(Duration::from_secs(30))?;
            let mut stamp = [0u8; 8];
            batch.read_at(0, &mut stamp)?;
            ensure!(
                u64::from_le_bytes(stamp) == i as u64,
                "batch {i} out of order"
            );
        }
        ring_runs.push(gbps(
            ((batches - 1) * BATCH) as u64,
            t0.elapsed().as_secs_f64(),
        ));
        finish(child)?;

        // Unix socket.
        let path = dir.join(format!("ipc-bench-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path)?;
        let child = spawn(exe, "socket", &path.display().to_string(), batches)?;
        let (mut sock, _) = listener.accept()?;
        let mut buf = vec![0u8; BATCH];
        sock.read_exact(&mut buf)?;
        let (secs, res) = timed(|| -> std::io::Result<()> {
            for _ in 1..batches {
                sock.read_exact(&mut buf)?;
            }
            Ok(())
        });
        res?;
        socket_runs.push(gbps(((batches - 1) * BATCH) as u64, secs));
        finish(child)?;
        let _ = std::fs::remove_file(&path);
    }

    // Wake-up latency of 64-byte messages.
    let ring = BatchRing::create_unique(SLOTS, 64)?;
    let consumer = ring.consumer()?;
    let name = ring.segment().name().context("named ring")?.to_owned();
    let child = spawn(exe, "latency", &name, LATENCY_MESSAGES)?;
    let mut lat = Vec::with_capacity(LATENCY_MESSAGES);
    for _ in 0..LATENCY_MESSAGES {
        let batch = consumer.next(Duration::from_secs(30))?;
        let woke = now_ns();
        let mut stamp = [0u8; 8];
        batch.read_at(0, &mut stamp)?;
        lat.push(woke.saturating_sub(u64::from_le_bytes(stamp)) as f64 / 1e3);
    }
    finish(child)?;
    let (latency_p50_us, latency_p99_us) = (percentile(&lat, 0.50), percentile(&lat, 0.99));

    // Wake-up latency of the rendezvous's meetings.
    let name = format!("gpufeed-bench-rdv-{}", std::process::id());
    let child = spawn(exe, "rendezvous", &name, BARRIERS)?;
    let rdv = gpufeed_ipc::Rendezvous::join(&name, 0, 2, Default::default())?;
    let mut waits = Vec::with_capacity(BARRIERS);
    for _ in 0..BARRIERS {
        let all = rdv.exchange(&[])?;
        let woke = now_ns();
        let stamp: [u8; 8] = all[1].as_slice().try_into().context("rank 1's stamp")?;
        waits.push(woke.saturating_sub(u64::from_le_bytes(stamp)) as f64 / 1e3);
    }
    drop(rdv);
    finish(child)?;
    Ok(IpcBench {
        batches,
        ring_gbps: Samples::new(ring_runs),
        socket_gbps: Samples::new(socket_runs),
        latency_p50_us,
        latency_p99_us,
        latency_us: Samples::new(lat),
        barrier_p50_us: percentile(&waits, 0.50),
        barrier_p99_us: percentile(&waits, 0.99),
        barrier_us: Samples::new(waits),
    })
}

/// The `p` quantile of `v` (0..=1), by rank.
fn percentile(v: &[f64], p: f64) -> f64 {
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

/// The producer side, in its own process.
pub fn child(role: Role, target: &str, count: usize) -> Result<()> {
    match role {
        Role::Ring => {
            let ring = BatchRing::open(target)?;
            let mut data = vec![0u8; BATCH];
            SplitMix(0x1FC).fill(&mut data);
            for i in 0..count {
                data[..8].copy_from_slice(&(i as u64).to_le_bytes());
                let mut claim = ring.claim(Duration::from_secs(30))?;
                claim.write_at(0, &data)?;
                claim.set_len(BATCH as u64)?;
                claim.publish()?;
            }
        }
        Role::Socket => {
            let mut sock = std::os::unix::net::UnixStream::connect(target)?;
            let mut data = vec![0u8; BATCH];
            SplitMix(0x1FC).fill(&mut data);
            for _ in 0..count {
                sock.write_all(&data)?;
            }
        }
        Role::Latency => {
            let ring = BatchRing::open(target)?;
            for _ in 0..count {
                std::thread::sleep(Duration::from_micros(200));
                let mut claim = ring.claim(Duration::from_secs(30))?;
                claim.write_at(0, &now_ns().to_le_bytes())?;
                claim.set_len(64)?;
                claim.publish()?;
            }
        }
        Role::Rendezvous => {
            let rdv = gpufeed_ipc::Rendezvous::join(target, 1, 2, Default::default())?;
            for _ in 0..count {
                std::thread::sleep(BARRIER_LAG);
                rdv.exchange(&now_ns().to_le_bytes())?;
            }
        }
    }
    Ok(())
}

/// Table 5: gpufeed-ipc's ring, wake-ups and rendezvous.
pub fn table(s: &mut String, i: &IpcBench, memcpy: f64) {
    let _ = writeln!(
        s,
        "\n## Table 5 — gpufeed-ipc: {} batches of 1 MiB, producer process -> consumer process\n",
        i.batches
    );
    let _ = writeln!(
        s,
        "| path | GB/s | vs 1-thread memcpy ({memcpy:.1} GB/s, same run) |\n|---|---|---|"
    );
    let _ = writeln!(
        s,
        "| BatchRing (copy into the slot, zero-copy take) | {} | {:.2}x |",
        i.ring_gbps.show(2),
        i.ring_gbps.median / memcpy
    );
    let _ = writeln!(
        s,
        "| Unix socket (write + read) | {} | {:.2}x |",
        i.socket_gbps.show(2),
        i.socket_gbps.median / memcpy
    );
    let _ = writeln!(
        s,
        "\n64-byte messages, consumer asleep in `next`: wake-up latency p50 {:.1} us, p99 {:.1} us \
         ({} messages; target p50 <= 5 us).",
        i.latency_p50_us,
        i.latency_p99_us,
        i.latency_us.all.len()
    );
    let _ = writeln!(
        s,
        "\nThe rendezvous of one process per GPU (`gpufeed_ipc::Rendezvous`, two ranks), one rank \
         waiting {} ms for the other at each meeting: from the late rank's arrival until the \
         waiting rank's `exchange` returns, p50 {:.1} us, p99 {:.1} us ({} meetings).",
        BARRIER_LAG.as_millis(),
        i.barrier_p50_us,
        i.barrier_p99_us,
        i.barrier_us.all.len()
    );
}
