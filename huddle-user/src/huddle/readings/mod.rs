//! The huddle of one balancer: per backend, turn the kernel's counters,
//! probes and host metrics into one reading per tick; per service, turn
//! readings into temperatures and the rotation engine's moves.
//!
//! Latency is compared like with like: a backend with enough request
//! samples in its window is judged on request latency against the median
//! request latency of the inner ring; any other backend (resting, idle) on
//! its probe latency against the inner ring's median probe latency.

use crate::{
    config::{BackendOptions, Huddle as Settings, LatencyMode, Proto, Service},
    huddle::rotation::{Engine, Move, Place, Reason},
    huddle::thermal::{self, Components, Reading},
    net::probe::ProbeResult,
    net::scrape::HostTracker,
};
use huddle_common::{BackendStats, Latency, Pulse, HUNG_NEW_FLOWS, LATENCY_BUCKETS};
use std::{collections::VecDeque, time::Duration};
pub use window::Window;
use window::{percentile, window, TickSamples, WINDOW_TICKS};

mod connect;
mod dsr;
mod window;
pub use dsr::{AgentCal, Rtt};

/// The least time an answer may be owed before new flows pass the backend
/// over: below it a late answer is scheduling noise, not a stuck server.
const PASS_OVER_MIN: Duration = Duration::from_millis(10);

/// Everything the huddle tracks about one backend.
pub struct Tracker {
    pub id: u32,
    pub opts: BackendOptions,
    /// A UDP backend: may be one-way, so owing an answer proves nothing,
    /// and it is not probed.
    pub udp: bool,
    prev: Option<(BackendStats, Latency)>,
    /// The heavy source's part of the histogram (`observe_heavy`): now,
    /// and at the last `observe`.
    heavy: (Latency, Latency),
    ticks: VecDeque<TickSamples>,
    pub window: Window,
    /// Failed over attempted (connections, requests, probes) last tick.
    pub error_rate: f64,
    pub active_flows: u64,
    pub host: HostTracker,
    pub host_error: Option<String>,
    pub probe: Option<ProbeResult>,
    probe_fresh: bool,
    fails: u32,
    passes: u32,
    /// A fault the kernel's counters show this tick.
    pub kernel_fault: Option<String>,
    /// (pulse value, connections opened when it was first seen).
    wait_seen: Option<(u64, u64)>,
    syn_seen: Option<(u64, u64)>,
    pub unhealthy: Option<String>,
    pub temperature: f64,
    pub components: Components,
    /// Which latency the temperature used: "request", "probe" or "none".
    pub latency_source: &'static str,
    /// The latency it used (ms), if any.
    pub latency_ms: Option<f64>,
    /// Set when a successful probe proves the backend answers again: the
    /// daemon then clears the kernel's stale "owes an answer" record.
    pub clear_pulse: bool,
    /// DSR: the kernel's request samples run from the client's request to
    /// its ACK of the answer, a client round trip more than the time to
    /// first byte; this estimates that round trip (`observe_connect`).
    pub rtt: Option<Rtt>,
    /// DSR with the backend's agent timing requests: its exact figures,
    /// which calibrate the ACK clock (`agent_scraped`).
    pub agent: Option<AgentCal>,
    /// The service's `latency`: which figure judges it, and whether its
    /// request turns are owed at all.
    pub latency: LatencyMode,
    /// Connect samples (`latency = "connect"`).
    pub connect: Option<connect::ConnectWindow>,
}

impl Tracker {
    #[must_use]
    pub fn new(id: u32, opts: BackendOptions, udp: bool) -> Tracker {
        Tracker {
            id,
            opts,
            udp,
            prev: None,
            heavy: (Latency::default(), Latency::default()),
            ticks: VecDeque::new(),
            window: Window::default(),
            error_rate: 0.0,
            active_flows: 0,
            host: HostTracker::default(),
            host_error: None,
            probe: None,
            probe_fresh: false,
            fails: 0,
            passes: 0,
            kernel_fault: None,
            wait_seen: None,
            syn_seen: None,
            unhealthy: None,
            temperature: 0.0,
            components: Components::default(),
            latency_source: "none",
            latency_ms: None,
            clear_pulse: false,
            rtt: None,
            agent: None,
            latency: LatencyMode::Auto,
            connect: None,
        }
    }

    /// `latency = "connect"`: this tick's connect figures.
    pub fn observe_connect_time(&mut self, stats: &BackendStats, hist: &Latency, min_samples: u64) {
        self.connect
            .get_or_insert_with(connect::ConnectWindow::default)
            .observe(stats, hist, min_samples);
    }

    /// The window this backend's latency is judged on: request samples,
    /// connect samples, or none (the service's `latency`).
    #[must_use]
    pub fn judged_window(&self) -> Option<&Window> {
        match self.latency {
            LatencyMode::Auto | LatencyMode::Ttfb => Some(&self.window),
            LatencyMode::Connect => self.connect.as_ref().map(|c| &c.window),
            LatencyMode::Off => None,
        }
    }

    /// DSR: the agent's cumulative samples at a scrape (`None`: its page
    /// has none for this VIP). With `min_samples` from both it and the ACK
    /// clock since the last scrape, the ACK clock's bias is updated.
    pub fn agent_scraped(
        &mut self,
        sample: Option<crate::net::scrape::AgentSample>,
        min_samples: u64,
    ) {
        let Some(now) = sample else {
            self.agent = None;
            return;
        };
        let (answered, ack_ns) = self
            .prev
            .as_ref()
            .map_or((0, 0), |(st, _)| (st.answered, st.ttfb_ns));
        let cal = self.agent.get_or_insert_with(AgentCal::default);
        if let Some((then, a0, n0)) = cal.last {
            let (dc, ds) = (
                now.count.wrapping_sub(then.count),
                now.sum_ns.wrapping_sub(then.sum_ns),
            );
            let (da, dn) = (answered.wrapping_sub(a0), ack_ns.wrapping_sub(n0));
            if dc >= min_samples && da >= min_samples && dc < u64::MAX / 2 && da < u64::MAX / 2 {
                let agent = ds as f64 / dc as f64 / 1e6;
                let ack = dn as f64 / da as f64 / 1e6;
                let bias = (ack - agent).max(0.0);
                cal.ttfb_ms = Some(agent);
                cal.ack_ms = Some(ack);
                cal.bias_ms = Some(cal.bias_ms.map_or(bias, |b| 0.5 * b + 0.5 * bias));
            }
        }
        cal.last = Some((now, answered, ack_ns));
    }

    /// Takes the cumulative histogram of the samples from the backend's
    /// heavy source (before `observe`; see `HeavySource`).
    pub fn observe_heavy(&mut self, heavy: &Latency) {
        self.heavy.0 = *heavy;
    }

    /// DSR: takes this tick's connect histogram (before `observe`), whose
    /// median round trip `observe` then takes off the request samples.
    pub fn observe_connect(&mut self, connect: &Latency) {
        let rtt = self.rtt.get_or_insert_with(Rtt::default);
        let prev = rtt.prev.replace(*connect).unwrap_or(*connect);
        let mut tick = Box::new([0u64; LATENCY_BUCKETS]);
        for (i, b) in tick.iter_mut().enumerate() {
            *b = connect.buckets[i].wrapping_sub(prev.buckets[i]);
        }
        rtt.ticks.push_front(tick);
        rtt.ticks.truncate(WINDOW_TICKS);
        let mut hist = [0u64; LATENCY_BUCKETS];
        for t in &rtt.ticks {
            for (h, v) in hist.iter_mut().zip(t.iter()) {
                *h += v;
            }
        }
        let total = hist.iter().sum();
        // Keep the last estimate through ticks without new connections.
        if let Some(p) = percentile(&hist, total, 0.5) {
            rtt.p50_ms = Some(p);
        }
    }

    /// Records a probe result.
    pub fn probed(&mut self, r: ProbeResult) {
        if r.local {
            // This host's fault (out of descriptors, say): no evidence
            // either way about the backend.
            return;
        }
        if r.error.is_some() {
            self.fails += 1;
            self.passes = 0;
        } else {
            self.passes += 1;
            self.fails = 0;
            if self.wait_seen.is_some() || self.syn_seen.is_some() {
                self.clear_pulse = true;
            }
        }
        self.probe = Some(r);
        self.probe_fresh = true;
    }

    /// Takes this tick's kernel figures. `now_ns` is CLOCK_MONOTONIC, the
    /// kernel's `bpf_ktime_get_ns` clock.
    pub fn observe(
        &mut self,
        stats: &BackendStats,
        hist: &Latency,
        pulse: &Pulse,
        now_ns: u64,
        s: &Settings,
        hung_after: Duration,
    ) {
        let (ps, ph) = self.prev.take().unwrap_or((*stats, *hist));
        self.prev = Some((*stats, *hist));
        self.latency_window(stats, hist, (&ps, &ph), s);
        self.active_flows = stats
            .flows_new
            .saturating_sub(stats.flows_closed)
            .min(u64::MAX / 2);
        let refused = self.errors(stats, &ps);
        self.kernel_fault = None;
        if refused >= 2
            && refused as f64
                >= s.error_threshold * stats.flows_new.wrapping_sub(ps.flows_new).max(1) as f64
        {
            // Out of the SYNs sent (`flows_new` counts completed
            // handshakes only, which a refusing backend has none of).
            let syns = stats.syns.wrapping_sub(ps.syns).max(refused);
            self.kernel_fault = Some(format!("refused {refused} of {syns} connection attempts"));
        }
        if !self.udp {
            self.owed_answers(stats, pulse, now_ns, s, hung_after);
        }
    }

    /// This tick's latency samples (the change in the kernel's histogram
    /// since `prev`) into the window, less the network's round trip.
    fn latency_window(
        &mut self,
        stats: &BackendStats,
        hist: &Latency,
        (ps, ph): (&BackendStats, &Latency),
        s: &Settings,
    ) {
        let d = |now: u64, before: u64| now.wrapping_sub(before);
        let mut tick = TickSamples {
            count: d(stats.answered, ps.answered),
            sum_ns: d(stats.ttfb_ns, ps.ttfb_ns),
            hist: Box::new([0; LATENCY_BUCKETS]),
            heavy: Box::new([0; LATENCY_BUCKETS]),
        };
        let (heavy, heavy_before) = self.heavy;
        self.heavy.1 = heavy;
        for i in 0..LATENCY_BUCKETS {
            tick.hist[i] = d(hist.buckets[i], ph.buckets[i]);
            // Never more than all of the bucket (a fresh data plane's
            // counters start again).
            tick.heavy[i] = d(heavy.buckets[i], heavy_before.buckets[i]).min(tick.hist[i]);
        }
        self.ticks.push_front(tick);
        self.ticks.truncate(WINDOW_TICKS);
        self.window = window(&self.ticks, s.min_samples);
        let correction = match self.agent.as_ref().and_then(|a| a.bias_ms) {
            Some(b) => Some(b),
            None => self.rtt.as_ref().and_then(|r| r.p50_ms),
        };
        if let Some(rtt) = correction {
            let less = |v: Option<f64>| v.map(|v| (v - rtt).max(0.0));
            self.window.mean_ms = less(self.window.mean_ms);
            self.window.p50_ms = less(self.window.p50_ms);
            self.window.p99_ms = less(self.window.p99_ms);
        }
    }

    /// Errors over attempts this tick (refusals and reset turns over new
    /// connections and turns, with a fresh probe as one more attempt).
    /// Returns the refusals.
    fn errors(&mut self, stats: &BackendStats, ps: &BackendStats) -> u64 {
        let d = |now: u64, before: u64| now.wrapping_sub(before);
        let refused = d(stats.refused, ps.refused);
        let resets = d(stats.reset_turns, ps.reset_turns);
        let conns = d(stats.flows_new, ps.flows_new);
        let turns = d(stats.turns, ps.turns);
        let mut errors = refused + resets;
        let mut attempts = conns + turns;
        if self.probe_fresh {
            attempts += 1;
            if self.probe.as_ref().is_some_and(|p| p.error.is_some()) {
                errors += 1;
            }
        }
        self.error_rate = if attempts == 0 {
            0.0
        } else {
            (errors as f64 / attempts as f64).min(1.0)
        };
        refused
    }

    /// Faults from answers owed: hung (owes a turn's answer, none comes),
    /// unreachable (owes a SYN-ACK).
    fn owed_answers(
        &mut self,
        stats: &BackendStats,
        pulse: &Pulse,
        now_ns: u64,
        s: &Settings,
        hung_after: Duration,
    ) {
        let hung_ns = hung_after.as_nanos() as u64;
        // With `latency = "connect"` or `"off"` a request owes nothing.
        let turns = if self.latency.turns() {
            pulse.turn_wait_ns
        } else {
            0
        };
        if let Some(age) = owed(turns, now_ns, stats.flows_new, &mut self.wait_seen) {
            // One turn owed long is no fault (a long poll, a stream, an
            // upload's body): hung is new connections, sent to it since it
            // last answered anything (the kernel's evidence flows, which
            // the pass-over never withholds), still unanswered after half
            // of `hung_after`, with nothing else answered all that time.
            // The health probe covers a backend that gets no traffic.
            let evidence = pulse.opened >= HUNG_NEW_FLOWS
                && now_ns.saturating_sub(pulse.evidence_ns) > hung_ns / 2;
            if evidence {
                self.kernel_fault = Some(format!(
                    "hung: no answer for {} ms, {} connections opened since",
                    age / 1_000_000,
                    pulse.opened
                ));
            }
        }
        let syn_ns = s.syn_timeout.as_nanos() as u64;
        if let Some(age) = owed(
            pulse.syn_wait_ns,
            now_ns,
            stats.flows_new,
            &mut self.syn_seen,
        ) {
            let (_, conns_then) = self.syn_seen.unwrap_or_default();
            let piled = stats.flows_new.wrapping_sub(conns_then) >= 1;
            if (age > syn_ns && piled) || age > syn_ns.saturating_mul(5) {
                self.kernel_fault = Some(format!(
                    "unreachable: SYNs unanswered for {} ms",
                    age / 1_000_000
                ));
            }
        }
    }

    /// Health after this tick's kernel figures and probes.
    fn judge(&mut self, s: &Settings) {
        let probe_fault = (self.fails >= s.probe.fall).then(|| {
            let why = self
                .probe
                .as_ref()
                .and_then(|p| p.error.clone())
                .unwrap_or_default();
            format!("{} probes failed: {why}", self.fails)
        });
        if let Some(f) = self.kernel_fault.clone().or(probe_fault) {
            if self.kernel_fault.is_some() {
                self.passes = 0;
            }
            self.unhealthy = Some(f);
        } else if self.unhealthy.is_some() && self.passes >= s.probe.rise {
            self.unhealthy = None;
        }
    }

    fn reading(&self) -> Reading {
        Reading {
            latency_ms: None,
            cpu: self.host.cpu,
            memory: self.host.memory,
            error_rate: self.error_rate,
            load: self.active_flows as f64 / self.opts.capacity.max(1) as f64,
        }
    }

    fn probe_ms(&self) -> Option<f64> {
        self.probe
            .as_ref()
            .filter(|p| p.error.is_none())
            .map(|p| p.latency_ms)
    }
}

/// How long a backend has owed an answer, if it does. Remembers, per
/// distinct wait, the counter value when it was first seen.
fn owed(since: u64, now_ns: u64, counter: u64, seen: &mut Option<(u64, u64)>) -> Option<u64> {
    if since == 0 {
        *seen = None;
        return None;
    }
    if seen.is_none_or(|(s, _)| s != since) {
        *seen = Some((since, counter));
    }
    Some(now_ns.saturating_sub(since))
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
                    let mut t = Tracker::new(*id, o.clone(), service.proto == Proto::Udp);
                    t.latency = latency;
                    t
                })
                .collect(),
            rotation: s.rotation,
            answer_p99_ms: None,
            ring_p50_ms: None,
        }
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
            maglev_size: 0,
        }
    }

    /// Temperatures from this tick's observations, then (with rotation on)
    /// the engine's moves.
    pub fn step(&mut self, s: &Settings, now: Duration) -> Vec<Move> {
        for t in &mut self.trackers {
            t.judge(s);
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
        let probe_median =
            thermal::median(inner.iter().filter_map(|i| self.trackers[*i].probe_ms()));
        self.answer_p99_ms = thermal::median(
            inner
                .iter()
                .filter(|i| use_requests[**i])
                .filter_map(|i| self.trackers[*i].window.p99_ms),
        );
        for (i, t) in self.trackers.iter_mut().enumerate() {
            let mut r = t.reading();
            let median = if use_requests[i] {
                t.latency_source = match (&t.rtt, t.agent.as_ref().and_then(|a| a.bias_ms)) {
                    _ if t.latency == LatencyMode::Connect => "connect",
                    (_, Some(_)) => "ack-clock, agent-calibrated",
                    (Some(_), None) => "ack-clock",
                    (None, None) => "request",
                };
                r.latency_ms = t.judged_window().and_then(|w| w.p50_ms);
                req_median
            } else if let Some(p) = t.probe_ms().filter(|_| t.latency != LatencyMode::Off) {
                t.latency_source = "probe";
                r.latency_ms = Some(p);
                probe_median
            } else {
                t.latency_source = "none";
                None
            };
            t.latency_ms = r.latency_ms;
            let c = thermal::score(&r, median, &s.thermal);
            t.components = c;
            t.temperature = thermal::ema(t.temperature, c.raw, s.thermal.alpha);
            t.probe_fresh = false;
            let m = &mut self.engine.members[i];
            m.temperature = t.temperature;
            m.unhealthy = t.unhealthy.clone();
        }
        if self.rotation {
            self.engine.tick(now)
        } else {
            Vec::new()
        }
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

    /// Whether the last move of member `i` was for being unhealthy.
    #[must_use]
    pub fn out_sick(&self, i: usize) -> bool {
        let m = &self.engine.members[i];
        m.place == Place::Outer && matches!(m.last_reason, Some(Reason::Unhealthy(_)))
    }
}

#[cfg(test)]
mod tests;
