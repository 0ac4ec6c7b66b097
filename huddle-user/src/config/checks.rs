//! The small checks every table's numbers go through: a duration in
//! milliseconds and a fraction, each within bounds, errors naming the field.

use anyhow::{bail, Result};
use std::time::Duration;

/// `v` ms (`default` when unset), within `min..=max`.
pub(super) fn millis(
    v: Option<u64>,
    default: u64,
    field: &str,
    min: u64,
    max: u64,
) -> Result<Duration> {
    let v = v.unwrap_or(default);
    if !(min..=max).contains(&v) {
        bail!("{field}: {v} is outside {min}..={max}");
    }
    Ok(Duration::from_millis(v))
}

/// `v` (`default` when unset) within [0, 1], or (0, 1] if `lo_open`.
pub(super) fn fraction(v: Option<f64>, default: f64, field: &str, lo_open: bool) -> Result<f64> {
    let v = v.unwrap_or(default);
    let ok = v.is_finite() && v <= 1.0 && if lo_open { v > 0.0 } else { v >= 0.0 };
    if !ok {
        let lo = if lo_open { "(0" } else { "[0" };
        bail!("{field}: {v} must be in {lo}, 1]");
    }
    Ok(v)
}
