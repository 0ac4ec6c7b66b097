//! Synthetic requests to backends, spread over a round, so a resting or
//! unhealthy backend's temperature reflects how it is now. Every backend
//! is probed the same way, so a probe's latency is only ever compared with
//! other probes' latencies (never with request latency).

mod exchange;
mod tls;
mod udp;

use crate::{
    config::{Probe, ProbeKind},
    net::http,
};
use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::task::JoinSet;

/// The outcome of one probe.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeResult {
    /// Connect time (TCP), time to first byte (HTTP, after the handshake
    /// for TLS) or to the answer (UDP), in ms.
    pub latency_ms: f64,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// It failed for want of something on this host (descriptors, buffers,
    /// memory), which says nothing of the backend.
    pub local: bool,
}

/// Probes one backend, in its service's protocol, all within the probe's
/// timeout.
pub async fn probe(addr: SocketAddr, p: &Probe) -> ProbeResult {
    let start = Instant::now();
    let outcome = match tokio::time::timeout(p.timeout, send(addr, p, start)).await {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!(
            "{} to {addr}: no answer within {:?}",
            p.describe(),
            p.timeout
        )),
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

/// The probe's exchange: the latency it measures.
async fn send(addr: SocketAddr, p: &Probe, start: Instant) -> anyhow::Result<Duration> {
    let host = || {
        p.host.clone().unwrap_or_else(|| match addr {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        })
    };
    let status = |(s, first): (u16, Duration)| {
        if p.passes(s) {
            Ok(first)
        } else {
            Err(anyhow::anyhow!("HTTP status {s}"))
        }
    };
    match p.kind {
        ProbeKind::Tcp => http::connect(addr, p.timeout)
            .await
            .map(|_| start.elapsed()),
        ProbeKind::Http => {
            let tcp = http::connect(addr, p.timeout).await?;
            status(exchange::get(tcp, p.version, "http", &host(), &p.path).await?)
        }
        ProbeKind::Tls => {
            let tcp = http::connect(addr, p.timeout).await?;
            let tls = tls::handshake(tcp, addr, p.sni.as_deref(), p.version).await?;
            status(exchange::get(tls, p.version, "https", &host(), &p.path).await?)
        }
        ProbeKind::Udp => udp::ask(addr, &p.send, &p.expect).await,
        // Never sent (`Balancer::probe_targets`); passes if it were.
        ProbeKind::None => Ok(Duration::ZERO),
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

/// Starts a probe of every target (an address and its service's probe)
/// into `set`, tagged with its index, their starts spread evenly over
/// `over`. All at once, a round of 500 probes queued at the backends and
/// in this daemon: measured (`hc-scale`, 64 x 16, a debug build), 2 ms
/// backends answered them in 13-60 ms, and that noise rotated idle
/// backends in and out.
pub fn start_spread(set: &mut Probes, targets: &[(SocketAddr, Arc<Probe>)], over: Duration) {
    let step = over / u32::try_from(targets.len().max(1)).unwrap_or(u32::MAX);
    for (i, (a, p)) in targets.iter().enumerate() {
        let wait = step * u32::try_from(i).unwrap_or(u32::MAX);
        start_one(set, i, *a, p.clone(), wait);
    }
}

/// Starts one probe `p` of `addr` into `set` after `wait`, tagged `tag`.
pub fn start_one(set: &mut Probes, tag: usize, addr: SocketAddr, p: Arc<Probe>, wait: Duration) {
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
