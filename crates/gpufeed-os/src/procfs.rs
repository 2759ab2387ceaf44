//! Parsers for the text files of /proc and /sys that gpufeed reads.
//!
//! Every parser is a pure function of the file's text so it can be tested against captured
//! samples; reading the file is the caller's business.

/// The value of `key` in `/proc/meminfo`-style text (`Key:   123 kB`), in bytes.
///
/// Values without a unit (`HugePages_Total: 0`) are returned as they are.
pub(crate) fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, rest) = line.split_once(':')?;
        if name.trim() != key {
            return None;
        }
        let mut words = rest.split_whitespace();
        let value: u64 = words.next()?.parse().ok()?;
        match words.next() {
            None => Some(value),
            Some("kB") => value.checked_mul(1024),
            Some(_) => None,
        }
    })
}

/// The selected word of a sysfs multiple-choice file: `always [madvise] never` -> `madvise`.
pub(crate) fn bracketed(text: &str) -> Option<&str> {
    let start = text.find('[')?;
    let end = start + text[start..].find(']')?;
    Some(&text[start + 1..end])
}

/// A single integer file such as `/proc/sys/vm/swappiness`.
pub(crate) fn single_u64(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// Field 22 (`starttime`, clock ticks after boot) of `/proc/<pid>/stat` text.
///
/// The second field (the command name) may hold spaces and parentheses, so the fields are
/// counted from the last `)`.
pub(crate) fn stat_starttime(text: &str) -> Option<u64> {
    let after_comm = &text[text.rfind(')')? + 1..];
    // after_comm starts with field 3 (state); starttime is field 22.
    after_comm.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// The `Umask:` line of `/proc/<pid>/status` text (octal, Linux 4.7+).
pub(crate) fn status_umask(text: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix("Umask:")?.trim();
        u32::from_str_radix(value, 8).ok().filter(|&m| m <= 0o777)
    })
}

/// The `Pid:` line of a pidfd's `/proc/<pid>/fdinfo/<fd>` text: the process's pid in the PID
/// namespace of that /proc, 0 where it has none there, -1 once it exited (Linux 5.3+).
pub(crate) fn fdinfo_pid(text: &str) -> Option<i64> {
    text.lines()
        .find_map(|line| line.strip_prefix("Pid:")?.trim().parse().ok())
}

/// The boot-time offset of `/proc/<pid>/timens_offsets` text (`boottime <s> <ns>`), in
/// nanoseconds (negative offsets allowed).
pub(crate) fn timens_boottime_ns(text: &str) -> Option<i64> {
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        if words.next()? != "boottime" {
            return None;
        }
        let secs: i64 = words.next()?.parse().ok()?;
        let nanos: i64 = words.next()?.parse().ok()?;
        secs.checked_mul(1_000_000_000)?.checked_add(nanos)
    })
}

/// One line of a pressure-stall file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PsiLine {
    /// Share of the last 10 s in which tasks stalled, in percent.
    pub avg10: f64,
    /// Same over 60 s.
    pub avg60: f64,
    /// Same over 300 s.
    pub avg300: f64,
    /// Total stall time in microseconds since boot.
    pub total_us: u64,
}

/// The `some` and `full` lines of `/proc/pressure/memory`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Psi {
    /// Some task stalled on memory.
    pub some: PsiLine,
    /// All non-idle tasks stalled on memory at once (absent on old kernels).
    pub full: Option<PsiLine>,
}

fn psi_line(line: &str) -> Option<(&str, PsiLine)> {
    let mut words = line.split_whitespace();
    let kind = words.next()?;
    let (mut avg10, mut avg60, mut avg300, mut total_us) = (None, None, None, None);
    for word in words {
        let (key, value) = word.split_once('=')?;
        match key {
            "avg10" => avg10 = value.parse().ok(),
            "avg60" => avg60 = value.parse().ok(),
            "avg300" => avg300 = value.parse().ok(),
            "total" => total_us = value.parse().ok(),
            _ => {}
        }
    }
    Some((
        kind,
        PsiLine {
            avg10: avg10?,
            avg60: avg60?,
            avg300: avg300?,
            total_us: total_us?,
        },
    ))
}

/// Parses `/proc/pressure/memory` text.
pub(crate) fn psi(text: &str) -> Option<Psi> {
    let mut some = None;
    let mut full = None;
    for line in text.lines() {
        match psi_line(line)? {
            ("some", l) => some = Some(l),
            ("full", l) => full = Some(l),
            _ => {}
        }
    }
    Some(Psi { some: some?, full })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24684092 kB\nMemFree:        23117404 kB\n\
MemAvailable:   23667764 kB\nBuffers:           70108 kB\nHugePages_Total:       0\n\
Hugepagesize:       2048 kB\n";

    #[test]
    fn meminfo_values_are_bytes() {
        assert_eq!(
            meminfo_bytes(MEMINFO, "MemAvailable"),
            Some(23_667_764 * 1024)
        );
        assert_eq!(
            meminfo_bytes(MEMINFO, "Hugepagesize"),
            Some(2 * 1024 * 1024)
        );
        assert_eq!(meminfo_bytes(MEMINFO, "HugePages_Total"), Some(0));
        assert_eq!(meminfo_bytes(MEMINFO, "Mem"), None, "a prefix is not a key");
        assert_eq!(meminfo_bytes(MEMINFO, "Missing"), None);
        assert_eq!(meminfo_bytes("Bad: x kB", "Bad"), None);
    }

    #[test]
    fn timens_offsets_boottime() {
        let text = "monotonic           0         0\nboottime         1000       500\n";
        assert_eq!(timens_boottime_ns(text), Some(1_000_000_000_500));
        assert_eq!(
            timens_boottime_ns("boottime        -2 250000000\n"),
            Some(-1_750_000_000)
        );
        assert_eq!(timens_boottime_ns("monotonic 5 0\n"), None);
        assert_eq!(timens_boottime_ns("boottime x 0\n"), None);
    }

    const STATUS: &str = "Name:\tcat\nUmask:\t0022\nState:\tR (running)\n\
VmLck:\t       8 kB\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";

    #[test]
    fn status_vmlck_and_umask() {
        assert_eq!(status_umask(STATUS), Some(0o022));
        assert_eq!(status_umask("Umask:\t0077\n"), Some(0o077));
        assert_eq!(status_umask("Name:\tx\n"), None);
        assert_eq!(status_umask("Umask:\t9\n"), None);
        assert_eq!(meminfo_bytes(STATUS, "VmLck"), Some(8192));
        assert_eq!(meminfo_bytes(STATUS, "Name"), None, "not a number");
    }

    #[test]
    fn thp_modes() {
        assert_eq!(bracketed("always [madvise] never\n"), Some("madvise"));
        assert_eq!(
            bracketed("always within_size advise [never] deny force\n"),
            Some("never")
        );
        assert_eq!(bracketed("always madvise never\n"), None);
    }

    #[test]
    fn single_values() {
        assert_eq!(single_u64("60\n"), Some(60));
        assert_eq!(single_u64(" 67584 \n"), Some(67584));
        assert_eq!(single_u64("-1\n"), None);
        assert_eq!(single_u64(""), None);
    }

    #[test]
    fn pidfd_fdinfo_pid() {
        let text =
            "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\nPid:\t4242\nNSpid:\t4242\t7\n";
        assert_eq!(fdinfo_pid(text), Some(4242));
        assert_eq!(fdinfo_pid("Pid:\t-1\nNSpid:\t-1\n"), Some(-1));
        assert_eq!(fdinfo_pid("Pid:\t0\n"), Some(0));
        assert_eq!(fdinfo_pid("pos:\t0\n"), None);
    }

    #[test]
    fn starttime_with_awkward_command_names() {
        let plain = "1234 (cat) R 1 1234 1234 0 -1 4194304 90 0 0 0 0 0 0 0 20 0 1 0 987654 \
                     5734400 230 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(stat_starttime(plain), Some(987_654));
        let odd = "77 (a) b (c) S 1 77 77 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 42 0 0";
        assert_eq!(stat_starttime(odd), Some(42));
        assert_eq!(stat_starttime("1 (x) R 1"), None);
    }

    #[test]
    fn pressure_stall_info() {
        let text = "some avg10=0.25 avg60=1.50 avg300=0.00 total=123456\n\
                    full avg10=0.00 avg60=0.10 avg300=0.00 total=789\n";
        let psi = psi(text).expect("valid sample");
        assert_eq!(psi.some.avg10, 0.25);
        assert_eq!(psi.some.avg60, 1.5);
        assert_eq!(psi.some.total_us, 123_456);
        assert_eq!(psi.full.expect("full line").total_us, 789);
        let old = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(super::psi(old).expect("some only").full, None);
        assert_eq!(super::psi("some avg10=x\n"), None);
        assert_eq!(super::psi(""), None);
    }
}
