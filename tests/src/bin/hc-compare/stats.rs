//! Figures of one run, and mean +/- stdev over trials.

use serde::{Deserialize, Serialize};
use testbed::Outcome;

/// One trial of one cell. Failed requests count at the time they took
/// (the client's timeout at most) in the latency figures, as a user sees
/// them.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Trial {
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
    pub requests: u64,
    pub failed: u64,
    /// Share of answered requests sent after the fault started that the
    /// degraded backend answered.
    pub degraded_share: f64,
    /// Answered requests per second.
    pub throughput: f64,
    /// Requests a keep-alive client sent again on a new connection (its
    /// reused one was closed or reset before any byte of the answer),
    /// answered or not.
    pub client_retries: u64,
    /// The first failures, with when they were sent (seconds into the
    /// run) and why, so a failure count can be explained.
    pub failures: Vec<String>,
}

/// Nearest-rank quantile of sorted values (NaN when there are none).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Figures of one run. `fault_s`: when the fault started; `secs`: length.
pub fn trial(outcomes: &[Outcome], degraded: &str, fault_s: f64, secs: f64) -> Trial {
    let mut lat: Vec<f64> = outcomes
        .iter()
        .map(|o| o.latency.as_secs_f64() * 1e3)
        .collect();
    lat.sort_by(f64::total_cmp);
    let failed = outcomes.iter().filter(|o| o.result.is_err()).count() as u64;
    let after: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.at.as_secs_f64() >= fault_s && o.result.is_ok())
        .collect();
    let by_degraded = after
        .iter()
        .filter(|o| o.result.as_deref() == Ok(degraded))
        .count();
    Trial {
        p50_ms: quantile(&lat, 0.50),
        p95_ms: quantile(&lat, 0.95),
        p99_ms: quantile(&lat, 0.99),
        p999_ms: quantile(&lat, 0.999),
        max_ms: lat.last().copied().unwrap_or(f64::NAN),
        mean_ms: lat.iter().sum::<f64>() / lat.len().max(1) as f64,
        requests: outcomes.len() as u64,
        failed,
        degraded_share: by_degraded as f64 / after.len().max(1) as f64,
        throughput: (outcomes.len() as u64 - failed) as f64 / secs,
        client_retries: outcomes.iter().filter(|o| o.retried).count() as u64,
        failures: outcomes
            .iter()
            .filter_map(|o| {
                o.result
                    .as_ref()
                    .err()
                    .map(|e| format!("{:.3} s: {e}", o.at.as_secs_f64()))
            })
            .take(20)
            .collect(),
    }
}

/// Mean and sample standard deviation.
pub fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let m = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (m, var.sqrt())
}

/// `mean +/- sd` with a sensible number of digits.
pub fn fmt(v: &[f64], digits: usize) -> String {
    let (m, s) = mean_sd(v);
    if v.len() > 1 {
        format!("{m:.digits$} ± {s:.digits$}")
    } else {
        format!("{m:.digits$}")
    }
}

/// p50 and p99 latency per window of `w` seconds, by send time.
pub fn series(outcomes: &[Outcome], w: f64, secs: f64) -> Vec<(f64, f64, f64)> {
    let n = (secs / w).ceil() as usize;
    let mut out = Vec::new();
    for k in 0..n {
        let (a, b) = (k as f64 * w, (k + 1) as f64 * w);
        let mut lat: Vec<f64> = outcomes
            .iter()
            .filter(|o| (a..b).contains(&o.at.as_secs_f64()))
            .map(|o| o.latency.as_secs_f64() * 1e3)
            .collect();
        if lat.is_empty() {
            continue;
        }
        lat.sort_by(f64::total_cmp);
        out.push((a + w / 2.0, quantile(&lat, 0.5), quantile(&lat, 0.99)));
    }
    out
}
