//! Byte sizes as people write them: `1GiB`, `512MiB`, `64M`, `4096`.

use crate::error::{Error, Result};

/// Parses `1GiB`, `512MiB`, `64M`, `4k`, `1000` (binary units) into bytes.
///
/// # Example
/// ```
/// assert_eq!(gpufeed::units::parse_size("512MiB")?, 512 << 20);
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = |why: &str| {
        Error::InvalidSetting(format!(
            "{text:?}: {why}; write a size like 4096, 64MiB or 1GiB"
        ))
    };
    let num: u64 = num.parse().map_err(|_| bad("expected a whole number"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(bad("unknown unit")),
    };
    num.checked_mul(mult).ok_or_else(|| bad("too large"))
}

/// `1073741824` -> `1 GiB`, `1572864` -> `1.5 MiB`.
pub fn show_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, unit) in UNITS {
        if bytes >= unit {
            return if bytes.is_multiple_of(unit) {
                format!("{} {name}", bytes / unit)
            } else {
                format!("{:.1} {name}", bytes as f64 / unit as f64)
            };
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("64m").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("1.5G").is_err());
        assert!(parse_size("10 parsecs").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(show_size(1 << 30), "1 GiB");
        assert_eq!(show_size(3 << 19), "1.5 MiB");
        assert_eq!(show_size(100), "100 B");
    }
}
