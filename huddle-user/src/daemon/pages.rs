//! What the daemon's HTTP listener serves: `/metrics` from the tick's
//! snapshot (see `snapshot`), and the cluster's `/ring`, `/readings` and
//! `/flows`.

use super::{
    balancer::{lock, Balancer},
    snapshot::Snapshots,
};
use crate::{
    net::http::Answer,
    status::metrics::{render, OPENMETRICS},
};
use std::sync::Mutex;

/// Answers a GET of `path`.
pub async fn route(shared: &Mutex<Balancer>, snapshots: &Snapshots, path: &str) -> Answer {
    match path {
        "/metrics" => match snapshots.fresh().await {
            Ok(s) => (200, OPENMETRICS, render(s)),
            Err(e) => (503, "text/plain", format!("{e:#}\n")),
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
            let flows = lock(shared).cluster.shared_flows.clone();
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
