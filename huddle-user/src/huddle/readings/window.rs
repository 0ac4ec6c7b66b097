//! A backend's request latency over its newest ticks: each tick's new
//! samples (the change in the kernel's histogram), and the mean and
//! percentiles over the newest ticks that hold enough of them.

use huddle_common::{latency::bucket_bounds, LATENCY_BUCKETS};
use std::collections::VecDeque;

/// Ticks of request samples a backend's latency may draw on.
pub(super) const WINDOW_TICKS: usize = 10;

/// One tick's new request samples of a backend.
#[derive(Clone)]
pub(super) struct TickSamples {
    pub(super) count: u64,
    pub(super) sum_ns: u64,
    pub(super) hist: Box<[u64; LATENCY_BUCKETS]>,
}

/// Latency over the newest ticks that hold enough samples.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    pub samples: u64,
    pub mean_ms: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// Mean and percentiles over the newest ticks holding `min_samples`.
pub(super) fn window(ticks: &VecDeque<TickSamples>, min_samples: u64) -> Window {
    let mut count = 0;
    let mut sum = 0u64;
    let mut hist = [0u64; LATENCY_BUCKETS];
    for t in ticks {
        count += t.count;
        sum = sum.wrapping_add(t.sum_ns);
        for (h, v) in hist.iter_mut().zip(t.hist.iter()) {
            *h += v;
        }
        if count >= min_samples {
            break;
        }
    }
    if count == 0 {
        return Window::default();
    }
    let total: u64 = hist.iter().sum();
    Window {
        samples: count,
        mean_ms: Some(sum as f64 / count as f64 / 1e6),
        p50_ms: percentile(&hist, total, 0.50),
        p99_ms: percentile(&hist, total, 0.99),
    }
}

/// The `q` quantile of a histogram, interpolated within its bucket, in ms.
pub(super) fn percentile(hist: &[u64; LATENCY_BUCKETS], total: u64, q: f64) -> Option<f64> {
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut below = 0.0;
    for (b, n) in hist.iter().enumerate() {
        let n = *n as f64;
        if n > 0.0 && below + n >= rank {
            let (lo, hi) = bucket_bounds(b);
            let frac = ((rank - below) / n).clamp(0.0, 1.0);
            return Some((lo as f64 + frac * (hi - lo) as f64) / 1e6);
        }
        below += n;
    }
    None
}
