//! What `huddle status` shows: a snapshot of services, rings and counters,
//! as JSON for scripts or as a table for people.

use serde::{Deserialize, Serialize};
use std::{collections::BTreeMap, fmt::Write as _};

pub type Counters = BTreeMap<String, u64>;

/// Counters of one stats struct, by field name.
#[must_use]
pub fn counters(c: &impl huddle_common::Counters) -> Counters {
    let mut map = Counters::new();
    c.for_each(|name, value| {
        map.insert(name.to_string(), value);
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
    pub services: Vec<ServiceStatus>,
    pub global: Counters,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub name: String,
    pub ring_generation: u64,
    /// The live ring, in order.
    pub ring: Vec<String>,
    pub counters: Counters,
    pub backends: Vec<BackendStatus>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendStatus {
    pub addr: String,
    pub id: u32,
    pub in_ring: bool,
    pub drained: bool,
    /// Flows assigned minus flows seen closing.
    pub active_flows: u64,
    pub counters: Counters,
}

impl Status {
    /// Human-readable table.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "huddle on {} ({} XDP, program id {}), SNAT {} ports {}, up {:.0}s",
            self.interface,
            self.xdp_mode,
            self.program_id.map_or("?".into(), |i| i.to_string()),
            self.snat,
            self.nat_ports,
            self.uptime_s
        );
        for s in &self.services {
            let _ = writeln!(
                out,
                "\nservice {}  ring generation {}",
                s.name, s.ring_generation
            );
            let _ = writeln!(out, "  ring: [{}]", s.ring.join(", "));
            let _ = writeln!(
                out,
                "  {:<22} {:<8} {:>7} {:>9} {:>10} {:>10} {:>12} {:>12} {:>6}",
                "backend",
                "ring",
                "active",
                "flows",
                "pkts to",
                "pkts from",
                "bytes to",
                "bytes from",
                "rsts"
            );
            for b in &s.backends {
                let c = |k: &str| b.counters.get(k).copied().unwrap_or(0);
                let ring = match (b.in_ring, b.drained) {
                    (true, _) => "inner",
                    (false, true) => "drained",
                    (false, false) => "outer",
                };
                let _ = writeln!(
                    out,
                    "  {:<22} {:<8} {:>7} {:>9} {:>10} {:>10} {:>12} {:>12} {:>6}",
                    b.addr,
                    ring,
                    b.active_flows,
                    c("flows_new"),
                    c("pkts_to"),
                    c("pkts_from"),
                    c("bytes_to"),
                    c("bytes_from"),
                    c("rsts_from")
                );
            }
            let _ = writeln!(out, "  service counters: {}", nonzero(&s.counters));
        }
        let _ = writeln!(out, "\nglobal counters: {}", nonzero(&self.global));
        out
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
