//! A rank 0 stopped (SIGSTOP, a debugger, `docker pause`) past its lease while job B comes
//! under its rendezvous name, then resumed: B's name is never removed by it. A rank 0 that
//! holds its lock is alive, however long it is stopped: B is told the name is in use. One
//! that could take no lock (no /proc in its sandbox) is judged by its heartbeat and replaced,
//! and on resume removes the name only if it still refers to its own segment.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufeed_ipc::{Error, Rendezvous, RendezvousOptions};

use crate::lockholders::{Proc, command};

const LEASE: Duration = Duration::from_millis(400);
/// Job A's rank 0 waits this long for its rank 1 (which never comes), then fails and drops its
/// handle: the moment it used to remove the name by path.
const A_JOIN: Duration = Duration::from_secs(3);

fn prefix() -> String {
    format!("gpufeed-it-stop{}", std::process::id())
}

/// Removes the test's name when dropped (a failing test leaves nothing in /dev/shm).
struct Name(String);

impl Name {
    fn path(&self) -> PathBuf {
        Path::new("/dev/shm").join(&self.0)
    }

    fn ino(&self) -> Option<u64> {
        std::fs::symlink_metadata(self.path()).ok().map(|m| m.ino())
    }
}

impl Drop for Name {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path());
    }
}

fn rank_command(name: &str, rank: usize, world: usize, join: Duration) -> std::process::Command {
    command(
        "rdv-join",
        &[
            ("GPUFEED_IT_RDV", name.to_owned()),
            ("GPUFEED_IT_RANK", rank.to_string()),
            ("GPUFEED_IT_WORLD", world.to_string()),
            ("GPUFEED_IT_JOIN_MS", join.as_millis().to_string()),
            ("GPUFEED_IT_LEASE_MS", LEASE.as_millis().to_string()),
        ],
    )
}

/// Makes `cmd` run without /proc (an empty tmpfs mounted over it in a mount namespace of its
/// own), as in a sandbox that mounts none: there no lock on a segment can be taken (it is
/// taken through `/proc/thread-self/fd`) and the process's PID namespace is unknown.
pub fn without_proc(cmd: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (unshare, mount); it allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWNS) != 0
                || libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                || libc::mount(
                    c"none".as_ptr(),
                    c"/proc".as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    std::ptr::null(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// Starts job A's rank 0 (of 2; its rank 1 never comes) and waits until it has claimed its
/// record; returns it and its segment's inode.
fn start_job_a(name: &Name, cmd: &mut std::process::Command) -> (Proc, u64) {
    let a0 = Proc::spawn(cmd).expect("spawn job A's rank 0");
    let t = Instant::now();
    loop {
        let found = gpufeed_ipc::list_rendezvous(Path::new("/dev/shm"), &prefix()).expect("list");
        if let Some(e) = found.iter().find(|e| e.name == name.0 && e.joined == 1) {
            assert_eq!(e.rank0.pid, a0.pid() as u32);
            return (a0, name.ino().expect("job A's segment"));
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{found:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Job B's rank 0 joining in a thread of this process (it waits for B's rank 1, started only
/// once A is gone).
fn join_b0(name: &str) -> std::thread::JoinHandle<gpufeed_ipc::Result<Rendezvous>> {
    let name = name.to_owned();
    std::thread::spawn(move || {
        Rendezvous::join(
            &name,
            0,
            2,
            RendezvousOptions::default()
                .with_join_timeout(Duration::from_secs(15))
                .with_lease(LEASE),
        )
    })
}

/// Resumes job A's stopped rank 0 and waits until it has given up on its rank 1 and dropped
/// its handle (it prints the error).
fn resume_and_end(a0: &mut Proc) {
    a0.signal(libc::SIGCONT);
    let said = a0.line();
    assert!(
        said.starts_with("ERROR RankNeverArrived { rank: 1"),
        "job A's rank 0: {said}"
    );
    assert!(a0.wait_exit(Duration::from_secs(10)).success());
}

/// B's late rank 1 joins B's rank 0 (`b0`) under the name: both meet.
fn b_meets(name: &Name, b0: std::thread::JoinHandle<gpufeed_ipc::Result<Rendezvous>>) {
    let mut b1 = Proc::spawn(&mut rank_command(&name.0, 1, 2, Duration::from_secs(10)))
        .expect("spawn job B's rank 1");
    let said = b1.line();
    let b0 = b0.join().expect("B's rank 0 thread");
    assert_eq!(said, "JOINED", "job B's late rank 1 (rank 0: {b0:?})");
    b0.expect("job B's rank 0 meets its rank 1");
}

/// Job A's rank 0, holding its lock, is SIGSTOPped past its lease while waiting for its rank
/// 1; job B's rank 0 comes under the same name and is told at once that the name is in use
/// (naming A's rank 0), A's segment untouched. Once A, resumed, gave up and went, B's ranks
/// meet. (Before, B's rank 0 judged A's silent rank 0 a leftover after one lease and replaced
/// the segment; A's rank 0, resumed, dropped its handle and removed the name by path — B's
/// segment's — so that B's late rank 1 never found B and both failed RankNeverArrived.)
#[test]
fn a_stopped_rank_0_holding_its_lock_keeps_its_name_and_never_removes_another() {
    let name = Name(format!("{}-locked", prefix()));
    let (mut a0, ino_a) = start_job_a(&name, &mut rank_command(&name.0, 0, 2, A_JOIN));
    a0.signal(libc::SIGSTOP);
    std::thread::sleep(3 * LEASE);
    let b0 = join_b0(&name.0);
    let t = Instant::now();
    while !b0.is_finished() && name.ino() == Some(ino_a) && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    if b0.is_finished() {
        let e = b0
            .join()
            .expect("B's rank 0 thread")
            .expect_err("the name is in use");
        assert!(
            matches!(e, Error::RendezvousInUse { pid, .. } if pid == a0.pid() as u32),
            "{e}"
        );
        assert_eq!(name.ino(), Some(ino_a), "job A's segment stays");
        resume_and_end(&mut a0);
        assert_eq!(name.ino(), None, "job A's rank 0 removed its own name");
        b_meets(&name, join_b0(&name.0));
        return;
    }
    // B replaced A's segment: A's rank 0, resumed, must at least not remove B's name.
    let ino_b = name.ino();
    assert!(ino_b.is_some_and(|i| i != ino_a), "{ino_b:?}");
    resume_and_end(&mut a0);
    assert_eq!(
        name.ino(),
        ino_b,
        "job A's rank 0, resumed, removed job B's rendezvous name"
    );
    panic!(
        "job B's rank 0 replaced the segment of a rank 0 that holds its lock (only stopped) \
         instead of answering RendezvousInUse"
    );
}

/// The same with job A's rank 0 in a sandbox without /proc, where it can take no lock: after
/// a lease of silence B's rank 0 replaces the segment (nothing says A's rank 0 lives); A's,
/// resumed, gives up and removes the name only if it is still its own segment's — it is B's:
/// left alone, and B's late rank 1 meets B's rank 0. (Before, A's rank 0 removed B's name.)
#[test]
fn a_resumed_rank_0_without_a_lock_never_removes_its_replacements_name() {
    let test = "a_resumed_rank_0_without_a_lock_never_removes_its_replacements_name";
    let name = Name(format!("{}-lockless", prefix()));
    if let Err(e) = without_proc(&mut std::process::Command::new("true")).status() {
        if !gpufeed_testkit::is_root() {
            gpufeed_testkit::skip(test, &format_args!("a mount namespace needs root: {e}"));
            return;
        }
        panic!("{test}: spawning a child without /proc failed: {e}");
    }
    let mut cmd = rank_command(&name.0, 0, 2, A_JOIN);
    let (mut a0, ino_a) = start_job_a(&name, without_proc(&mut cmd));
    let found = gpufeed_ipc::list_rendezvous(Path::new("/dev/shm"), &prefix()).expect("list");
    let a = found.iter().find(|e| e.name == name.0).expect("listed");
    assert_eq!(
        a.rank0.pid_ns, 0,
        "job A's rank 0 ran without /proc (its namespace unknown, no lock): {a:?}"
    );
    a0.signal(libc::SIGSTOP);
    std::thread::sleep(3 * LEASE);
    let b0 = join_b0(&name.0);
    let t = Instant::now();
    // B's rank 0 removes A's name, then makes its own: wait past the moment between, when
    // there is no name at all (CI once looked right then).
    while name.ino().is_none_or(|i| i == ino_a) {
        assert!(
            !b0.is_finished(),
            "B's rank 0: {:?}",
            b0.join().expect("thread").map(|_| ())
        );
        assert!(t.elapsed() < Duration::from_secs(5), "B never replaced A");
        std::thread::sleep(Duration::from_millis(5));
    }
    let ino_b = name.ino();
    assert!(ino_b.is_some(), "B's segment is under the name");
    resume_and_end(&mut a0);
    assert_eq!(
        name.ino(),
        ino_b,
        "job A's rank 0, resumed, removed job B's rendezvous name"
    );
    b_meets(&name, b0);
}

/// A rank that comes while its own rank 0 is stopped (past its lease, holding its lock) does
/// not join a segment whose rank 0 cannot answer: it waits, and once rank 0 is resumed both
/// meet. (With rank 0 judged alive by its lock alone, joining at once would have failed a lease
/// later naming rank 0 as dead.)
#[test]
fn a_rank_coming_while_its_rank_0_is_stopped_waits_and_meets() {
    let name = Name(format!("{}-late", prefix()));
    let (mut a0, _) = start_job_a(
        &name,
        &mut rank_command(&name.0, 0, 2, Duration::from_secs(20)),
    );
    a0.signal(libc::SIGSTOP);
    std::thread::sleep(3 * LEASE);
    let mut a1 = Proc::spawn(&mut rank_command(&name.0, 1, 2, Duration::from_secs(20)))
        .expect("spawn job A's rank 1");
    std::thread::sleep(4 * LEASE);
    let found = gpufeed_ipc::list_rendezvous(Path::new("/dev/shm"), &prefix()).expect("list");
    let a = found.iter().find(|e| e.name == name.0).expect("listed");
    assert_eq!(a.joined, 1, "rank 1 joined a stopped rank 0: {a:?}");
    assert!(
        a1.child.try_wait().expect("wait").is_none(),
        "rank 1 gave up"
    );
    a0.signal(libc::SIGCONT);
    assert_eq!(a1.line(), "JOINED");
    assert_eq!(a0.line(), "JOINED");
    assert_eq!(name.ino(), None, "rank 0 removed the name once both joined");
}
