//! Points in time as people write them, for rewinds (`warren ctl rewind --to`, the rewind API):
//! unix milliseconds, an RFC 3339 time, or a time ago.

/// Parses `text` as unix milliseconds (`1764412800000`), an RFC 3339 time with its offset
/// (`2026-11-29T10:00:00Z`, `2026-11-29T11:00:00.5+01:00`) or a time before `now_ms` (`-90m`; units
/// s, m, h, d). Returns unix ms, or an error a person can act on.
pub fn parse(text: &str, now_ms: u64) -> Result<u64, String> {
    let text = text.trim();
    let refuse = || {
        format!(
            "'{text}' is not a point in time: give unix milliseconds (1764412800000), an RFC 3339 time (2026-11-29T10:00:00Z) or a time ago (-90m, -2h, -1d)"
        )
    };
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().map_err(|_| refuse());
    }
    if let Some(ago) = text.strip_prefix('-') {
        let unit_ms: u64 = match ago.chars().last() {
            Some('s') => 1_000,
            Some('m') => 60_000,
            Some('h') => 3_600_000,
            Some('d') => 86_400_000,
            _ => return Err(refuse()),
        };
        let digits = &ago[..ago.len() - 1];
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(refuse());
        }
        let n: u64 = digits.parse().map_err(|_| refuse())?;
        return Ok(now_ms.saturating_sub(n.saturating_mul(unit_ms)));
    }
    let at = chrono::DateTime::parse_from_rfc3339(text).map_err(|_| refuse())?;
    u64::try_from(at.timestamp_millis()).map_err(|_| format!("'{text}' is before 1970"))
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn the_three_forms_and_refusals() {
        let now = 1_764_412_800_000;
        assert_eq!(parse("1764412800000", now), Ok(1_764_412_800_000));
        assert_eq!(parse("2025-11-29T10:40:00Z", now), Ok(1_764_412_800_000));
        assert_eq!(parse("2025-11-29T11:40:00.250+01:00", now), Ok(1_764_412_800_250));
        assert_eq!(parse("-90m", now), Ok(now - 5_400_000));
        assert_eq!(parse("-2h", now), Ok(now - 7_200_000));
        assert_eq!(parse("-1d", now), Ok(now - 86_400_000));
        assert_eq!(parse("-30s", now), Ok(now - 30_000));
        assert_eq!(parse("-99999999999999d", now), Ok(0), "saturates");
        for bad in ["", "-", "-m", "-5x", "-5.5m", "yesterday", "2025-11-29", "2025-11-29T10:40:00", "99999999999999999999999"] {
            let err = parse(bad, now).unwrap_err();
            assert!(err.contains("not a point in time"), "{bad}: {err}");
        }
        assert!(parse("1969-12-31T23:59:59Z", now).unwrap_err().contains("before 1970"));
    }
}
