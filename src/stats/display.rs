//! Figures as people read them: `1234`, `~2.5M` for an estimate, `≥250k` for a floor, `?` for unknown.

pub const UNKNOWN: &str = "?";

/// A count that may be a floor (counted up to a cap, no estimate beyond it): `≥250k`.
pub fn count_of(n: Option<u64>, estimated: bool, at_least: bool) -> String {
    let text = count(n, estimated);
    if at_least && n.is_some() {
        format!("≥{text}")
    } else {
        text
    }
}

pub fn count(n: Option<u64>, estimated: bool) -> String {
    let Some(n) = n else {
        return UNKNOWN.to_owned();
    };
    let text = if n >= 10_000_000 {
        format!("{:.0}M", n as f64 / 1e6)
    } else if n >= 1_000_000 {
        format!("{:.1}M", n as f64 / 1e6)
    } else if n >= 100_000 {
        format!("{:.0}k", n as f64 / 1e3)
    } else {
        n.to_string()
    };
    if estimated { format!("~{text}") } else { text }
}

pub fn rate(r: Option<f64>) -> String {
    match r {
        None => UNKNOWN.to_owned(),
        Some(r) if r >= 100.0 => format!("{r:.0}"),
        Some(r) => format!("{r:.1}"),
    }
}

pub fn percent(r: Option<f64>) -> String {
    r.map_or_else(|| UNKNOWN.to_owned(), |r| format!("{:.1}%", r * 100.0))
}

/// A rate, marked `~` when it is in part estimated.
pub fn rate_of(r: Option<f64>, estimated: bool) -> String {
    estimate(rate(r), r.is_some() && estimated)
}

/// A share, marked `~` when it is in part estimated.
pub fn percent_of(r: Option<f64>, estimated: bool) -> String {
    estimate(percent(r), r.is_some() && estimated)
}

fn estimate(text: String, estimated: bool) -> String {
    if estimated { format!("~{text}") } else { text }
}

/// `42s`, `17m`, `5h`, `3d`; empty when there is nothing unprocessed.
pub fn age(seconds: Option<f64>) -> String {
    let Some(s) = seconds else {
        return String::new();
    };
    let s = s.max(0.0);
    if s < 120.0 {
        format!("{s:.0}s")
    } else if s < 7200.0 {
        format!("{:.0}m", s / 60.0)
    } else if s < 172_800.0 {
        format!("{:.0}h", s / 3600.0)
    } else {
        format!("{:.0}d", s / 86400.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures() {
        assert_eq!(count(Some(999), false), "999");
        assert_eq!(count(Some(2_500_000), true), "~2.5M");
        assert_eq!(count(Some(12_000_000), true), "~12M");
        assert_eq!(count(None, false), "?");
        assert_eq!(count_of(Some(250_001), false, true), "≥250k");
        assert_eq!(count_of(Some(2_500_000), true, false), "~2.5M");
        assert_eq!(count_of(None, false, true), "?");
        assert_eq!(rate(Some(3.25)), "3.2");
        assert_eq!(rate(None), "?");
        assert_eq!(rate_of(Some(3.25), true), "~3.2");
        assert_eq!(rate_of(None, true), "?");
        assert_eq!(percent_of(Some(0.125), true), "~12.5%");
        assert_eq!(percent(Some(0.125)), "12.5%");
        assert_eq!(age(Some(90.0)), "90s");
        assert_eq!(age(Some(3.0 * 86400.0)), "3d");
        assert_eq!(age(None), "");
    }
}
