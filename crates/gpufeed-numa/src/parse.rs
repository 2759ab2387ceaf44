//! Parsers of the /sys text that topology detection reads.

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// Parses a kernel cpu/node list such as `0-3,8-11,16` into sorted ids.
pub fn parse_list(text: &str) -> Option<Vec<u32>> {
    let text = text.trim();
    let mut ids = Vec::new();
    if text.is_empty() {
        return Some(ids);
    }
    for part in text.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b || b - a > 1 << 20 {
                    return None;
                }
                ids.extend(a..=b);
            }
            None => ids.push(part.trim().parse().ok()?),
        }
    }
    ids.sort_unstable();
    ids.dedup();
    Some(ids)
}

/// Formats sorted ids as a kernel list: `[0,1,2,3,8]` -> `0-3,8`.
pub fn format_list(ids: &[u32]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < ids.len() {
        let start = ids[i];
        let mut end = start;
        while i + 1 < ids.len() && ids[i + 1] == end + 1 {
            i += 1;
            end = ids[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if start == end {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

/// `Node 0 MemTotal:       24684092 kB` -> bytes.
pub fn node_mem_total(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.split_once("MemTotal:")?.1;
        let mut words = rest.split_whitespace();
        let kb: u64 = words.next()?.parse().ok()?;
        (words.next() == Some("kB")).then(|| kb * 1024)
    })
}

/// A hexadecimal sysfs attribute such as `0x030200`.
pub fn hex_u32(text: &str) -> Option<u32> {
    u32::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

/// The address of a PCI function: domain, bus, device, function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number (0-31).
    pub device: u8,
    /// Function number (0-7).
    pub function: u8,
}

impl FromStr for PciAddress {
    type Err = Error;

    /// Accepts `0000:3b:00.0` (sysfs, lspci -D), `00000000:3B:00.0` (nvidia-smi),
    /// `0000:3B:00.0` (CUDA) and `3b:00.0` (lspci, domain 0), in any letter case.
    fn from_str(text: &str) -> Result<Self, Error> {
        let invalid = || Error::InvalidBusId {
            bus_id: text.to_owned(),
        };
        let t = text.trim();
        let parts: Vec<&str> = t.split(':').collect();
        let (domain, bus, rest) = match parts[..] {
            [d, b, r] => (d, b, r),
            [b, r] => ("0", b, r),
            _ => return Err(invalid()),
        };
        let (device, function) = rest.split_once('.').ok_or_else(invalid)?;
        let hex = |s: &str, max_digits: usize| {
            (!s.is_empty() && s.len() <= max_digits)
                .then(|| u32::from_str_radix(s, 16).ok())
                .flatten()
        };
        let addr = PciAddress {
            domain: hex(domain, 8).ok_or_else(invalid)?,
            bus: hex(bus, 2).ok_or_else(invalid)? as u8,
            device: hex(device, 2).filter(|&d| d < 32).ok_or_else(invalid)? as u8,
            function: hex(function, 1).filter(|&f| f < 8).ok_or_else(invalid)? as u8,
        };
        Ok(addr)
    }
}

impl fmt::Display for PciAddress {
    /// The sysfs form, `0000:3b:00.0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists() {
        assert_eq!(
            parse_list("0-3,8-11,16\n"),
            Some(vec![0, 1, 2, 3, 8, 9, 10, 11, 16])
        );
        assert_eq!(parse_list("0\n"), Some(vec![0]));
        assert_eq!(parse_list("\n"), Some(vec![]));
        assert_eq!(parse_list("3-1"), None);
        assert_eq!(parse_list("a-b"), None);
        assert_eq!(format_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_list(&[]), "");
    }

    #[test]
    fn node_meminfo() {
        let text = "Node 0 MemTotal:        7563476 kB\nNode 0 MemFree:         5306980 kB\n";
        assert_eq!(node_mem_total(text), Some(7_563_476 * 1024));
        assert_eq!(node_mem_total("Node 0 MemFree: 1 kB\n"), None);
    }

    #[test]
    fn hex_attributes() {
        assert_eq!(hex_u32("0x030200\n"), Some(0x030200));
        assert_eq!(hex_u32("0x10de"), Some(0x10de));
        assert_eq!(hex_u32("zz"), None);
    }

    #[test]
    fn bus_ids_in_every_common_form() {
        let want = PciAddress {
            domain: 0,
            bus: 0x3b,
            device: 0,
            function: 0,
        };
        for form in [
            "0000:3b:00.0",
            "00000000:3B:00.0",
            "0000:3B:00.0",
            "3b:00.0",
            " 3B:00.0\n",
        ] {
            assert_eq!(form.parse::<PciAddress>().expect(form), want, "{form}");
        }
        assert_eq!(want.to_string(), "0000:3b:00.0");
        let wide: PciAddress = "10000:01:1f.7".parse().expect("5-digit domain");
        assert_eq!(
            (wide.domain, wide.device, wide.function),
            (0x10000, 0x1f, 7)
        );
        for bad in [
            "",
            "3b",
            "0000:3b:00",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "0000:3bb:00.0",
            "x:3b:00.0",
            "1:2:3:4.0",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad:?} accepted");
        }
    }
}
