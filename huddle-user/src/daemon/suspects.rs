//! Suspected hangs asked about at once (`readings::suspicion`): the tick
//! hands each new suspicion here, a task probes that backend under the
//! suspicion's deadline, and hands the answer back to its tracker.

use super::balancer::{lock, Balancer};
use crate::{
    config::Probe,
    huddle::readings::suspicion::{Answer, Ask},
    net::probe::ProbeResult,
};
use std::sync::{Arc, Mutex};
use tokio::{sync::mpsc::UnboundedReceiver, task::JoinSet};
use tracing::{info, warn};

/// The most such probes in flight; the rest wait their turn (each
/// suspicion confirms by itself if its probe never comes back).
const IN_FLIGHT: usize = 256;

impl Balancer {
    /// Sends backend `bi` of service `si` a probe if a suspicion of a hang
    /// was raised there this tick.
    pub(super) fn ask_if_suspected(&mut self, si: usize, bi: usize) {
        let Some(deadline) = self.huddles[si].trackers[bi].suspicion.take_ask() else {
            return;
        };
        let addr = self.cfg.services[si].backends[bi];
        info!(
            "{}: backend {addr} owes answers past its limit: asking it at once ({} ms to answer)",
            self.cfg.services[si].name(),
            deadline.as_millis()
        );
        let probe = Probe {
            timeout: deadline,
            ..(*self.cfg.services[si].probe).clone()
        };
        if let Some(asks) = &self.asks {
            let _ = asks.send(Ask {
                si,
                bi,
                addr,
                probe,
            });
        }
    }

    /// The probe's answer `r` for `ask`, if a reload has not moved that
    /// backend.
    fn answered(&mut self, ask: &Ask, r: &ProbeResult) {
        let (si, bi) = (ask.si, ask.bi);
        let same = self.cfg.services.get(si).and_then(|s| s.backends.get(bi)) == Some(&ask.addr);
        if !same || self.huddles.get(si).is_none_or(|h| bi >= h.trackers.len()) {
            return;
        }
        let service = self.cfg.services[si].name();
        let t = &mut self.huddles[si].trackers[bi];
        match t.suspicion.answered(r) {
            Answer::Cleared => {
                // Its stale record of what it owes goes too, so new flows
                // stop passing it over.
                t.clear_pulse = true;
                info!(
                    "{service}: backend {}: suspicion of a hang cleared: it answered a probe in {:.1} ms",
                    ask.addr, r.latency_ms
                );
            }
            Answer::Confirmed => warn!(
                "{service}: backend {}: the probe sent at once failed too: {}",
                ask.addr,
                r.error.as_deref().unwrap_or("too late")
            ),
            Answer::None => {}
        }
        self.stir(si, bi);
    }

    /// Suspicions cleared and confirmed so far, over every backend.
    pub(super) fn suspicions(&self) -> (u64, u64) {
        self.huddles
            .iter()
            .flat_map(|h| &h.trackers)
            .fold((0, 0), |(c, f), t| {
                (c + t.suspicion.cleared, f + t.suspicion.confirmed)
            })
    }
}

/// Probes each suspected backend as the tick asks, at most `IN_FLIGHT`
/// at once, and hands each answer back.
pub(super) async fn asker(shared: Arc<Mutex<Balancer>>, mut asks: UnboundedReceiver<Ask>) {
    let mut set: JoinSet<(Ask, ProbeResult)> = JoinSet::new();
    loop {
        tokio::select! {
            ask = asks.recv(), if set.len() < IN_FLIGHT => {
                let Some(ask) = ask else { break };
                set.spawn(async move {
                    let r = crate::net::probe::probe(ask.addr, &ask.probe).await;
                    (ask, r)
                });
            }
            Some(done) = set.join_next(), if !set.is_empty() => {
                if let Ok((ask, r)) = done {
                    lock(&shared).answered(&ask, &r);
                }
            }
        }
    }
}
