//! Connect time as a backend's latency, for services whose turns say
//! nothing (`latency = "connect"`: opaque streaming protocols): the
//! kernel's SYN-to-SYN-ACK histogram (`CONNECT`), windowed as request
//! samples are. A backend's kernel answers SYNs whatever its application
//! does, so this shows an overloaded accept queue or a host slow to
//! schedule, not a slow handler.

use super::window::{TickSamples, Ticks, Window};
use huddle_common::{BackendStats, Latency, LATENCY_BUCKETS};

/// A backend's connect samples over its newest ticks.
#[derive(Default)]
pub struct ConnectWindow {
    prev: Option<(u64, u64, Latency)>,
    ticks: Ticks,
    pub window: Window,
}

impl ConnectWindow {
    /// Takes this tick's connect figures (the kernel's cumulative count,
    /// sum and histogram of SYN-ACK times) into the window.
    pub fn observe(&mut self, stats: &BackendStats, hist: &Latency, min_samples: u64) {
        let cw = self;
        let now = (stats.syn_acks, stats.connect_ns, *hist);
        let (count, sum, before) = cw.prev.replace(now).unwrap_or(now);
        let d: [u64; LATENCY_BUCKETS] =
            std::array::from_fn(|i| hist.buckets[i].wrapping_sub(before.buckets[i]));
        // Connect samples are not split by source.
        let tick = TickSamples::new(
            stats.syn_acks.wrapping_sub(count),
            stats.connect_ns.wrapping_sub(sum),
            &d,
            None,
        );
        cw.window = cw.ticks.push(tick, min_samples);
    }
}
