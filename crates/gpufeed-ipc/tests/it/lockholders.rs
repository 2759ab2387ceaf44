//! Processes that hold the kernel's liveness locks and fork, stop or die: a ring holder or a
//! rendezvous's rank 0 that forked a child (a DataLoader worker) and was SIGKILLed is judged
//! dead while the child lives, its slot freed and its name replaced. The child roles of these
//! tests and of `stopped_rank0` live here: the test binary re-runs itself with
//! `GPUFEED_IT_CHILD=<role>` and only the `lockholders::entry` test, which returns at once
//! without the variable.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use gpufeed_ipc::{BatchRing, Rendezvous, RendezvousOptions};

/// A command re-running this binary in `role` (see [`entry`]), its stdout piped.
pub fn command(role: &str, vars: &[(&str, String)]) -> Command {
    let mut cmd = gpufeed_testkit::child_command("lockholders::entry", role, vars);
    cmd.stdout(Stdio::piped());
    cmd
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child needs {name}"))
}

fn num(name: &str) -> u64 {
    var(name).parse().expect("number")
}

/// Prints `line` for the test, marked (`@ `) apart from what the test harness prints.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "@ {line}").expect("stdout");
    out.flush().expect("flush");
}

/// Forks a child that does nothing but wait (in `pause`) until it is killed, as a DataLoader
/// worker would keep running; returns its pid. The child lets go of stdout and stderr (so that
/// nobody reading them waits for it) and dies of `SIGALRM` after a minute at the latest (a
/// failed test leaves no process behind for long).
///
/// With `raw`, the child is made by the `clone` system call itself, which runs no fork handlers
/// (as a runtime that forks by `clone` would), so that it keeps every descriptor, the locks'
/// included.
fn fork_idle_child(raw: bool) -> i32 {
    // SAFETY: the child only calls close, alarm and pause (async-signal-safe) until a signal
    // kills it; it never returns into Rust code. A raw clone with only SIGCHLD and no stack
    // makes a copy of this process as fork does.
    let pid = unsafe {
        if raw {
            libc::syscall(
                libc::SYS_clone,
                libc::SIGCHLD as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            ) as i32
        } else {
            libc::fork()
        }
    };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            libc::close(1);
            libc::close(2);
            libc::alarm(60);
            loop {
                libc::pause();
            }
        }
    }
    pid
}

#[test]
fn entry() {
    let Ok(role) = std::env::var(gpufeed_testkit::CHILD_ROLE) else {
        return;
    };
    match role.as_str() {
        // Joins rendezvous GPUFEED_IT_RDV as GPUFEED_IT_RANK of GPUFEED_IT_WORLD with a join
        // timeout of GPUFEED_IT_JOIN_MS and a lease of GPUFEED_IT_LEASE_MS; prints `JOINED`,
        // or `ERROR <the error>` (after the handle was dropped).
        "rdv-join" => {
            let opts = RendezvousOptions::default()
                .with_join_timeout(Duration::from_millis(num("GPUFEED_IT_JOIN_MS")))
                .with_lease(Duration::from_millis(num("GPUFEED_IT_LEASE_MS")));
            match Rendezvous::join(
                &var("GPUFEED_IT_RDV"),
                num("GPUFEED_IT_RANK") as usize,
                num("GPUFEED_IT_WORLD") as usize,
                opts,
            ) {
                Ok(r) => {
                    say("JOINED");
                    drop(r);
                }
                Err(e) => say(&format!("ERROR {e:?}")),
            }
        }
        // Rank 0 of 2 of rendezvous GPUFEED_IT_RDV (listed under GPUFEED_IT_PREFIX) that,
        // once its record is claimed (so its lock is held), forks an idle child (by a raw
        // clone where GPUFEED_IT_RAW_CLONE=1) and prints `FORKED <pid>`; it waits for its rank
        // 1 (a minute) until killed.
        "rdv-fork-rank0" => {
            let name = var("GPUFEED_IT_RDV");
            let prefix = var("GPUFEED_IT_PREFIX");
            let raw = var("GPUFEED_IT_RAW_CLONE") == "1";
            let watcher = std::thread::spawn(move || {
                let t = Instant::now();
                loop {
                    let found =
                        gpufeed_ipc::list_rendezvous(std::path::Path::new("/dev/shm"), &prefix)
                            .expect("list");
                    if found.iter().any(|e| e.name == name && e.joined == 1) {
                        break;
                    }
                    assert!(t.elapsed() < Duration::from_secs(10), "never claimed");
                    std::thread::sleep(Duration::from_millis(5));
                }
                let pid = fork_idle_child(raw);
                say(&format!("FORKED {pid}"));
            });
            let opts = RendezvousOptions::default()
                .with_join_timeout(Duration::from_secs(60))
                .with_lease(Duration::from_millis(num("GPUFEED_IT_LEASE_MS")));
            let r = Rendezvous::join(&var("GPUFEED_IT_RDV"), 0, 2, opts);
            let _ = watcher.join();
            say(&format!("ENDED {:?}", r.map(|_| ())));
        }
        // Opens ring GPUFEED_IT_RING, claims a slot and writes into it, forks an idle child,
        // prints `FORKED <pid>` and holds the claim until killed.
        "ring-fork-hold" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let mut claim = ring.claim(Duration::from_secs(10)).expect("claim");
            claim.write_at(0, b"half a batch").expect("write");
            let pid = fork_idle_child(false);
            say(&format!("FORKED {pid} {}", claim.slot()));
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        // Opens ring GPUFEED_IT_RING, claims a slot, writes half a batch, prints `CLAIMED
        // <slot>` and holds the claim until killed.
        "ring-claim-hold" => {
            let ring = BatchRing::open(&var("GPUFEED_IT_RING")).expect("open ring");
            let mut claim = ring.claim(Duration::from_secs(10)).expect("claim");
            claim.write_at(0, b"half a batch").expect("write");
            say(&format!("CLAIMED {}", claim.slot()));
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// A process started by a test, stopped-and-killed (and reaped) when dropped, so that a
/// failing test leaves nothing running.
pub struct Proc {
    pub child: Child,
    pub out: Option<BufReader<ChildStdout>>,
}

impl Proc {
    pub fn spawn(cmd: &mut Command) -> std::io::Result<Self> {
        let mut child = cmd.spawn()?;
        let out = child.stdout.take().map(BufReader::new);
        Ok(Proc { child, out })
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The next line the role prints ([`say`], unmarked and trimmed); panics if the process
    /// exits first.
    pub fn line(&mut self) -> String {
        let out = self.out.as_mut().expect("stdout piped");
        let mut line = String::new();
        loop {
            line.clear();
            let n = out.read_line(&mut line).expect("read");
            assert!(n > 0, "the child exited without saying anything");
            if let Some(said) = line.trim().strip_prefix("@ ") {
                return said.to_owned();
            }
        }
    }

    /// Sends `signal`.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill has no memory preconditions; the pid is our unreaped child's.
        assert_eq!(unsafe { libc::kill(self.pid(), signal) }, 0, "kill");
    }

    /// Waits for it to exit, at most `limit`; its exit status.
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                t.elapsed() < limit,
                "the child did not exit within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A forked grandchild (not ours to reap), SIGKILLed when dropped.
struct Orphan(i32);

impl Orphan {
    fn alive(&self) -> bool {
        // SAFETY: no memory preconditions.
        unsafe { libc::kill(self.0, 0) == 0 }
    }
}

impl Drop for Orphan {
    fn drop(&mut self) {
        // SAFETY: as above; the pid is the idle child our child forked (never reaped by us).
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

/// A producer that forked a child while holding a claimed slot (and the lock on its
/// process-table entry) is SIGKILLed; its child goes on running. The dead producer's slot is
/// freed within a few leases and claimed here. (Before, the child kept the inherited open file
/// description and with it the lock: the producer, its pid dead but its lock held, was judged
/// silent, and its slot stayed quarantined for as long as the child lived.)
#[test]
fn a_killed_holders_forked_child_does_not_keep_its_slot() {
    let lease = Duration::from_millis(200);
    let ring = BatchRing::create_unique(1, 4096).expect("ring");
    ring.set_lease(lease);
    let _consumer = ring.consumer().expect("consumer");
    let name = ring.segment().name().expect("named").to_owned();
    let mut holder =
        Proc::spawn(&mut command("ring-fork-hold", &[("GPUFEED_IT_RING", name)])).expect("spawn");
    let said = holder.line();
    let fields: Vec<&str> = said.split_whitespace().collect();
    assert_eq!(fields.first(), Some(&"FORKED"), "{said}");
    let orphan = Orphan(fields[1].parse().expect("pid"));
    assert_eq!(ring.stats().claimed, 1, "the holder claimed the one slot");
    holder.child.kill().expect("SIGKILL the holder");
    holder.child.wait().expect("reap");
    assert!(orphan.alive(), "the forked child runs on");
    let t = Instant::now();
    let claimed = ring.claim(10 * lease);
    assert!(orphan.alive(), "the forked child still runs");
    let claim = claimed.unwrap_or_else(|e| {
        panic!(
            "the dead holder's slot was not freed while its forked child lives ({e}; {:?})",
            ring.stats()
        )
    });
    assert_eq!(claim.slot(), 0);
    assert!(t.elapsed() < 10 * lease, "{:?}", t.elapsed());
}

/// Rank 0 of a job forks a child (a DataLoader worker) while it waits for rank 1 and is
/// SIGKILLed; the child runs on. The next job's rank 0 under the name replaces the leftover
/// (the child does not keep the dead rank 0's lock, so rank 0 is not judged alive) and its
/// ranks meet.
#[test]
fn a_killed_rank_0s_forked_child_does_not_keep_the_name() {
    killed_rank_0_with_a_child("fork", false);
}

/// The same with a child made by a raw `clone` (no fork handlers run: it keeps the lock): the
/// lock is held while rank 0's pid is dead, so rank 0's heartbeat judges it, and after a
/// silent lease the next job replaces the leftover. (A lock held alone would have kept the
/// name for as long as the child lived: RendezvousInUse naming the dead rank 0.)
#[test]
fn a_killed_rank_0s_cloned_child_keeps_the_name_only_for_a_lease() {
    killed_rank_0_with_a_child("clone", true);
}

fn killed_rank_0_with_a_child(how: &str, raw: bool) {
    let prefix = format!("gpufeed-it-{how}{}", std::process::id());
    let name = format!("{prefix}-rdv");
    let lease = Duration::from_millis(400);
    let mut rank0 = Proc::spawn(&mut command(
        "rdv-fork-rank0",
        &[
            ("GPUFEED_IT_RDV", name.clone()),
            ("GPUFEED_IT_PREFIX", prefix.clone()),
            ("GPUFEED_IT_LEASE_MS", lease.as_millis().to_string()),
            ("GPUFEED_IT_RAW_CLONE", if raw { "1" } else { "0" }.into()),
        ],
    ))
    .expect("spawn");
    let said = rank0.line();
    let pid = said
        .strip_prefix("FORKED ")
        .unwrap_or_else(|| panic!("{said}"));
    let orphan = Orphan(pid.parse().expect("pid"));
    rank0.child.kill().expect("SIGKILL rank 0");
    rank0.child.wait().expect("reap");
    assert!(orphan.alive(), "the {how}ed child runs on");
    let rank1 = Proc::spawn(&mut command(
        "rdv-join",
        &[
            ("GPUFEED_IT_RDV", name.clone()),
            ("GPUFEED_IT_RANK", "1".into()),
            ("GPUFEED_IT_WORLD", "2".into()),
            ("GPUFEED_IT_JOIN_MS", "10000".into()),
            ("GPUFEED_IT_LEASE_MS", lease.as_millis().to_string()),
        ],
    ))
    .expect("spawn");
    let joined = Rendezvous::join(
        &name,
        0,
        2,
        RendezvousOptions::default()
            .with_join_timeout(Duration::from_secs(10))
            .with_lease(lease),
    );
    assert!(orphan.alive(), "the {how}ed child still runs");
    let me = joined.unwrap_or_else(|e| {
        let _ = std::fs::remove_file(std::path::Path::new("/dev/shm").join(&name));
        panic!("the next job's rank 0 could not replace the killed rank 0's segment: {e}")
    });
    let mut rank1 = rank1;
    assert_eq!(rank1.line(), "JOINED");
    drop(me);
}
