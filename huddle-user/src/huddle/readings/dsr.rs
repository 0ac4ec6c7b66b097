//! What DSR backends need beyond request samples, since their replies
//! bypass the balancer: the clients' round trip (the ACK clock reads it
//! with every request) and the backend agent's exact figures that
//! calibrate it. The methods that fill them are the tracker's.

use huddle_common::{Latency, LATENCY_BUCKETS};
use std::collections::VecDeque;

/// The backend agent's exact time to first byte against the ACK clock's
/// reading of the same scrape interval. The ACK clock stays the source
/// (it comes every tick, the agent once a scrape); the agent's figure
/// says by how much it reads high (the clients' round trip and delayed
/// ACKs), and that is what is taken off.
#[derive(Default)]
pub struct AgentCal {
    /// At the last scrape: the agent's cumulative samples and the
    /// kernel's cumulative ACK-clock counters (answered, summed ns).
    pub(super) last: Option<(crate::net::scrape::AgentSample, u64, u64)>,
    /// Means over the last scrape interval with samples from both.
    pub ttfb_ms: Option<f64>,
    pub ack_ms: Option<f64>,
    /// How much the ACK clock reads above the agent, smoothed.
    pub bias_ms: Option<f64>,
}

/// The clients' round trip to a DSR backend: the median of its connect
/// samples (SYN to the client's ACK of the SYN-ACK, which the backend's
/// kernel sends at once whatever its application does) over the newest
/// ticks.
#[derive(Default)]
pub struct Rtt {
    pub(super) prev: Option<Latency>,
    pub(super) ticks: VecDeque<Box<[u64; LATENCY_BUCKETS]>>,
    pub p50_ms: Option<f64>,
}
