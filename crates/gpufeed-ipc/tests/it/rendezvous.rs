//! `Rendezvous` between real processes: ranks meet and pass payloads, and a rank that dies
//! (here or in another PID namespace), never arrives, or leaves is named within bounded time.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use gpufeed_ipc::{Error, Rendezvous, RendezvousOptions};
use gpufeed_os::process::Liveness;
use gpufeed_os::shm::ForeignSegments;

use crate::child;

const LEASE: Duration = Duration::from_millis(400);

fn opts() -> RendezvousOptions {
    RendezvousOptions::default()
        .with_join_timeout(Duration::from_secs(20))
        .with_lease(LEASE)
}

fn name(test: &str) -> String {
    format!("gpufeed-it-rdv-{test}-{}", std::process::id())
}

/// A child's part: join as `rank`, then per `mode`: `normal` exchanges twice with barriers
/// between and prints what it got; `hang` prints `JOINED` and sleeps (to be killed); `leave`
/// drops its handle after joining; `linger` leaves, then drops it 300 ms later; `wait` waits
/// at a barrier and prints the error it gets; `fd` passes descriptors ([`pass_descriptors`])
/// and prints what it read through them.
pub fn child(name: &str, rank: usize, world: usize, mode: &str) {
    let r = Rendezvous::join(name, rank, world, opts()).expect("join");
    println!("JOINED");
    match mode {
        "normal" => {
            let a = r
                .exchange(format!("rank {rank} first").as_bytes())
                .expect("exchange");
            r.barrier().expect("barrier");
            r.barrier().expect("barrier");
            let b = r
                .exchange(&vec![rank as u8; 100 * (rank + 1)])
                .expect("exchange");
            let a: Vec<String> = a
                .iter()
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
            let b: Vec<usize> = b.iter().map(Vec::len).collect();
            println!("GOT {a:?} {b:?}");
        }
        "fd" => println!("FDS {:?}", pass_descriptors(&r)),
        // Rank 0 passes at once; the others arrive 1.5 s later, so that rank 0's socket waits
        // for them (and for whoever else tries it) that long.
        "fd-late" => {
            if rank != 0 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            println!("FDS {:?}", pass_descriptors(&r));
        }
        "hang" => std::thread::sleep(Duration::from_secs(60)),
        "leave" => drop(r),
        "linger" => {
            r.leave();
            println!("LEFT");
            std::thread::sleep(Duration::from_millis(300));
            drop(r);
            println!("DEPARTED");
        }
        "wait" => match r.barrier() {
            Ok(()) => println!("ERROR none"),
            Err(e) => println!("ERROR {e}"),
        },
        other => panic!("unknown mode {other}"),
    }
}

fn rank_command(name: &str, rank: usize, world: usize, mode: &str) -> std::process::Command {
    let mut cmd = child::command(
        "rendezvous",
        &[
            ("GPUFEED_IT_RDV", name.to_owned()),
            ("GPUFEED_IT_RANK", rank.to_string()),
            ("GPUFEED_IT_WORLD", world.to_string()),
            ("GPUFEED_IT_RDV_MODE", mode.to_owned()),
        ],
    );
    cmd.stdout(Stdio::piped());
    cmd
}

fn spawn(name: &str, rank: usize, world: usize, mode: &str) -> Child {
    rank_command(name, rank, world, mode)
        .spawn()
        .expect("spawn a rank")
}

/// Lines of a child's stdout until it exits.
fn output(mut c: Child) -> (bool, Vec<String>) {
    let lines = BufReader::new(c.stdout.take().expect("stdout"))
        .lines()
        .map_while(Result::ok)
        .collect();
    (c.wait().expect("wait").success(), lines)
}

fn wait_for_line(c: &mut Child, want: &str) -> BufReader<std::process::ChildStdout> {
    let mut out = BufReader::new(c.stdout.take().expect("stdout"));
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).expect("read") > 0,
            "the child exited before printing {want}"
        );
        if line.trim() == want {
            return out;
        }
    }
}

#[test]
fn ranks_meet_and_exchange_between_processes() {
    let name = name("meet");
    let children: Vec<Child> = (1..3).map(|r| spawn(&name, r, 3, "normal")).collect();
    let me = Rendezvous::join(&name, 0, 3, opts()).expect("join as rank 0");
    assert!(
        !std::path::Path::new("/dev/shm").join(&name).exists(),
        "the name is removed once every rank joined"
    );
    let first = me.exchange(b"rank 0 first").expect("exchange");
    assert_eq!(
        first,
        vec![
            b"rank 0 first".to_vec(),
            b"rank 1 first".to_vec(),
            b"rank 2 first".to_vec()
        ]
    );
    me.barrier().expect("barrier");
    me.barrier().expect("barrier");
    let second = me.exchange(&[0u8; 100]).expect("exchange");
    assert_eq!(
        second.iter().map(Vec::len).collect::<Vec<_>>(),
        [100, 200, 300]
    );
    assert!(second[1].iter().all(|&b| b == 1) && second[2].iter().all(|&b| b == 2));
    for c in children {
        let (ok, lines) = output(c);
        assert!(ok, "a rank failed: {lines:?}");
        assert!(
            lines.iter().any(|l| l
                == "GOT [\"rank 0 first\", \"rank 1 first\", \"rank 2 first\"] [100, 200, 300]"),
            "{lines:?}"
        );
    }
    let e = me
        .exchange(&[0u8; gpufeed_ipc::MAX_PAYLOAD + 1])
        .expect_err("too large");
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
}

/// Two rounds of `share_fd`: each rank passes a memfd holding "rank R round K"; what it read
/// through the others' descriptors, per round (`-` in its own place), or the error.
fn pass_descriptors(r: &Rendezvous) -> Result<Vec<Vec<String>>, String> {
    use std::io::Write;
    (0..2)
        .map(|round| {
            let fd = rustix::fs::memfd_create("gpufeed-it", rustix::fs::MemfdFlags::CLOEXEC)
                .map_err(|e| e.to_string())?;
            let mut file = std::fs::File::from(fd);
            write!(file, "rank {} round {round}", r.rank()).map_err(|e| e.to_string())?;
            let theirs = r
                .share_fd(std::os::fd::AsFd::as_fd(&file))
                .map_err(|e| e.to_string())?;
            Ok(theirs
                .into_iter()
                .map(|fd| match fd {
                    None => "-".to_owned(),
                    Some(fd) => {
                        // `pread`: the ranks given the same descriptor share its file offset.
                        use std::os::unix::fs::FileExt;
                        let mut text = vec![0u8; 64];
                        let n = std::fs::File::from(fd).read_at(&mut text, 0).expect("read");
                        String::from_utf8_lossy(&text[..n]).into_owned()
                    }
                })
                .collect())
        })
        .collect()
}

fn descriptor_sockets() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .expect("list /dev/shm")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(".gpufeed-fd-"))
        .collect()
}

#[test]
fn ranks_pass_descriptors_between_processes() {
    let name = name("fds");
    let before = descriptor_sockets();
    let children: Vec<Child> = (1..3).map(|r| spawn(&name, r, 3, "fd")).collect();
    let me = Rendezvous::join(&name, 0, 3, opts()).expect("join as rank 0");
    let got = pass_descriptors(&me).expect("pass descriptors");
    let want = |me: usize| -> Vec<Vec<String>> {
        (0..2)
            .map(|k| {
                (0..3)
                    .map(|r| {
                        if r == me {
                            "-".to_owned()
                        } else {
                            format!("rank {r} round {k}")
                        }
                    })
                    .collect()
            })
            .collect()
    };
    assert_eq!(got, want(0));
    for (i, c) in children.into_iter().enumerate() {
        let (ok, lines) = output(c);
        assert!(ok, "{lines:?}");
        assert!(
            lines.contains(&format!("FDS Ok({:?})", want(i + 1))),
            "{lines:?}"
        );
    }
    assert_eq!(descriptor_sockets(), before, "every socket file is removed");
}

#[test]
fn a_rank_killed_before_passing_descriptors_is_named() {
    let name = name("fd-killed");
    let mut hang = spawn(&name, 1, 3, "hang");
    let other = spawn(&name, 2, 3, "fd");
    let me = Rendezvous::join(&name, 0, 3, opts()).expect("join");
    let _out = wait_for_line(&mut hang, "JOINED");
    hang.kill().expect("kill rank 1");
    let t = Instant::now();
    let file = std::fs::File::open("/dev/null").expect("open");
    let e = me
        .share_fd(std::os::fd::AsFd::as_fd(&file))
        .expect_err("rank 1 is dead");
    assert!(matches!(e, Error::RankDied { rank: 1, .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    hang.wait().expect("reap");
    let (_, lines) = output(other);
    assert!(
        lines.iter().any(|l| l.starts_with("FDS Err(\"rank 1 ")),
        "rank 2 names rank 1: {lines:?}"
    );
}

#[test]
fn a_killed_rank_is_named_within_a_lease() {
    let name = name("killed");
    let mut hang = spawn(&name, 1, 3, "hang");
    let waiter = spawn(&name, 2, 3, "wait");
    let me = Rendezvous::join(&name, 0, 3, opts()).expect("join");
    let _out = wait_for_line(&mut hang, "JOINED");
    hang.kill().expect("kill rank 1");
    let t = Instant::now();
    let e = me.barrier().expect_err("rank 1 is dead");
    assert!(matches!(e, Error::RankDied { rank: 1, .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    hang.wait().expect("reap");
    let (_, lines) = output(waiter);
    assert!(
        lines.iter().any(|l| l.starts_with("ERROR rank 1 ")),
        "rank 2 names rank 1: {lines:?}"
    );
}

/// A rank waiting on something other than the rendezvous (an NCCL collective) watches the
/// others: a live rank passes, one that left and one killed are named, without a barrier.
#[test]
fn a_watch_names_ranks_that_left_or_died_without_a_barrier() {
    let name = name("watch");
    let mut hang = spawn(&name, 1, 3, "hang");
    let mut linger = spawn(&name, 2, 3, "linger");
    let me = Rendezvous::join(&name, 0, 3, opts()).expect("join");
    let mut watch = me.watch();
    let _hang_out = wait_for_line(&mut hang, "JOINED");
    let _linger_out = wait_for_line(&mut linger, "LEFT");
    let e = watch.check().expect_err("rank 2 left");
    assert!(matches!(e, Error::RankLeft { rank: 2 }), "{e}");
    linger.wait().expect("reap rank 2");
    // A watch over rank 1 alone (rank 2 is gone): alive, then killed.
    let t = Instant::now();
    let alive = |w: &mut gpufeed_ipc::RankWatch<'_>| match w.check() {
        Err(Error::RankLeft { rank: 2 }) => Ok(()),
        other => other,
    };
    while t.elapsed() < LEASE * 2 {
        alive(&mut watch).expect("rank 1 lives");
        std::thread::sleep(Duration::from_millis(20));
    }
    hang.kill().expect("kill rank 1");
    let killed = Instant::now();
    let e = loop {
        match alive(&mut watch) {
            Ok(()) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => break e,
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "rank 1 never named"
        );
    };
    assert!(matches!(e, Error::RankDied { rank: 1, .. }), "{e}");
    hang.wait().expect("reap rank 1");
}

/// A rank in another PID namespace (a container sharing /dev/shm): its pid means nothing here,
/// so only its heartbeat tells that it died.
#[test]
fn a_killed_rank_in_another_pid_namespace_is_named_by_its_heartbeat() {
    let test = "a_killed_rank_in_another_pid_namespace_is_named_by_its_heartbeat";
    let name = name("ns");
    let mut cmd = child::command(
        "rendezvous",
        &[
            ("GPUFEED_IT_RDV", name.clone()),
            ("GPUFEED_IT_RANK", "1".into()),
            ("GPUFEED_IT_WORLD", "2".into()),
            ("GPUFEED_IT_RDV_MODE", "hang".into()),
        ],
    );
    cmd.stdout(Stdio::piped());
    let Some(mut hang) = gpufeed_testkit::spawn_in_new_pid_namespace(test, &mut cmd) else {
        return;
    };
    let me = Rendezvous::join(&name, 0, 2, opts()).expect("join");
    let _out = wait_for_line(&mut hang, "JOINED");
    hang.kill().expect("kill rank 1");
    let t = Instant::now();
    let e = me.barrier().expect_err("rank 1 is dead");
    assert!(matches!(e, Error::RankDied { rank: 1, .. }), "{e}");
    assert!(
        t.elapsed() >= LEASE / 2 && t.elapsed() < Duration::from_secs(5),
        "judged by the lease: {:?}",
        t.elapsed()
    );
    hang.wait().expect("reap");
}

#[test]
fn a_rank_that_never_arrives_or_leaves_is_named() {
    let name = name("never");
    let t = Instant::now();
    let short = opts().with_join_timeout(Duration::from_millis(300));
    let e = Rendezvous::join(&name, 0, 2, short).expect_err("rank 1 never comes");
    assert!(
        matches!(
            e,
            Error::RankNeverArrived {
                rank: 1,
                world: 2,
                ..
            }
        ),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(
        !std::path::Path::new("/dev/shm").join(&name).exists(),
        "a failed rank 0 leaves nothing behind"
    );
    // Rank 0 never comes either, seen from rank 1.
    let e = Rendezvous::join(&name, 1, 2, short).expect_err("rank 0 never comes");
    assert!(matches!(e, Error::RankNeverArrived { rank: 0, .. }), "{e}");

    let name = self::name("leave");
    let leaver = spawn(&name, 1, 2, "leave");
    let me = Rendezvous::join(&name, 0, 2, opts()).expect("join");
    let (ok, _) = output(leaver);
    assert!(ok);
    let e = me.barrier().expect_err("rank 1 left");
    assert!(matches!(e, Error::RankLeft { rank: 1 }), "{e}");
}

#[test]
fn a_leftover_of_a_crashed_job_and_bad_settings_are_handled() {
    let name = name("leftover");
    // A job whose rank 0 was killed while waiting for rank 1 leaves its segment behind.
    let mut crashed = spawn(&name, 0, 2, "hang");
    let path = std::path::Path::new("/dev/shm").join(&name);
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "rank 0 never made the segment"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    crashed.kill().expect("kill");
    crashed.wait().expect("reap");
    assert!(path.exists(), "the crashed job's segment is left over");
    // The next job of the same name meets normally: rank 1 starts first and must not join
    // the leftover.
    let rank1 = spawn(&name, 1, 2, "normal");
    std::thread::sleep(Duration::from_millis(100));
    let me = Rendezvous::join(&name, 0, 2, opts()).expect("join over a leftover");
    me.exchange(b"rank 0 first").expect("exchange");
    me.barrier().expect("barrier");
    me.barrier().expect("barrier");
    me.exchange(b"x").expect("exchange");
    let (ok, lines) = output(rank1);
    assert!(ok, "{lines:?}");
    drop(me);

    // Settings: ranks outside the world, worlds that disagree.
    for (rank, world) in [(2, 2), (0, 0), (0, gpufeed_ipc::MAX_RANKS + 1)] {
        let e = Rendezvous::join(&name, rank, world, opts()).expect_err("bad rank");
        assert!(matches!(e, Error::InvalidLayout(_)), "{e}");
    }
    let name = self::name("worlds");
    let other = spawn(&name, 0, 3, "hang");
    let t = Instant::now();
    let e = loop {
        match Rendezvous::join(
            &name,
            1,
            2,
            opts().with_join_timeout(Duration::from_secs(10)),
        ) {
            Err(Error::InvalidLayout(m)) => break m,
            Err(e) if t.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(10));
            }
            other => panic!("expected a world mismatch, got {other:?}"),
        }
    };
    assert!(e.contains("for 3 ranks") && e.contains("told 2"), "{e}");
    let mut other = other;
    other.kill().expect("kill");
    other.wait().expect("reap");
    // Its segment is a crashed job's leftover now: collected, not left in /dev/shm.
    let shm = std::path::Path::new("/dev/shm");
    let prefix = name.rsplit_once('-').expect("a pid suffix").0;
    let report = gpufeed_ipc::gc_rendezvous(shm, prefix, ForeignSegments::Keep).expect("gc");
    assert!(report.removed.contains(&name), "{report:?}");
    assert!(!shm.join(&name).exists());
}

#[test]
fn a_rank_waits_until_the_others_have_departed() {
    let name = self::name("linger");
    let mut lingerer = spawn(&name, 1, 2, "linger");
    let me = Rendezvous::join(&name, 0, 2, opts()).expect("join");
    let mut out = wait_for_line(&mut lingerer, "JOINED");
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    assert_eq!(line.trim(), "LEFT");
    // Rank 1 has left but keeps its handle for 300 ms: a shorter wait says it is still there.
    let t = Instant::now();
    assert!(
        !me.wait_until_departed(Duration::from_millis(50)),
        "rank 1 is still there"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(50),
        "{:?}",
        t.elapsed()
    );
    // Then it drops its handle, waking this rank long before the timeout.
    let t = Instant::now();
    assert!(
        me.wait_until_departed(Duration::from_secs(20)),
        "rank 1 departed"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let lines: Vec<String> = out.lines().map_while(Result::ok).collect();
    assert!(lingerer.wait().expect("wait").success());
    assert_eq!(
        lines.first().map(String::as_str),
        Some("DEPARTED"),
        "{lines:?}"
    );
    // A rank that died is gone too.
    let name = self::name("linger-killed");
    let mut hang = spawn(&name, 1, 2, "hang");
    let me = Rendezvous::join(&name, 0, 2, opts()).expect("join");
    let _out = wait_for_line(&mut hang, "JOINED");
    hang.kill().expect("kill rank 1");
    hang.wait().expect("reap");
    assert!(
        me.wait_until_departed(Duration::from_secs(20)),
        "a dead rank is gone"
    );
}

/// What ranks killed inside `share_fd` leave (`.gpufeed-fd-*`: a private directory with the
/// socket in it, or a socket of the earlier form) is removed once it is old enough; a young one
/// (a live call's), a regular file of that name and other names are left alone.
#[test]
fn stale_descriptor_sockets_are_removed_and_nothing_else() {
    use rustix::fs::{AtFlags, CWD, Timespec, Timestamps, utimensat};
    let dir = tempfile::tempdir().expect("tempdir");
    let old = dir.path().join(".gpufeed-fd-00ab-3-1");
    let young = dir.path().join(".gpufeed-fd-00ab-3-0");
    let regular = dir.path().join(".gpufeed-fd-regular");
    let other = dir.path().join("other-socket");
    // Today's form: a private directory holding the socket.
    let old_dir = dir.path().join(".gpufeed-fd-00ab-4-1-0123456789abcdef");
    let young_dir = dir.path().join(".gpufeed-fd-00ab-4-0-0123456789abcdef");
    for d in [&old_dir, &young_dir] {
        std::fs::create_dir(d).expect("mkdir");
    }
    let _listeners: Vec<_> = [
        &old,
        &young,
        &other,
        &old_dir.join("s"),
        &young_dir.join("s"),
    ]
    .iter()
    .map(|p| std::os::unix::net::UnixListener::bind(p).expect("bind"))
    .collect();
    std::fs::write(&regular, b"").expect("file");
    let two_hours_ago = std::time::SystemTime::now() - Duration::from_secs(7200);
    let secs = two_hours_ago
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs() as i64;
    let then = Timespec {
        tv_sec: secs,
        tv_nsec: 0,
    };
    let times = Timestamps {
        last_access: then,
        last_modification: then,
    };
    for p in [&old, &regular, &other, &old_dir] {
        utimensat(CWD, p.as_path(), &times, AtFlags::SYMLINK_NOFOLLOW).expect("age it");
    }
    let removed =
        gpufeed_ipc::remove_stale_sockets(dir.path(), gpufeed_ipc::STALE_SOCKET_AGE).expect("gc");
    assert_eq!(
        removed,
        vec![
            ".gpufeed-fd-00ab-3-1".to_owned(),
            ".gpufeed-fd-00ab-4-1-0123456789abcdef".to_owned()
        ]
    );
    assert!(!old.exists() && !old_dir.exists());
    for kept in [&young, &regular, &other, &young_dir] {
        assert!(kept.exists(), "{} kept", kept.display());
    }
}

/// What an intruder got: descriptor sockets (or their directories) of the owner it saw, the
/// sockets it could connect to, and the descriptors it was given.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Intrusion {
    pub seen: usize,
    pub connected: usize,
    pub stolen: usize,
}

/// For `for_time`, connects to every descriptor socket of uid `owner` in /dev/shm that this
/// process can reach (`.gpufeed-fd-*` itself, or a socket in such a directory that it can
/// list), claims to be rank `claim` and waits for a descriptor.
pub fn intrude(owner: u32, claim: u32, for_time: Duration) -> Intrusion {
    use std::io::Write;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut seen = std::collections::HashSet::new();
    let mut tried = std::collections::HashSet::new();
    let mut got = Intrusion::default();
    let t = Instant::now();
    while t.elapsed() < for_time {
        for e in std::fs::read_dir("/dev/shm")
            .expect("list /dev/shm")
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if !name.starts_with(".gpufeed-fd-") || meta.uid() != owner {
                continue;
            }
            seen.insert(name);
            let sockets: Vec<std::path::PathBuf> = if meta.file_type().is_socket() {
                vec![e.path()]
            } else if meta.is_dir() {
                std::fs::read_dir(e.path())
                    .map(|d| d.flatten().map(|x| x.path()).collect())
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            for sock in sockets {
                if !tried.insert(sock.clone()) {
                    continue;
                }
                let Ok(mut s) = std::os::unix::net::UnixStream::connect(&sock) else {
                    continue;
                };
                got.connected += 1;
                let _ = s.write_all(&claim.to_le_bytes());
                let _ = s.set_read_timeout(Some(Duration::from_secs(4)));
                if gpufeed_ipc::recv_fd(&s).is_ok() {
                    got.stolen += 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    got.seen = seen.len();
    got
}

const NOBODY: u32 = 65534;

/// The two ranks' `FDS` lines, as `ranks_pass_descriptors_between_processes` checks them.
fn assert_both_ranks_got_their_descriptors(ranks: Vec<Child>) {
    for (r, c) in ranks.into_iter().enumerate() {
        let (ok, lines) = output(c);
        let want: Vec<Vec<String>> = (0..2)
            .map(|k| {
                (0..2)
                    .map(|o| {
                        if o == r {
                            "-".to_owned()
                        } else {
                            format!("rank {o} round {k}")
                        }
                    })
                    .collect()
            })
            .collect();
        assert!(
            ok && lines.contains(&format!("FDS Ok({want:?})")),
            "rank {r}: {lines:?}"
        );
    }
}

/// A process of another user (`nobody`) tries every descriptor socket of our ranks while rank
/// 0 waits for rank 1 in `share_fd`, claiming to be rank 1: it reaches none (each is in a
/// private 0700 directory), and both ranks get their descriptors. The ranks run with umask 0,
/// the worst a job may have. (Before, the socket lay in /dev/shm itself with the umask's mode:
/// the intruder connected first and was given rank 0's descriptor.)
#[test]
fn a_process_of_another_user_gets_no_descriptor_from_share_fd() {
    let test = "a_process_of_another_user_gets_no_descriptor_from_share_fd";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(test, &"running a process as nobody needs root");
        return;
    }
    use std::os::unix::process::CommandExt;
    let name = name("fd-intruder");
    let mut intruder = child::command("fd-intruder", &[]);
    intruder
        .env("GPUFEED_IT_OWNER", "0")
        .env("GPUFEED_IT_CLAIM", "1")
        .env("GPUFEED_IT_FOR_MS", "3500")
        .stdout(Stdio::piped())
        .uid(NOBODY)
        .gid(NOBODY);
    let intruder = intruder.spawn().expect("spawn the intruder as nobody");
    let ranks: Vec<Child> = (0..2)
        .map(|r| {
            let mut cmd = rank_command(&name, r, 2, "fd-late");
            // SAFETY: umask is async-signal-safe and allocates nothing.
            unsafe {
                cmd.pre_exec(|| {
                    libc::umask(0);
                    Ok(())
                })
            };
            cmd.spawn().expect("spawn a rank")
        })
        .collect();
    let (ok, lines) = output(intruder);
    assert!(ok, "the intruder failed: {lines:?}");
    let got = lines
        .iter()
        .find_map(|l| l.strip_prefix("INTRUSION "))
        .unwrap_or_else(|| panic!("the intruder said nothing: {lines:?}"))
        .to_owned();
    assert!(
        got.contains(" stolen: 0 "),
        "a process of another user was given a rank's descriptor: {got}"
    );
    assert_both_ranks_got_their_descriptors(ranks);
    assert!(
        !got.contains("seen: 0,"),
        "the intruder never saw a descriptor socket: the test tested nothing: {got}"
    );
}

/// Ranks of `nobody` pass descriptors while a process of another user that can reach their
/// sockets anyway (root) connects first and claims to be rank 1: its credentials
/// (`SO_PEERCRED`) give it away, it gets nothing, and both ranks still get their descriptors.
/// (Before, nothing was checked and root was given rank 0's descriptor.)
#[test]
fn a_rank_gives_its_descriptor_only_to_its_own_user() {
    let test = "a_rank_gives_its_descriptor_only_to_its_own_user";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(test, &"running ranks as nobody needs root");
        return;
    }
    use std::os::unix::process::CommandExt;
    let name = name("fd-peercred");
    let ranks: Vec<Child> = (0..2)
        .map(|r| {
            rank_command(&name, r, 2, "fd-late")
                .uid(NOBODY)
                .gid(NOBODY)
                .spawn()
                .expect("spawn a rank as nobody")
        })
        .collect();
    let got = intrude(NOBODY, 1, Duration::from_millis(3500));
    assert_eq!(got.stolen, 0, "root was given a rank's descriptor: {got:?}");
    assert_both_ranks_got_their_descriptors(ranks);
    assert!(
        got.connected > 0,
        "root never connected to a rank's socket: the test tested nothing: {got:?}"
    );
}

/// Waits until `/dev/shm/<name>` exists (a rank 0 made it); returns its inode.
fn wait_for_segment(name: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let path = std::path::Path::new("/dev/shm").join(name);
    let t = Instant::now();
    loop {
        if let Ok(m) = std::fs::metadata(&path) {
            return m.ino();
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "rank 0 never made the segment"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A job of 4 ranks whose rank 0 was SIGKILLed while waiting leaves its segment; the next job
/// under the name has 2 ranks, and its rank 1, started first, waits past the leftover for its
/// own rank 0 instead of failing at once: both meet. (Before, rank 1 failed at once: "made by
/// rank 0 for 4 ranks, and this rank was told 2".)
#[test]
fn a_leftover_of_another_world_size_is_replaced() {
    let name = name("world4");
    let mut crashed = spawn(&name, 0, 4, "hang");
    wait_for_segment(&name);
    crashed.kill().expect("kill");
    crashed.wait().expect("reap");
    assert!(
        std::path::Path::new("/dev/shm").join(&name).exists(),
        "the crashed job's segment is left over"
    );
    let rank1 = spawn(&name, 1, 2, "normal");
    std::thread::sleep(Duration::from_millis(300));
    let me = Rendezvous::join(
        &name,
        0,
        2,
        opts().with_join_timeout(Duration::from_secs(5)),
    )
    .expect("rank 0 joins over a leftover of another world size");
    me.exchange(b"rank 0 first").expect("exchange");
    me.barrier().expect("barrier");
    me.barrier().expect("barrier");
    me.exchange(b"x").expect("exchange");
    let (ok, lines) = output(rank1);
    assert!(ok, "rank 1: {lines:?}");
}

/// A file of another user (`nobody`) under the rendezvous name: every rank says at once that
/// the name is squatted, naming the owner, and the file is left as it was. (Before, rank 0 —
/// root — removed it and waited out its timeout for ranks that could not follow, and the
/// other ranks failed with a bare "owned by another user".)
#[test]
fn a_rendezvous_name_squatted_by_another_user_is_reported_and_left_alone() {
    let test = "a_rendezvous_name_squatted_by_another_user_is_reported_and_left_alone";
    if !gpufeed_testkit::is_root() {
        gpufeed_testkit::skip(test, &"making a file as nobody needs root");
        return;
    }
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    let name = name("squat");
    let path = std::path::Path::new("/dev/shm").join(&name);
    let made = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("umask 077 && printf x > '{}'", path.display()))
        .uid(NOBODY)
        .gid(NOBODY)
        .status()
        .expect("run sh as nobody");
    assert!(made.success(), "nobody could not make {}", path.display());
    let ino = std::fs::metadata(&path).expect("the squatter's file").ino();
    let t = Instant::now();
    for rank in [0, 1] {
        let e = Rendezvous::join(
            &name,
            rank,
            2,
            opts().with_join_timeout(Duration::from_secs(3)),
        )
        .expect_err("the name is squatted");
        assert!(
            matches!(
                e,
                Error::RendezvousSquatted {
                    owner_uid: NOBODY,
                    ..
                }
            ),
            "rank {rank}: {e}"
        );
        assert!(e.to_string().contains("uid 65534"), "{e}");
    }
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let m = std::fs::metadata(&path).expect("the squatter's file is left");
    assert_eq!((m.ino(), m.uid()), (ino, NOBODY));
    std::fs::remove_file(&path).expect("clean up");
}

/// Job A's rank 0 waits in the rendezvous for its rank 1 when job B's rank 0 comes under the
/// same name: B is told the name is in use (naming A's rank 0), A's segment stays, and A's
/// ranks meet. (Before, B's rank 0 removed A's segment and made its own.)
#[test]
fn a_rendezvous_whose_rank_0_lives_is_never_removed() {
    use std::os::unix::fs::MetadataExt;
    let name = name("in-use");
    let a0 = spawn(&name, 0, 2, "normal");
    let ino = wait_for_segment(&name);
    let e = Rendezvous::join(
        &name,
        0,
        3,
        opts().with_join_timeout(Duration::from_secs(3)),
    )
    .expect_err("the name is in use");
    assert!(
        matches!(e, Error::RendezvousInUse { pid, world: 2, .. } if pid == a0.id()),
        "{e}"
    );
    let path = std::path::Path::new("/dev/shm").join(&name);
    assert_eq!(
        std::fs::metadata(&path).map(|m| m.ino()).ok(),
        Some(ino),
        "job A's segment was removed or replaced"
    );
    let a1 = spawn(&name, 1, 2, "normal");
    for (r, c) in [a0, a1].into_iter().enumerate() {
        let (ok, lines) = output(c);
        assert!(ok, "job A's rank {r}: {lines:?}");
    }
}

/// The rendezvous segments named `<prefix>-*` in /dev/shm, once `ready` holds for them.
fn rendezvous_when(
    prefix: &str,
    ready: impl Fn(&[gpufeed_ipc::RendezvousSegment]) -> bool,
) -> Vec<gpufeed_ipc::RendezvousSegment> {
    let t = Instant::now();
    loop {
        let found = gpufeed_ipc::list_rendezvous(std::path::Path::new("/dev/shm"), prefix)
            .expect("list rendezvous segments");
        if ready(&found) {
            return found;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{found:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A job whose rank 0 was SIGKILLed while it waited leaves its rendezvous segment; gc lists it
/// with its rank 0 dead and removes it, and keeps a live job's (its rank 0 waiting for rank 1),
/// which then meets and removes its own name. (Before, neither was visible to `shm ls` or
/// `shm gc`, and the test suite left such a segment in /dev/shm on every run.)
#[test]
fn a_crashed_jobs_rendezvous_is_collected_and_a_live_one_is_not() {
    let prefix = format!("gpufeed-it-gc{}", std::process::id());
    let (crashed_name, live_name) = (format!("{prefix}-crashed"), format!("{prefix}-live"));
    let shm = std::path::Path::new("/dev/shm");
    let mut crashed = spawn(&crashed_name, 0, 2, "hang");
    let crashed_pid = crashed.id();
    // Once it has claimed its record.
    rendezvous_when(&prefix, |f| f.iter().any(|e| e.joined == 1));
    crashed.kill().expect("kill");
    crashed.wait().expect("reap");
    let live = spawn(&live_name, 0, 2, "normal");
    let found = rendezvous_when(&prefix, |f| f.len() == 2 && f.iter().all(|e| e.joined == 1));
    let summary: Vec<_> = found
        .iter()
        .map(|e| (e.name.as_str(), e.world, e.rank0.pid, e.ranks))
        .collect();
    assert_eq!(
        summary,
        vec![
            (crashed_name.as_str(), 2, crashed_pid, Liveness::Dead),
            (live_name.as_str(), 2, live.id(), Liveness::Alive),
        ]
    );
    let report = gpufeed_ipc::gc_rendezvous(shm, &prefix, ForeignSegments::Keep).expect("gc");
    assert_eq!(report.removed, vec![crashed_name.clone()], "{report:?}");
    assert_eq!(report.kept, vec![live_name.clone()], "{report:?}");
    assert!(report.removed_bytes > 0);
    assert!(!shm.join(&crashed_name).exists() && shm.join(&live_name).exists());
    let rank1 = spawn(&live_name, 1, 2, "normal");
    for (r, c) in [live, rank1].into_iter().enumerate() {
        let (ok, lines) = output(c);
        assert!(ok, "rank {r}: {lines:?}");
    }
    assert_eq!(
        gpufeed_ipc::list_rendezvous(shm, &prefix).expect("list"),
        vec![],
        "the live job's name is removed once it met"
    );
}

/// A second process given a rank that a live process holds is refused (`RankTaken`), and its
/// failed join leaves the holder's record alone: the job meets. (Before, the refused handle's
/// drop marked the holder's rank as left, and the whole job failed naming it.)
#[test]
fn a_rank_given_twice_fails_alone_and_the_job_still_meets() {
    let name = name("twice");
    let rank0 = spawn(&name, 0, 3, "normal");
    let rank1 = spawn(&name, 1, 3, "normal");
    // Once the segment is live under the name with ranks 0 and 1 in it.
    let prefix = name.rsplit_once('-').expect("a pid suffix").0;
    rendezvous_when(prefix, |f| {
        f.iter().any(|e| e.name == name && e.joined == 2)
    });
    let e = Rendezvous::join(&name, 1, 3, opts()).expect_err("rank 1 is taken");
    assert!(
        matches!(
            e,
            Error::RankTaken {
                rank: 1,
                left: false,
                ..
            }
        ),
        "{e}"
    );
    let rank2 = spawn(&name, 2, 3, "normal");
    for (r, c) in [rank0, rank1, rank2].into_iter().enumerate() {
        let (ok, lines) = output(c);
        assert!(ok, "rank {r}: {lines:?}");
    }
}
