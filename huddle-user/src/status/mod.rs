//! What `huddle status` shows: a snapshot of services, rings and counters,
//! as JSON for scripts or as a table for people.

pub mod control;
pub mod metrics;

use crate::{huddle::rotation::Place, huddle::thermal::Components};
use serde::{Deserialize, Serialize};
use std::{collections::BTreeMap, fmt::Write as _};

/// Counters by field name: the names are the program's own (borrowed,
/// not a string allocated per counter per backend: at 65,536 backends
/// those were millions of allocations a status).
pub type Counters = BTreeMap<std::borrow::Cow<'static, str>, u64>;

/// Counters of one stats struct, by field name.
#[must_use]
pub fn counters(c: &impl huddle_common::Counters) -> Counters {
    let mut map = Counters::new();
    c.for_each(|name, value| {
        map.insert(std::borrow::Cow::Borrowed(name), value);
    });
    map
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub interface: String,
    pub xdp_mode: String,
    pub program_id: Option<u32>,
    pub snat: String,
    pub nat_ports: String,
    pub uptime_s: f64,
    /// Length of a huddle tick.
    pub tick_ms: f64,
    pub services: Vec<ServiceStatus>,
    pub global: Counters,
    /// What the operator must know about the data plane: why this attach
    /// mode, pins that do not outlive the daemon, a mode forwarding nothing.
    #[serde(default)]
    pub notes: Vec<String>,
    /// The VIPs announced by BGP (with `[bgp]`).
    #[serde(default)]
    pub bgp: Option<crate::cluster::bgp::BgpStatus>,
    /// What the control plane itself costs.
    #[serde(default)]
    pub control: ControlCost,
}

/// The control plane's own work: how long its ticks take and how many
/// probes it sends.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ControlCost {
    /// Over the last (up to 600) ticks: median, 99th percentile, longest.
    pub tick_p50_ms: f64,
    pub tick_p99_ms: f64,
    pub tick_max_ms: f64,
    /// Probes sent since start.
    pub probes_sent: u64,
    /// Kernel memory of the data plane's maps, and how many.
    #[serde(default)]
    pub map_bytes: u64,
    #[serde(default)]
    pub maps: usize,
    /// Services the last tick passed by, at rest (see `daemon::settle`).
    #[serde(default)]
    pub services_at_rest: usize,
    /// Suspected hangs a probe sent at once cleared (the backend answered)
    /// and confirmed (it failed too), since start.
    #[serde(default)]
    pub hangs_cleared: u64,
    #[serde(default)]
    pub hangs_confirmed: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub name: String,
    /// "snat", "dsr-l2" or "dsr-ipip".
    #[serde(default)]
    pub mode: String,
    /// "round_robin" or "maglev".
    #[serde(default)]
    pub selection: String,
    /// False: plain round robin over every (undrained) backend.
    pub rotation: bool,
    /// Too few healthy backends: the least hot unhealthy ones are kept.
    pub panic: bool,
    pub ring_generation: u64,
    /// The live ring, in order.
    pub ring: Vec<String>,
    pub counters: Counters,
    /// How long a backend may owe answers before it is hung, as derived
    /// this tick from the ring's p99 (see `hung_after_p99`).
    #[serde(default)]
    pub hung_after_ms: f64,
    /// How long it may owe an answer, or a SYN-ACK, before new flows pass
    /// it over in the kernel (0: never).
    #[serde(default)]
    pub pass_over_ms: f64,
    #[serde(default)]
    pub pass_over_syn_ms: f64,
    pub backends: Vec<BackendStatus>,
    /// Recent rotations, oldest first.
    pub recent: Vec<RotationEvent>,
}

/// One backend moving between the rings.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RotationEvent {
    /// Seconds since the daemon started.
    pub at_s: f64,
    pub service: String,
    pub backend: String,
    pub to: Place,
    pub reason: String,
    pub temperature: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendStatus {
    pub addr: String,
    pub id: u32,
    /// "inner", "outer" or "drained".
    pub place: String,
    /// In the kernel's live ring.
    pub in_ring: bool,
    pub drained: bool,
    pub temperature: f64,
    /// The terms of the last raw score.
    pub components: Components,
    /// Which latency the anomaly used: "request" (replies timed as they
    /// pass), "ack-clock" (DSR: the client's ACKs, less `rtt_ms`), "probe"
    /// or "none".
    pub latency_source: String,
    /// DSR: what is taken off the ACK-clock samples: how much they read
    /// above the agent's exact figure, or without one the clients' round
    /// trip (the median connect sample).
    #[serde(default)]
    pub rtt_ms: Option<f64>,
    /// DSR with the backend's agent: its exact mean time to first byte,
    /// and the ACK clock's raw mean, over the last scrape interval.
    #[serde(default)]
    pub agent_ttfb_ms: Option<f64>,
    #[serde(default)]
    pub ack_clock_ms: Option<f64>,
    /// Request latency (time to first byte) over the newest ticks.
    pub samples: u64,
    /// Of those, the heaviest client /24's (/64's): the median is the
    /// lower of its and the others' when both have enough.
    #[serde(default)]
    pub heavy_samples: u64,
    pub mean_ms: Option<f64>,
    pub p50_ms: Option<f64>,
    #[serde(default)]
    pub p75_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub probe_ms: Option<f64>,
    pub probe_error: Option<String>,
    /// Failed share of last tick's connections, requests and probes.
    pub error_rate: f64,
    pub cpu: Option<f64>,
    pub memory: Option<f64>,
    /// Why cpu and memory are missing, if they are.
    pub host_note: Option<String>,
    pub unhealthy: Option<String>,
    pub weight: f64,
    pub rotations: u64,
    pub last_reason: Option<String>,
    pub last_move_s_ago: Option<f64>,
    /// Resting: seconds until it may return (it also must have cooled).
    #[serde(default)]
    pub rest_left_s: Option<f64>,
    /// Flows assigned minus flows seen closing.
    pub active_flows: u64,
    pub counters: Counters,
}

/// Whether a service named `name` is one of those `names` asks for (its
/// name contains one of them; every service when `names` is empty).
#[must_use]
pub fn named(name: &str, names: &[String]) -> bool {
    names.is_empty() || names.iter().any(|o| name.contains(o.as_str()))
}

impl Status {
    /// This status with only the services whose names contain one of
    /// `names` (all when empty); an error when none does.
    pub fn only(&self, names: &[String]) -> anyhow::Result<Status> {
        let services: Vec<ServiceStatus> = self
            .services
            .iter()
            .filter(|s| named(&s.name, names))
            .cloned()
            .collect();
        if services.is_empty() && !names.is_empty() {
            anyhow::bail!("no service's name contains {}", names.join(" or "));
        }
        Ok(Status {
            interface: self.interface.clone(),
            xdp_mode: self.xdp_mode.clone(),
            program_id: self.program_id,
            snat: self.snat.clone(),
            nat_ports: self.nat_ports.clone(),
            uptime_s: self.uptime_s,
            tick_ms: self.tick_ms,
            services,
            global: self.global.clone(),
            notes: self.notes.clone(),
            bgp: self.bgp.clone(),
            control: self.control.clone(),
        })
    }

    /// Human-readable table.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "huddle on {} ({} XDP, program id {}), SNAT {} ports {}, up {:.0}s, tick {} ms",
            self.interface,
            self.xdp_mode,
            self.program_id.map_or("?".into(), |i| i.to_string()),
            self.snat,
            self.nat_ports,
            self.uptime_s,
            self.tick_ms
        );
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        if let Some(b) = &self.bgp {
            let what = if b.drained {
                "drained, nothing announced".to_string()
            } else if b.announced.is_empty() {
                "nothing announced".to_string()
            } else {
                format!("announcing {}", b.announced.join(", "))
            };
            let _ = writeln!(out, "bgp: {what}");
            if let Some(e) = &b.error {
                let _ = writeln!(out, "note: bgp: {e}");
            }
        }
        for s in &self.services {
            s.render(&mut out);
        }
        let c = &self.control;
        let _ = writeln!(
            out,
            "\ncontrol: tick took {:.2} ms (p50), {:.2} ms (p99), {:.2} ms (longest) of {} ms, passing by {} services at rest; {} probes sent; suspected hangs: {} cleared by the backend's answer, {} confirmed; {} kernel maps hold {:.1} MiB",
            c.tick_p50_ms,
            c.tick_p99_ms,
            c.tick_max_ms,
            self.tick_ms,
            c.services_at_rest,
            c.probes_sent,
            c.hangs_cleared,
            c.hangs_confirmed,
            c.maps,
            c.map_bytes as f64 / f64::from(1 << 20)
        );
        let _ = writeln!(out, "global counters: {}", nonzero(&self.global));
        out
    }
}

impl ServiceStatus {
    /// One service's block of the table.
    fn render(&self, out: &mut String) {
        let s = self;
        let _ = writeln!(
            out,
            "\nservice {} ({}, {})  ring generation {}  rotation {}{}",
            s.name,
            if s.mode.is_empty() { "snat" } else { &s.mode },
            if s.selection.is_empty() {
                "round_robin"
            } else {
                &s.selection
            },
            s.ring_generation,
            if s.rotation { "on" } else { "off" },
            if s.panic {
                "  PANIC: too few healthy backends"
            } else {
                ""
            }
        );
        let _ = writeln!(out, "  inner ring: [{}]", s.ring.join(", "));
        let _ = writeln!(
            out,
            "  {:<20} {:<7} {:>5} | {:>5} {:>4} {:>4} {:>4} {:>4} | {:>8} {:>8} {:>8} {:>5} {:>6} {:>8} {:>4}  last reason / health",
            "backend", "ring", "temp", "anom", "cpu", "mem", "err", "load", "p50 ms", "p99 ms", "probe ms", "err%", "active", "flows", "rot"
        );
        for b in &s.backends {
            b.render(out);
        }
        // One line per distinct note, naming the backends it is about.
        let mut notes: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for b in &s.backends {
            if let Some(n) = &b.host_note {
                notes.entry(n).or_default().push(&b.addr);
            }
        }
        for (n, addrs) in notes {
            let _ = writeln!(out, "  note ({}): {n}", addrs.join(", "));
        }
        if s.mode.starts_with("dsr") {
            s.render_ack_clock(out);
        }
        // UDP backends need not answer: neither applies to them.
        if !s.name.ends_with("/udp") {
            let _ = writeln!(
                out,
                "  hung after {:.0} ms; new flows pass over a backend owing an answer {:.0} ms or a SYN-ACK {:.0} ms (0: never)",
                s.hung_after_ms, s.pass_over_ms, s.pass_over_syn_ms
            );
        }
        s.render_retries(out);
        let skip = s.recent.len().saturating_sub(5);
        for e in s.recent.iter().skip(skip) {
            let _ = writeln!(
                out,
                "  at {:>8.1}s  {} -> {} ring ({}), temperature {:.2}",
                e.at_s,
                e.backend,
                e.to.as_str(),
                e.reason,
                e.temperature
            );
        }
        let _ = writeln!(out, "  service counters: {}", nonzero(&s.counters));
    }

    /// DSR: where each backend's latency came from.
    fn render_ack_clock(&self, out: &mut String) {
        let s = self;
        let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
        let _ = writeln!(
            out,
            "  latency from the clients' ACKs (ms): backend, ACK clock raw mean, agent's exact mean, taken off (agent's bias, else round trip)"
        );
        for b in &s.backends {
            let _ = writeln!(
                out,
                "    {:<20} {:>8} {:>8} {:>8}  {}",
                b.addr,
                f(b.ack_clock_ms),
                f(b.agent_ttfb_ms),
                f(b.rtt_ms),
                b.latency_source
            );
        }
    }

    /// Backends whose SYNs were retried or that new flows passed over.
    fn render_retries(&self, out: &mut String) {
        let s = self;
        for b in &s.backends {
            let c = |k: &str| b.counters.get(k).copied().unwrap_or(0);
            let (refused, silent, passed, tw) = (
                c("retried_refused"),
                c("retried_silent"),
                c("skipped_owing"),
                c("retried_time_wait"),
            );
            if refused + silent + passed + tw > 0 {
                let _ = writeln!(
                    out,
                    "  {}: {refused} refused and {silent} unanswered SYNs retried on another backend, {tw} refused by an old connection's TIME_WAIT resent from another NAT tuple; passed over by {passed} new flows",
                    b.addr
                );
            }
        }
    }
}

impl BackendStatus {
    /// One backend's row.
    fn render(&self, out: &mut String) {
        let b = self;
        let c = &b.components;
        let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
        let health = match (&b.unhealthy, &b.last_reason) {
            (Some(u), _) => format!("UNHEALTHY {u}"),
            (None, Some(r)) => {
                format!("{r} ({:.0}s ago)", b.last_move_s_ago.unwrap_or(0.0))
            }
            (None, None) => String::new(),
        };
        let _ = writeln!(
            out,
            "  {:<20} {:<7} {:>5.2} | {:>5.2} {:>4.2} {:>4.2} {:>4.2} {:>4.2} | {:>8} {:>8} {:>8} {:>5.1} {:>6} {:>8} {:>4}  {}",
            b.addr,
            b.place,
            b.temperature,
            c.anomaly,
            c.cpu,
            c.memory,
            c.errors,
            c.load,
            ms(b.p50_ms),
            ms(b.p99_ms),
            ms(b.probe_ms),
            b.error_rate * 100.0,
            b.active_flows,
            b.counters.get("flows_new").copied().unwrap_or(0),
            b.rotations,
            health
        );
    }
}

fn nonzero(c: &Counters) -> String {
    let parts: Vec<String> = c
        .iter()
        .filter(|(_, v)| **v != 0)
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if parts.is_empty() {
        "all zero".into()
    } else {
        parts.join(" ")
    }
}
