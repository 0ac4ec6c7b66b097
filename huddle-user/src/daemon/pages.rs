//! What the daemon's HTTP listener serves: `/metrics` from one snapshot
//! taken under the balancer's lock, and the cluster's `/ring`,
//! `/readings` and `/flows`.

use super::balancer::{lock, Balancer};
use crate::{
    net::http::Answer,
    status::metrics::{render, Histogram, Snapshot, OPENMETRICS},
};
use std::sync::Mutex;

/// Answers a GET of `path`.
pub fn route(shared: &Mutex<Balancer>, path: &str) -> Answer {
    match path {
        "/metrics" => match snapshot(shared) {
            Ok(s) => (200, OPENMETRICS, render(s)),
            Err(e) => (
                500,
                "text/plain",
                format!("reading the kernel's counters: {e:#}\n"),
            ),
        },
        // The rings this balancer's huddle decides, for the other members
        // of its cluster (see `peers`).
        "/ring" => {
            let rings = lock(shared).own_rings();
            json(&crate::cluster::peers::RingsAnswer { rings })
        }
        // This balancer's own counters per backend, for the other members
        // (see `pooled`).
        "/readings" => json(&lock(shared).own_readings()),
        // The flows this balancer's Maglev tables no longer explain, for
        // the other members (see `handoff`).
        "/flows" => {
            // Serialised off the lock: the list may be long.
            let flows = lock(shared).shared_flows.clone();
            json(&*flows)
        }
        "/" => (
            200,
            "text/plain",
            "HuddleCluster balancer: metrics at /metrics\n".into(),
        ),
        _ => (404, "text/plain", "not found: try /metrics\n".into()),
    }
}

/// `v` as a JSON answer.
fn json(v: &impl serde::Serialize) -> Answer {
    match serde_json::to_string(v) {
        Ok(j) => (200, "application/json", j),
        Err(e) => (500, "text/plain", format!("{e}\n")),
    }
}

/// Takes one scrape's snapshot, under the lock once.
fn snapshot(shared: &Mutex<Balancer>) -> anyhow::Result<Snapshot> {
    let b = lock(shared);
    let status = b.status()?;
    let (mut ttfb, mut connect) = (Vec::new(), Vec::new());
    for s in &status.services {
        for be in &s.backends {
            let sum = |c: &str| be.counters.get(c).copied().unwrap_or(0);
            let key = (s.name.clone(), be.addr.clone());
            ttfb.push((
                key.0.clone(),
                key.1.clone(),
                Histogram::from_kernel(&b.dp.latency(be.id)?, sum("ttfb_ns")),
            ));
            connect.push((
                key.0,
                key.1,
                Histogram::from_kernel(&b.dp.connect_latency(be.id)?, sum("connect_ns")),
            ));
        }
    }
    Ok(Snapshot {
        status,
        ttfb,
        connect,
    })
}
