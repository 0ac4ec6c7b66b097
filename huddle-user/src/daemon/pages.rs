//! What the daemon's HTTP listener serves: `/metrics` from the tick's
//! snapshot (see `snapshot`), and the cluster's `/ring`, `/readings` and
//! `/flows`, for members that hold the cluster key.

use super::{
    balancer::{lock, Balancer},
    snapshot::Snapshots,
};
use crate::{
    cluster::auth::{self, Verifier},
    net::http::{Answer, Asked, Reply},
    status::metrics::OPENMETRICS,
};
use std::sync::Mutex;

/// Answers a GET. The cluster's pages answer only a member that signed
/// its request with the cluster key (`key`; none outside a cluster), once
/// a request, and sign what they answer.
pub async fn route(
    shared: &Mutex<Balancer>,
    snapshots: &Snapshots,
    key: Option<&Verifier>,
    asked: &Asked,
) -> Reply {
    let path = asked.path.as_str();
    match path {
        "/metrics" => match snapshots.metrics_page().await {
            Ok(Some(page)) => (200, OPENMETRICS, String::clone(&page)).into(),
            Ok(None) => Reply {
                answer: (
                    429,
                    "text/plain",
                    "too many scrapes: try again in a second\n".into(),
                ),
                headers: vec![("retry-after", "1".into())],
            },
            Err(e) => (503, "text/plain", format!("{e:#}\n")).into(),
        },
        "/ring" | "/readings" | "/flows" => {
            let Some(key) = key else {
                return (404, "text/plain", "not in a cluster\n".to_string()).into();
            };
            let nonce = match key.admit(asked.header(auth::AUTH_HEADER), path) {
                Ok(n) => n,
                Err(e) => return (401, "text/plain", format!("{e:#}\n")).into(),
            };
            let answer = cluster_page(shared, path);
            let mac = key.sign(&nonce, path, answer.2.as_bytes());
            Reply {
                answer,
                headers: vec![(auth::MAC_HEADER, mac)],
            }
        }
        "/" => (
            200,
            "text/plain",
            "HuddleCluster balancer: metrics at /metrics\n".to_string(),
        )
            .into(),
        _ => (404, "text/plain", "not found: try /metrics\n".to_string()).into(),
    }
}

/// The cluster page at `path`, for another member.
fn cluster_page(shared: &Mutex<Balancer>, path: &str) -> Answer {
    match path {
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
        _ => {
            // Serialised off the lock: the list may be long.
            let flows = lock(shared).cluster.shared_flows.clone();
            json(&*flows)
        }
    }
}

/// `v` as a JSON answer.
fn json(v: &impl serde::Serialize) -> Answer {
    match serde_json::to_string(v) {
        Ok(j) => (200, "application/json", j),
        Err(e) => (500, "text/plain", format!("{e}\n")),
    }
}
