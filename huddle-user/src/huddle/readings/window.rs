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
    /// `None`: no sample (an idle backend's tick allocates nothing).
    hist: Option<Box<[u64; LATENCY_BUCKETS]>>,
    /// The part of `hist` from the backend's heavy source (`None`: no
    /// sample of it), and how many samples each part holds.
    heavy: Option<Box<[u64; LATENCY_BUCKETS]>>,
    heavy_count: u64,
    rest_count: u64,
}

impl TickSamples {
    /// `count` samples summing `sum_ns`, by bucket `hist`, of which
    /// `heavy` (never more than `hist` in any bucket) are the heavy
    /// source's.
    pub(super) fn new(
        count: u64,
        sum_ns: u64,
        hist: &[u64; LATENCY_BUCKETS],
        heavy: Option<[u64; LATENCY_BUCKETS]>,
    ) -> TickSamples {
        let total: u64 = hist.iter().sum();
        let heavy_count = heavy.as_ref().map_or(0, |h| h.iter().sum());
        TickSamples {
            count,
            sum_ns,
            hist: (count != 0 || total != 0).then(|| Box::new(*hist)),
            heavy: heavy.filter(|_| heavy_count > 0).map(Box::new),
            heavy_count,
            rest_count: total - heavy_count,
        }
    }

    /// A tick without samples.
    pub(super) fn empty() -> TickSamples {
        TickSamples {
            count: 0,
            sum_ns: 0,
            hist: None,
            heavy: None,
            heavy_count: 0,
            rest_count: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.hist.is_none() && self.count == 0
    }
}

/// A backend's newest ticks of samples (at most `WINDOW_TICKS`) and their
/// window, worked out again only when a tick with samples comes or goes:
/// at 256 services x 16 backends the window of every idle backend, worked
/// out every tick (two 1 KiB copies and ten passes over 128 buckets), was
/// the tick's largest cost.
#[derive(Clone, Default)]
pub(super) struct Ticks {
    pub(super) ticks: VecDeque<TickSamples>,
    /// The window, and the `min_samples` it was worked out for.
    window: Option<(u64, Window)>,
}

impl Ticks {
    /// Whether no tick in the window holds a sample.
    pub(super) fn is_empty(&self) -> bool {
        self.ticks.iter().all(TickSamples::is_empty)
    }

    /// Adds `tick` as the newest; the window over the newest ticks
    /// holding `min_samples`.
    pub(super) fn push(&mut self, tick: TickSamples, min_samples: u64) -> Window {
        let came = !tick.is_empty();
        self.ticks.push_front(tick);
        let went =
            self.ticks.len() > WINDOW_TICKS && self.ticks.back().is_some_and(|t| !t.is_empty());
        self.ticks.truncate(WINDOW_TICKS);
        match self.window {
            Some((min, w)) if min == min_samples && !came && !went => w,
            _ => {
                let w = window(&self.ticks, min_samples);
                self.window = Some((min_samples, w));
                w
            }
        }
    }
}

/// Latency over the newest ticks that hold enough samples.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    pub samples: u64,
    /// Of `samples`' histogram, those of the backend's heavy source.
    pub heavy_samples: u64,
    pub mean_ms: Option<f64>,
    pub p50_ms: Option<f64>,
    /// The ring's spread is read from it (`readings::shared_spread`).
    pub p75_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// Mean and percentiles over the newest ticks holding `min_samples`.
///
/// The median is the lower of the heavy source's and everyone else's when
/// each has at least half of `min_samples` in the newest ticks (each over
/// its own, as few as hold them): a backend is slow when both its
/// heaviest client (or /24) and the rest find it slow, so one client
/// aiming slow-looking turns at it is outvoted, and a backend with a
/// single client is judged on that client's samples alone.
pub(super) fn window(ticks: &VecDeque<TickSamples>, min_samples: u64) -> Window {
    let mut count = 0;
    let mut sum = 0u64;
    let mut hist = [0u64; LATENCY_BUCKETS];
    let mut heavy_samples = 0;
    for t in ticks {
        count += t.count;
        sum = sum.wrapping_add(t.sum_ns);
        for (h, v) in hist.iter_mut().zip(t.hist.iter().flat_map(|b| b.iter())) {
            *h += v;
        }
        heavy_samples += t.heavy_count;
        if count >= min_samples {
            break;
        }
    }
    if count == 0 {
        return Window::default();
    }
    let total: u64 = hist.iter().sum();
    let split = (min_samples / 2).max(1);
    // Both parts must hold `split` samples somewhere in the window: with
    // one client (every sample heavy) or none heavy, no part is walked.
    let enough = |part: fn(&TickSamples) -> u64| ticks.iter().map(part).sum::<u64>() >= split;
    let split_p50 = if enough(|t| t.heavy_count) && enough(|t| t.rest_count) {
        median_of(ticks, true, split).zip(median_of(ticks, false, split))
    } else {
        None
    };
    let p50_ms = match split_p50 {
        Some((a, b)) => Some(a.min(b)),
        None => percentile(&hist, total, 0.50),
    };
    Window {
        samples: count,
        heavy_samples,
        mean_ms: Some(sum as f64 / count as f64 / 1e6),
        p50_ms,
        p75_ms: percentile(&hist, total, 0.75),
        p99_ms: percentile(&hist, total, 0.99),
    }
}

/// The median of the heavy source's samples (`heavy`) or of everyone
/// else's, over the newest ticks holding `least` of them; `None` if the
/// whole window holds fewer.
fn median_of(ticks: &VecDeque<TickSamples>, heavy: bool, least: u64) -> Option<f64> {
    let mut hist = [0u64; LATENCY_BUCKETS];
    let mut n = 0;
    let none = [0u64; LATENCY_BUCKETS];
    for t in ticks {
        let part = t.heavy.as_deref().unwrap_or(&none);
        let all = t.hist.as_deref().unwrap_or(&none);
        for (h, (all, of_heavy)) in hist.iter_mut().zip(all.iter().zip(part.iter())) {
            *h += if heavy { *of_heavy } else { all - of_heavy };
        }
        n += if heavy { t.heavy_count } else { t.rest_count };
        if n >= least {
            return percentile(&hist, n, 0.50);
        }
    }
    None
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept window is the one worked out afresh: as samples come, stay
    /// through empty ticks, and go once their tick is the eleventh.
    #[test]
    fn the_kept_window_follows_samples_in_and_out() {
        let mut hist = [0u64; LATENCY_BUCKETS];
        hist[40] = 5;
        let empty = [0u64; LATENCY_BUCKETS];
        let mut t = Ticks::default();
        assert_eq!(
            t.push(TickSamples::new(0, 0, &empty, None), 3),
            Window::default()
        );
        let w = t.push(TickSamples::new(5, 50, &hist, None), 3);
        assert_eq!(w.samples, 5);
        for i in 1..WINDOW_TICKS {
            let kept = t.push(TickSamples::new(0, 0, &empty, None), 3);
            assert_eq!(kept, window(&t.ticks, 3), "tick {i}");
            assert_eq!(kept.samples, 5, "tick {i}");
        }
        let gone = t.push(TickSamples::new(0, 0, &empty, None), 3);
        assert_eq!(gone, Window::default());
        assert_eq!(gone, window(&t.ticks, 3));
        // Another `min_samples` is worked out afresh.
        t.push(TickSamples::new(5, 50, &hist, None), 3);
        assert_eq!(
            t.push(TickSamples::new(0, 0, &empty, None), 10),
            window(&t.ticks, 10)
        );
    }
}
