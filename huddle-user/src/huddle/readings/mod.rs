//! The huddle of one balancer: per backend, turn the kernel's counters,
//! probes and host metrics into one reading per tick; per service, turn
//! readings into temperatures and the rotation engine's moves.
//!
//! Latency is compared like with like: a backend with enough request
//! samples in its window is judged on request latency against the median
//! request latency of the inner ring; any other backend (resting, idle) on
//! its probe latency against the inner ring's median probe latency.

use crate::{
    config::{Huddle as Settings, Proto, Service},
    huddle::probing::Need,
    huddle::rotation::{Engine, Move, Place, Reason},
    huddle::thermal,
};
use std::time::Duration;
pub use window::Window;

mod connect;
mod dsr;
pub mod suspicion;
mod tracker;
mod window;
pub use dsr::{AgentCal, Rtt};
pub use tracker::Tracker;

/// The least time an answer may be owed before new flows pass the backend
/// over: below it a late answer is scheduling noise, not a stuck server.
const PASS_OVER_MIN: Duration = Duration::from_millis(10);

/// What share of the ring's own p99 a backend's median must pass before
/// it counts as slower than the ring. Measured (7 December 2026, four
/// equal NGINX backends behind wrk -c64 `Connection: close` at full speed,
/// rotation off, 12 one-second windows): each backend's median time to
/// first byte swung between 0.3 and 5.8 ms from window to window, the
/// slowest up to 2.5x the ring's median, so against the median alone two
/// healthy backends crossed `heat` and rested within 20 s; the slowest
/// was never more than 0.56x the ring's median p99. A backend slow alone
/// (5x a calm ring, whose p99 lies near its median) is judged as before.
pub const SHARED_SPREAD: f64 = 0.5;

/// The reference a backend's median request latency (or judged probe
/// latency) is judged against: the ring's median, or `SHARED_SPREAD` of
/// the ring's p99 (of its slowest recent probe) where that is more, but
/// never above `cap`, the ring's median p75 (requests; `None` for probes).
/// When the whole ring is slow together (the load, the host, the
/// network), its tail widens with it, and a backend within that spread is
/// no outlier: resting it would only move its share onto peers no less
/// busy. The cap is for a tail that is no slowness at all: an endpoint
/// every backend has that takes 200 ms, at 5% of requests, put half of
/// the ring's windows' p99 at 200 ms (a window holds as few as 10
/// samples), and a backend 5x slow (25.6 ms against 4.9) was judged
/// against 51 ms and stayed (CI, 7 December 2026). A 5% tail reaches a
/// p75 of 10 samples in about 1% of windows, and the median of the ring's
/// in far fewer.
#[must_use]
pub fn shared_spread(
    median_ms: Option<f64>,
    p99_ms: Option<f64>,
    cap_ms: Option<f64>,
) -> Option<f64> {
    match (median_ms, p99_ms) {
        (Some(m), Some(p)) if p.is_finite() => {
            let spread = p * SHARED_SPREAD;
            Some(m.max(cap_ms.map_or(spread, |c| spread.min(c))))
        }
        (m, _) => m,
    }
}

/// The huddle of one service.
pub struct ServiceHuddle {
    pub engine: Engine,
    pub trackers: Vec<Tracker>,
    pub rotation: bool,
    /// Median over the inner ring of each backend's p99 time to first byte
    /// (backends with enough samples), as of the last tick.
    pub answer_p99_ms: Option<f64>,
    /// Median over the inner ring of each backend's median time to first
    /// byte (the request latencies' reference), as of the last tick.
    pub ring_p50_ms: Option<f64>,
    /// Median over the inner ring of each backend's judged probe latency
    /// (`Tracker::probe_ms`), as of the last tick.
    pub probe_p50_ms: Option<f64>,
    /// Its last tick left it `at_rest`: later ticks may pass it by until
    /// one of its backends `wakes` (see `Balancer::tick`).
    pub settled: bool,
    /// While `settled`: each backend's `needs_probes` as its last tick left
    /// it (the prober asks for all 65,536 every round; reading them from
    /// their trackers was a fourteenth of an idle daemon at that size).
    pub rest_needs: Vec<Need>,
    /// Settled with no backend holding a flow: its service counters' sum
    /// (`Dataplane::service_marks`) read just before the backend counters
    /// it settled on. Any traffic to it now starts with a new flow, which
    /// moves that sum; until then its backends' counters are not read.
    pub quiet_mark: Option<u64>,
    /// Changed outside the tick (a drain, restored state, a probe or host
    /// reading: `Balancer::stir`): not settled.
    pub dirty: bool,
}

impl ServiceHuddle {
    #[must_use]
    pub fn new(service: &Service, ids: &[u32], s: &Settings, now: Duration) -> ServiceHuddle {
        let weights: Vec<f64> = service.options.iter().map(|o| o.weight).collect();
        let latency = service.latency;
        let mut params = s.rotation_params;
        if !s.rotation {
            params.warmup = Duration::ZERO;
        }
        ServiceHuddle {
            engine: Engine::new(params, &weights, now),
            trackers: ids
                .iter()
                .zip(&service.options)
                .map(|(id, o)| {
                    let mut t = Tracker::new(
                        *id,
                        o.clone(),
                        service.proto == Proto::Udp,
                        service.probe.clone(),
                    );
                    t.latency = latency;
                    t
                })
                .collect(),
            rotation: s.rotation,
            answer_p99_ms: None,
            ring_p50_ms: None,
            probe_p50_ms: None,
            settled: false,
            rest_needs: Vec::new(),
            quiet_mark: None,
            dirty: true,
        }
    }

    /// Whether backend `bi`'s probe answer of `latency_ms` deserves a
    /// second probe at once: it is in the inner ring, judged on its probes
    /// (too little traffic for its requests), and the answer is slow
    /// enough against the ring's probe median to make it hot if the next
    /// agrees. The median of its last three probes is what counts, so one
    /// slow answer never rests it; without this the second came a probe
    /// round later, with the round's results handed over at its end.
    #[must_use]
    pub fn wants_confirming(&self, bi: usize, latency_ms: f64, s: &Settings) -> bool {
        let (Some(t), Some(m), Some(median)) = (
            self.trackers.get(bi),
            self.engine.members.get(bi),
            self.probe_p50_ms,
        ) else {
            return false;
        };
        m.place == Place::Inner
            && t.latency_source == tracker::FROM_PROBES
            && s.thermal.weights.latency * thermal::anomaly(latency_ms, median, &s.thermal)
                >= s.rotation_params.heat
    }

    /// How long a backend may owe answers before it is hung: a multiple
    /// (`hung_after_p99`) of the ring's own p99 time to first byte, within
    /// `hung_after_min` and `hung_after`; `hung_after` while the ring has
    /// no such figure. A ring answering in 10 ms thus calls a backend hung
    /// after 55 ms of silence, not 200, and one answering in 80 ms still
    /// gets the full 200.
    #[must_use]
    pub fn hung_after(&self, s: &Settings) -> Duration {
        match self.answer_p99_ms {
            Some(p99) => Duration::from_secs_f64(p99 * s.hung_after_p99 / 1e3)
                .clamp(s.hung_after_min, s.hung_after),
            None => s.hung_after,
        }
    }

    /// `hung_after` as judged at `now`: the configured bound while the
    /// rings hold (`Engine::hold_until`). A hung backend leaves even then,
    /// and connections moving between balancers break if it leaves; a
    /// backend turned 5x slow (50 ms on a ring answering in 10) owes its
    /// answers for 50 ms at the turn, which the 55 ms of a fast ring can
    /// call hung: in CI it left 64 ms after slowing, 0.4 s into a hold,
    /// and 59 of 385 moved connections were reset. Held, it waits 200 ms,
    /// is answered, and leaves hot once the hold is over.
    #[must_use]
    pub fn hung_after_at(&self, s: &Settings, now: Duration) -> Duration {
        if now < self.engine.hold_until {
            s.hung_after
        } else {
            self.hung_after(s)
        }
    }

    /// What the kernel needs to prefer, of two ring entries, the backend
    /// owing an answer for less time, and to pass over one that owes too
    /// long (see `huddle_common::Tuning`): an answer owed for twice the ring's p99
    /// (at least `PASS_OVER_MIN`, at most `hung_after`), a SYN-ACK owed as
    /// long (at least 20 ms, at most `syn_timeout`). Zero (never) for UDP,
    /// whose backends need not answer, and with `pass_over_owing` off.
    #[must_use]
    pub fn tuning(&self, s: &Settings, udp: bool) -> huddle_common::Tuning {
        if udp || !s.pass_over_owing {
            return huddle_common::Tuning::default();
        }
        let hung = self.hung_after(s);
        let turn = self
            .answer_p99_ms
            .map_or(hung, |p99| Duration::from_secs_f64(2.0 * p99 / 1e3))
            .clamp(PASS_OVER_MIN.min(hung), hung);
        let syn = turn.max(Duration::from_millis(20)).min(s.syn_timeout);
        // Requests owe nothing under `latency = "connect"` or `"off"`.
        let turns = self.trackers.first().is_none_or(|t| t.latency.turns());
        huddle_common::Tuning {
            turn_skip_ns: if turns { turn.as_nanos() as u64 } else { 0 },
            syn_skip_ns: syn.as_nanos() as u64,
            two_choices: u32::from(s.two_choices),
            // The data plane's to set (`Dataplane::set_tuning`).
            ..Default::default()
        }
    }

    /// Temperatures from this tick's observations, then (with rotation on)
    /// the engine's moves.
    pub fn step(&mut self, s: &Settings, now: Duration) -> Vec<Move> {
        for t in &mut self.trackers {
            t.judge();
        }
        let inner = self.engine.inner();
        let use_requests: Vec<bool> = self
            .trackers
            .iter()
            .enumerate()
            .map(|(i, t)| {
                self.engine.members[i].place == Place::Inner
                    && t.judged_window()
                        .is_some_and(|w| w.samples >= s.min_samples)
            })
            .collect();
        // Medians, not means: a handful of long turns (long polls, a slow
        // endpoint every backend has) move a mean of a few samples, not a
        // median. Measured: with means, 10 requests a second to a 200 ms
        // endpoint beside 200 ordinary ones rotated 3 healthy backends out
        // in 15 s; with medians none. A p90 term (as far above the ring's
        // p90) read from 20 samples rotated all four (3 of 20 samples of
        // a 5% tail is common), so the tail is left to `hung` and errors.
        let req_median = thermal::median(
            inner
                .iter()
                .filter(|i| use_requests[**i])
                .filter_map(|i| self.trackers[*i].judged_window()?.p50_ms),
        );
        self.ring_p50_ms = req_median;
        let probe_median = thermal::median(
            inner
                .iter()
                .filter_map(|i| self.trackers[*i].probe_ms(true)),
        );
        self.probe_p50_ms = probe_median;
        // Probes too: a host busy with another service's traffic slows
        // every backend's connects now and then (measured: 3.3 and 4.1 ms
        // against the ring's 0.1 ms while wrk kept the other service at
        // 18,000 requests a second: two idle backends rested).
        let probe_reference = shared_spread(
            probe_median,
            thermal::median(
                inner
                    .iter()
                    .filter_map(|i| self.trackers[*i].probe_spread_ms()),
            ),
            None,
        );
        self.answer_p99_ms = thermal::median(
            inner
                .iter()
                .filter(|i| use_requests[**i])
                .filter_map(|i| self.trackers[*i].window.p99_ms),
        );
        let ring_p75 = thermal::median(
            inner
                .iter()
                .filter(|i| use_requests[**i])
                .filter_map(|i| self.trackers[*i].window.p75_ms),
        );
        let req_reference = shared_spread(req_median, self.answer_p99_ms, ring_p75);
        for (i, t) in self.trackers.iter_mut().enumerate() {
            let inner = self.engine.members[i].place == Place::Inner;
            // Rested for its requests, a backend keeps its temperature
            // until a probe taken since says otherwise: judged on a probe
            // from before (one a second while it carried traffic), a
            // backend 5x slow cooled within the tick it left.
            let unseen = !inner
                && !use_requests[i]
                && t.probe.is_some()
                && t.probes_seen == t.probes_at_move;
            if !unseen {
                let median = if use_requests[i] {
                    req_reference
                } else {
                    probe_reference
                };
                t.judge_temperature(use_requests[i], inner, median, s);
            }
            let m = &mut self.engine.members[i];
            m.temperature = t.temperature;
            m.unhealthy.clone_from(&t.unhealthy);
        }
        if !self.rotation {
            return Vec::new();
        }
        let moves = self.engine.tick(now);
        for m in &moves {
            let t = &mut self.trackers[m.member];
            t.probes_at_move = t.probes_seen;
        }
        moves
    }

    /// Whether a tick at `now` would change nothing (`Engine::at_rest`,
    /// `Tracker::at_rest`).
    #[must_use]
    pub fn at_rest(&self, now: Duration) -> bool {
        !self.dirty && self.engine.at_rest(now) && self.trackers.iter().all(Tracker::at_rest)
    }

    /// The inner ring as backend ids, in configured order.
    #[must_use]
    pub fn ring(&self) -> Vec<u32> {
        self.engine
            .inner()
            .into_iter()
            .map(|i| self.trackers[i].id)
            .collect()
    }

    /// How much a probe of each backend would tell (`probing::Need`): a
    /// healthy inner one whose own traffic fills its window, with nothing
    /// suspect about it, least; one with traffic too thin for its window
    /// before one with none. A backend is idle only in a service with no
    /// traffic at all: spread over 256 backends, 100 new connections a
    /// second left most of them without a sample at any one time, so a 5x
    /// slow one waited among 65,536 idle backends' probes and left its ring
    /// in 2.5-2.9 s (hc-scale 256 x 256).
    #[must_use]
    pub fn needs_probes(&self, s: &Settings) -> std::borrow::Cow<'_, [Need]> {
        if self.settled && !self.dirty && self.rest_needs.len() == self.trackers.len() {
            return std::borrow::Cow::Borrowed(&self.rest_needs);
        }
        std::borrow::Cow::Owned(self.needs_now(s))
    }

    /// Settles or unsettles the service after its tick, keeping what a
    /// probe of each backend would tell while it stays settled, and
    /// `mark` (its service counters' sum read this tick) if no backend
    /// holds a flow.
    pub fn settle(&mut self, settled: bool, s: &Settings, mark: Option<u64>) {
        self.rest_needs = if settled {
            self.needs_now(s)
        } else {
            Vec::new()
        };
        let idle = self.rest_needs.iter().all(|n| *n == Need::Idle);
        self.quiet_mark = mark.filter(|_| settled && idle);
        self.settled = settled;
    }

    /// `needs_probes` from the trackers and the ring as they are.
    fn needs_now(&self, s: &Settings) -> Vec<Need> {
        let carries =
            |t: &Tracker| t.judged_window().map_or(0, |w| w.samples) > 0 || t.active_flows > 0;
        let busy = self.trackers.iter().any(carries);
        self.trackers
            .iter()
            .zip(&self.engine.members)
            .map(|(t, m)| {
                let samples = t.judged_window().map_or(0, |w| w.samples);
                if m.place != Place::Inner || t.unhealthy.is_some() || t.suspect() {
                    Need::Now
                } else if samples >= s.min_samples {
                    Need::Measured
                } else if busy {
                    Need::Thin
                } else {
                    Need::Idle
                }
            })
            .collect()
    }

    /// Whether the last move of member `i` was for being unhealthy.
    #[must_use]
    pub fn out_sick(&self, i: usize) -> bool {
        let m = &self.engine.members[i];
        m.place == Place::Outer && matches!(m.last_reason, Some(Reason::Unhealthy(_)))
    }
}

#[cfg(test)]
mod tests;
