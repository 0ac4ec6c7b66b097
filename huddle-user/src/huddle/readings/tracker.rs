//! One backend's tracker: its kernel counters, probes and host metrics
//! turned into one reading per tick, and the faults they show (hung,
//! unreachable, refusing).

use super::{
    connect,
    dsr::{AgentCal, Rtt},
    suspicion::Suspicion,
    window::{percentile, TickSamples, Ticks, Window, WINDOW_TICKS},
};
use crate::{
    config::{BackendOptions, Huddle as Settings, LatencyMode, Probe},
    huddle::thermal::{Components, Reading},
    net::probe::ProbeResult,
    net::scrape::HostTracker,
};
use huddle_common::{BackendStats, Latency, Pulse, LATENCY_BUCKETS};
use std::{collections::VecDeque, sync::Arc, time::Duration};

mod faults;

/// Everything the huddle tracks about one backend.
pub struct Tracker {
    pub id: u32,
    pub opts: BackendOptions,
    /// A UDP backend: may be one-way, so owing an answer proves nothing
    /// (it is probed only if its service says how).
    pub udp: bool,
    /// How its service probes it.
    pub probing: Arc<Probe>,
    /// Its last histograms held other balancers' samples (a cluster's).
    pub pooled: bool,
    /// The kernel's cumulative counters, histogram and its heavy
    /// source's part at the last `observe`.
    prev: Option<(BackendStats, Latency, Latency)>,
    /// The heavy source's part now (`observe_heavy`).
    heavy: Latency,
    ticks: Ticks,
    pub window: Window,
    /// Failed over attempted (connections, requests, probes) last tick.
    pub error_rate: f64,
    pub active_flows: u64,
    pub host: HostTracker,
    pub host_error: Option<String>,
    pub probe: Option<ProbeResult>,
    pub(super) probe_fresh: bool,
    /// The last `PROBES_JUDGED` successful probes' latencies (ms).
    probe_lat: VecDeque<f64>,
    /// Probes taken so far, and that count when it last changed place:
    /// equal, a resting backend has no probe newer than what moved it.
    pub(super) probes_seen: u64,
    pub(super) probes_at_move: u64,
    fails: u32,
    passes: u32,
    /// A fault the kernel's counters show this tick.
    pub kernel_fault: Option<String>,
    /// A hang the kernel's counters show, until the backend is asked.
    pub suspicion: Suspicion,
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
    /// The ring's median it was held against (of requests or of probes).
    pub against_ms: Option<f64>,
    /// Set when a successful probe proves the backend answers again: the
    /// daemon then clears the kernel's stale "owes an answer" record.
    pub clear_pulse: bool,
    /// DSR: the kernel's request samples run from the client's request to
    /// its ACK of the answer, a client round trip more than the time to
    /// first byte; this estimates that round trip (`observe_connect`).
    pub rtt: Option<Box<Rtt>>,
    /// DSR with the backend's agent timing requests: its exact figures,
    /// which calibrate the ACK clock (`agent_scraped`).
    pub agent: Option<AgentCal>,
    /// The service's `latency`: which figure judges it, and whether its
    /// request turns are owed at all.
    pub latency: LatencyMode,
    /// Connect samples (`latency = "connect"`).
    pub connect: Option<Box<connect::ConnectWindow>>,
    /// Something besides the kernel's counters came since the last tick
    /// (a probe, a host reading): the next tick must look (`at_rest`).
    pub stirred: bool,
    /// Whether the last tick's counters or temperature differed from the
    /// tick before.
    moved: bool,
}

impl Tracker {
    #[must_use]
    pub fn new(id: u32, opts: BackendOptions, udp: bool, probing: Arc<Probe>) -> Tracker {
        Tracker {
            id,
            opts,
            udp,
            probing,
            pooled: false,
            prev: None,
            heavy: Latency::default(),
            ticks: Ticks::default(),
            window: Window::default(),
            error_rate: 0.0,
            active_flows: 0,
            host: HostTracker::default(),
            host_error: None,
            probe: None,
            probe_fresh: false,
            probe_lat: VecDeque::new(),
            probes_seen: 0,
            probes_at_move: 0,
            fails: 0,
            passes: 0,
            kernel_fault: None,
            suspicion: Suspicion::default(),
            wait_seen: None,
            syn_seen: None,
            unhealthy: None,
            temperature: 0.0,
            components: Components::default(),
            latency_source: "none",
            against_ms: None,
            latency_ms: None,
            clear_pulse: false,
            rtt: None,
            agent: None,
            latency: LatencyMode::Auto,
            stirred: true,
            moved: true,
            connect: None,
        }
    }

    /// `latency = "connect"`: this tick's connect figures.
    pub fn observe_connect_time(&mut self, stats: &BackendStats, hist: &Latency, min_samples: u64) {
        self.connect
            .get_or_insert_with(Box::default)
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
            .map_or((0, 0), |(st, ..)| (st.answered, st.ttfb_ns));
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
        self.heavy = *heavy;
    }

    /// DSR: takes this tick's connect histogram (before `observe`), whose
    /// median round trip `observe` then takes off the request samples.
    pub fn observe_connect(&mut self, connect: &Latency) {
        let rtt = self.rtt.get_or_insert_with(Box::default);
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
        self.probes_seen += 1;
        // A round's probe answers a suspicion as well as the one sent at
        // once (whichever comes first).
        self.suspicion.answered(&r);
        if r.error.is_some() {
            self.fails += 1;
            self.passes = 0;
        } else {
            self.passes += 1;
            self.fails = 0;
            if self.probe_lat.len() == PROBES_JUDGED {
                self.probe_lat.pop_front();
            }
            self.probe_lat.push_back(r.latency_ms);
            if self.wait_seen.is_some() || self.syn_seen.is_some() {
                self.clear_pulse = true;
            }
        }
        self.probe = Some(r);
        self.probe_fresh = true;
        self.stirred = true;
    }

    /// Whether a tick would change nothing here: its counters and
    /// temperature stood still last tick, its latency window is empty, it
    /// owes nothing, it is healthy, and nothing else came since. Then the
    /// tick may leave it be until `wakes`.
    #[must_use]
    pub fn at_rest(&self) -> bool {
        !self.moved
            && !self.stirred
            && !self.probe_fresh
            && !self.clear_pulse
            && self.ticks.is_empty()
            && self.wait_seen.is_none()
            && self.syn_seen.is_none()
            && self.kernel_fault.is_none()
            && !self.suspicion.pending()
            && self.unhealthy.is_none()
            && self.error_rate == 0.0
            && self.latency != LatencyMode::Connect
    }

    /// Whether a backend `at_rest` has new counters or owes an answer.
    #[must_use]
    pub fn wakes(&self, stats: &BackendStats, pulse: &Pulse) -> bool {
        *pulse != Pulse::default() || self.prev.as_ref().is_none_or(|p| p.0 != *stats)
    }

    /// Its own time-to-first-byte histogram and sum as of the last tick
    /// (`/metrics` reads no map for it), unless pooled with a cluster's.
    #[must_use]
    pub fn own_ttfb(&self) -> Option<(&Latency, u64)> {
        let p = self.prev.as_ref().filter(|_| !self.pooled)?;
        Some((&p.1, p.0.ttfb_ns))
    }

    /// Whether `stats` show no request answered since the last tick: then
    /// `observe` takes an empty tick and looks at no histogram.
    #[must_use]
    pub fn quiet(&self, stats: &BackendStats) -> bool {
        self.prev
            .as_ref()
            .is_some_and(|p| p.0.answered == stats.answered)
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
        // No request answered since the last tick: its histograms are the
        // same (a sample is counted before it is put in one), so an empty
        // tick, and the 2 KiB of histograms neither copied nor compared.
        let quiet = self.quiet(stats);
        self.stirred = false;
        self.moved = self.prev.as_ref().is_none_or(|p| p.0 != *stats);
        let ps = match self.prev.as_mut() {
            Some(p) if quiet => {
                let ps = std::mem::replace(&mut p.0, *stats);
                self.window = self.ticks.push(TickSamples::empty(), s.min_samples);
                self.less_round_trip();
                ps
            }
            _ => {
                let now = (*stats, *hist, self.heavy);
                let before = self.prev.replace(now).unwrap_or(now);
                self.latency_window(&now, &before, s);
                before.0
            }
        };
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
        (stats, hist, heavy): &(BackendStats, Latency, Latency),
        (ps, ph, pheavy): &(BackendStats, Latency, Latency),
        s: &Settings,
    ) {
        let d = |now: u64, before: u64| now.wrapping_sub(before);
        let all: [u64; LATENCY_BUCKETS] =
            std::array::from_fn(|i| d(hist.buckets[i], ph.buckets[i]));
        // Never more than all of the bucket (a fresh data plane's counters
        // start again).
        let part: [u64; LATENCY_BUCKETS] =
            std::array::from_fn(|i| d(heavy.buckets[i], pheavy.buckets[i]).min(all[i]));
        let tick = TickSamples::new(
            d(stats.answered, ps.answered),
            d(stats.ttfb_ns, ps.ttfb_ns),
            &all,
            Some(part),
        );
        self.window = self.ticks.push(tick, s.min_samples);
        self.less_round_trip();
    }

    /// Takes the network's round trip (DSR: the agent's bias or the
    /// connect median) off the window's figures.
    fn less_round_trip(&mut self) {
        let correction = match self.agent.as_ref().and_then(|a| a.bias_ms) {
            Some(b) => Some(b),
            None => self.rtt.as_ref().and_then(|r| r.p50_ms),
        };
        if let Some(rtt) = correction {
            let less = |v: Option<f64>| v.map(|v| (v - rtt).max(0.0));
            self.window.mean_ms = less(self.window.mean_ms);
            self.window.p50_ms = less(self.window.p50_ms);
            self.window.p75_ms = less(self.window.p75_ms);
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

    pub(super) fn reading(&self) -> Reading {
        Reading {
            latency_ms: None,
            cpu: self.host.cpu,
            memory: self.host.memory,
            error_rate: self.error_rate,
            load: self.active_flows as f64 / self.opts.capacity.max(1) as f64,
        }
    }

    /// This tick's temperature: judged on its request window
    /// (`requests`) against the ring's `median` of the same, else on its
    /// probe (`inner`: see `probe_ms`) against the ring's probe median.
    pub(super) fn judge_temperature(
        &mut self,
        requests: bool,
        inner: bool,
        median: Option<f64>,
        s: &crate::config::Huddle,
    ) {
        let mut r = self.reading();
        let median = if requests {
            self.latency_source = match (&self.rtt, self.agent.as_ref().and_then(|a| a.bias_ms)) {
                _ if self.latency == LatencyMode::Connect => "connect",
                (_, Some(_)) => "ack-clock, agent-calibrated",
                (Some(_), None) => "ack-clock",
                (None, None) => "request",
            };
            r.latency_ms = self.judged_window().and_then(|w| w.p50_ms);
            median
        } else if let Some(p) = self
            .probe_ms(inner)
            .filter(|_| self.latency != LatencyMode::Off)
        {
            self.latency_source = FROM_PROBES;
            r.latency_ms = Some(p);
            median
        } else {
            self.latency_source = "none";
            None
        };
        self.latency_ms = r.latency_ms;
        self.against_ms = median;
        let c = crate::huddle::thermal::score(&r, median, &s.thermal);
        self.components = c;
        let t = crate::huddle::thermal::ema(self.temperature, c.raw, s.thermal.alpha);
        // Moving by less, the EMA is at rest: left there it stays within
        // 1e-4 / alpha of where it would go, far inside any threshold.
        self.moved |= (t - self.temperature).abs() > 1e-4;
        self.temperature = t;
        self.probe_fresh = false;
    }

    /// Whether anything says this backend may be going wrong: it owes an
    /// answer or a SYN-ACK, or attempts failed last tick.
    #[must_use]
    pub fn suspect(&self) -> bool {
        self.wait_seen.is_some() || self.syn_seen.is_some() || self.error_rate > 0.0
    }

    /// The probe latency judged, while the last probe passed. An inner
    /// member (`inner`): the median of its last three that passed (the
    /// lesser of two, nothing from one), so one slow probe (the first
    /// connect's ARP, a busy scheduler) never rests it. A resting one: its
    /// last, so a backend just rested for its requests shows hot at once
    /// (its return is timed by its rest anyway).
    /// Measured before (judged on the last probe alone): at the start of
    /// the scaleout test the leader rested a healthy backend as hot on
    /// one 3.1 ms probe against the others' 0.1 ms in most runs, and one
    /// such rest ending during a failover broke 28 connections.
    pub(super) fn probe_ms(&self, inner: bool) -> Option<f64> {
        let last = self.probe.as_ref().filter(|p| p.error.is_none())?;
        if !inner {
            return Some(last.latency_ms);
        }
        let mut v: Vec<f64> = self.probe_lat.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 | 1 => None,
            n if n < PROBES_JUDGED => v.first().copied(),
            n => v.get(n / 2).copied(),
        }
    }
}

impl Tracker {
    /// The slowest of the probes `probe_ms` judges an inner member on
    /// (at least two), while the last passed: its share of the ring's
    /// spread of probe latency (`readings::shared_spread`).
    pub(super) fn probe_spread_ms(&self) -> Option<f64> {
        self.probe.as_ref().filter(|p| p.error.is_none())?;
        if self.probe_lat.len() < 2 {
            return None;
        }
        self.probe_lat.iter().copied().reduce(f64::max)
    }
}

/// `Tracker::latency_source` of a backend judged on its probes.
pub(super) const FROM_PROBES: &str = "probe";

/// How many of the last successful probes the probe latency is judged on.
const PROBES_JUDGED: usize = 3;
