//! Synthetic requests to backends, all at once, so a resting or unhealthy
//! backend's temperature reflects how it is now. Every backend is probed
//! the same way, so a probe's latency is only ever compared with other
//! probes' latencies (never with request latency).

use crate::{
    config::{Probe, ProbeKind},
    net::http,
};
use std::{net::SocketAddr, time::Instant};
use tokio::task::JoinSet;

/// The outcome of one probe.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeResult {
    /// Connect time (TCP) or time to first byte (HTTP), in ms.
    pub latency_ms: f64,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// Largest probe answer read.
const MAX_PROBE_BYTES: usize = 64 * 1024;

/// Probes one backend.
pub async fn probe(addr: SocketAddr, p: &Probe) -> ProbeResult {
    let start = Instant::now();
    let outcome = match p.kind {
        ProbeKind::Tcp => http::connect(addr, p.timeout)
            .await
            .map(|_| start.elapsed()),
        ProbeKind::Http => http::get(
            addr,
            &addr.ip().to_string(),
            &p.path,
            p.timeout,
            MAX_PROBE_BYTES,
        )
        .await
        .and_then(|r| {
            if (200..400).contains(&r.status) {
                Ok(r.first_byte)
            } else {
                Err(anyhow::anyhow!("HTTP status {}", r.status))
            }
        }),
    };
    match outcome {
        Ok(d) => ProbeResult {
            latency_ms: d.as_secs_f64() * 1e3,
            error: None,
        },
        Err(e) => ProbeResult {
            latency_ms: start.elapsed().as_secs_f64() * 1e3,
            error: Some(format!("{e:#}")),
        },
    }
}

/// Probes every address concurrently; results in the same order.
pub async fn probe_all(addrs: &[SocketAddr], p: &Probe) -> Vec<ProbeResult> {
    let mut set = JoinSet::new();
    for (i, a) in addrs.iter().enumerate() {
        let (a, p) = (*a, p.clone());
        set.spawn(async move { (i, probe(a, &p).await) });
    }
    let mut out = vec![
        ProbeResult {
            latency_ms: 0.0,
            error: Some("probe task failed".into()),
        };
        addrs.len()
    ];
    while let Some(r) = set.join_next().await {
        if let Ok((i, r)) = r {
            out[i] = r;
        }
    }
    out
}
