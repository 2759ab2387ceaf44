//! Byte sizes as people write them: `1GiB`, `512MiB`, `64M`, `4096`.

/// A size that [`parse_size`] cannot read: the text and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?}: {why}; write a size like 4096, 64MiB, 1.5GiB or 2TiB")]
pub struct BadSize {
    /// The text given.
    pub text: String,
    /// What is wrong with it.
    pub why: &'static str,
}

/// Parses `1GiB`, `1.5GiB`, `512MiB`, `64M`, `4k`, `1000` (binary units: `k` is 1024) into
/// bytes; a fraction is rounded to the nearest byte.
///
/// # Example
/// ```
/// assert_eq!(gpufeed_os::units::parse_size("512MiB")?, 512 << 20);
/// assert_eq!(gpufeed_os::units::parse_size("1.5GiB")?, 3 << 29);
/// assert_eq!(gpufeed_os::units::parse_size("5 parsecs").unwrap_err().why, "unknown unit");
/// # Ok::<(), gpufeed_os::units::BadSize>(())
/// ```
pub fn parse_size(text: &str) -> Result<u64, BadSize> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = |why: &'static str| BadSize {
        text: text.to_owned(),
        why,
    };
    let (whole, fraction) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && fraction.is_empty() {
        return Err(bad("expected a number"));
    }
    if fraction.contains('.') || fraction.len() > 9 {
        return Err(bad("expected a number with at most 9 decimals"));
    }
    let digits = |s: &str| -> Result<u128, BadSize> {
        if s.is_empty() {
            Ok(0)
        } else {
            s.parse().map_err(|_| bad("expected a number"))
        }
    };
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        "p" | "pb" | "pib" => 1 << 50,
        _ => return Err(bad("unknown unit")),
    };
    if mult == 1 && !fraction.trim_end_matches('0').is_empty() {
        return Err(bad("a byte count is a whole number"));
    }
    let scale = 10u128.pow(fraction.len() as u32);
    // whole * mult + fraction * mult / scale, rounded; u128 holds every u64 size times 10^9.
    let part = (digits(fraction)? * mult + scale / 2) / scale;
    let bytes = digits(whole)?
        .checked_mul(mult)
        .and_then(|w| w.checked_add(part))
        .ok_or_else(|| bad("too large"))?;
    u64::try_from(bytes).map_err(|_| bad("too large"))
}

/// `1073741824` -> `1 GiB`, `1572864` -> `1.5 MiB`.
pub fn show_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 6] = [
        ("EiB", 1 << 60),
        ("PiB", 1 << 50),
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
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size(".5k").unwrap(), 512);
        assert_eq!(parse_size("0.1KiB").unwrap(), 102);
        assert!(parse_size("1.2.3G").is_err());
        assert!(parse_size(".G").is_err());
        assert!(parse_size("1.5").is_err(), "a fraction of a byte");
        assert!(parse_size("10 parsecs").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert!(parse_size("16384P").is_err());
        assert_eq!(parse_size("18446744073709551615").unwrap(), u64::MAX);
        assert_eq!(show_size(1 << 30), "1 GiB");
        assert_eq!(show_size(3 << 19), "1.5 MiB");
        assert_eq!(show_size(100), "100 B");
        assert_eq!(show_size(u64::MAX), "16.0 EiB");
    }
}
