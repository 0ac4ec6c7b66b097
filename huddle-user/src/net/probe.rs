//! Synthetic requests to backends, spread over a round, so a resting or
//! unhealthy backend's temperature reflects how it is now. Every backend
//! is probed the same way, so a probe's latency is only ever compared with
//! other probes' latencies (never with request latency).

use crate::{
    config::{Probe, ProbeKind},
    net::http,
};
use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};
use tokio::task::JoinSet;

/// The outcome of one probe.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeResult {
    /// Connect time (TCP) or time to first byte (HTTP), in ms.
    pub latency_ms: f64,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// It failed for want of something on this host (descriptors, buffers,
    /// memory), which says nothing of the backend.
    pub local: bool,
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
            local: false,
        },
        Err(e) => ProbeResult {
            latency_ms: start.elapsed().as_secs_f64() * 1e3,
            local: is_local(&e),
            error: Some(format!("{e:#}")),
        },
    }
}

/// Whether `e` is this host's fault: out of descriptors (EMFILE, ENFILE),
/// buffers (ENOBUFS) or memory (ENOMEM).
fn is_local(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
            .is_some_and(|n| {
                matches!(
                    n,
                    libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM
                )
            })
    })
}

/// Probes in flight, each answering with the tag it was started with.
pub type Probes = JoinSet<(usize, ProbeResult)>;

/// Starts a probe of every address into `set`, tagged with its index,
/// their starts spread evenly over `over`. All at once, a round of 500
/// probes queued at the backends and in this daemon: measured (`hc-scale`,
/// 64 x 16, a debug build), 2 ms backends answered them in 13-60 ms, and
/// that noise rotated idle backends in and out.
pub fn start_spread(set: &mut Probes, addrs: &[SocketAddr], p: &Probe, over: Duration) {
    let step = over / u32::try_from(addrs.len().max(1)).unwrap_or(u32::MAX);
    for (i, a) in addrs.iter().enumerate() {
        start_one(set, i, *a, p, step * u32::try_from(i).unwrap_or(u32::MAX));
    }
}

/// Starts one probe of `addr` into `set` after `wait`, tagged `tag`.
pub fn start_one(set: &mut Probes, tag: usize, addr: SocketAddr, p: &Probe, wait: Duration) {
    let p = p.clone();
    set.spawn(async move {
        tokio::time::sleep(wait).await;
        (tag, probe(addr, &p).await)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn running_out_of_descriptors_is_this_hosts_fault() {
        let emfile = Err::<(), _>(std::io::Error::from_raw_os_error(libc::EMFILE))
            .context("connecting to 10.0.0.11:8080")
            .unwrap_err();
        assert!(is_local(&emfile));
        let refused = Err::<(), _>(std::io::Error::from_raw_os_error(libc::ECONNREFUSED))
            .context("connecting to 10.0.0.11:8080")
            .unwrap_err();
        assert!(!is_local(&refused));
        assert!(!is_local(&anyhow::anyhow!("HTTP status 500")));
    }
}
