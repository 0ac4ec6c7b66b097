//! What `/metrics` and `huddle status` read: a snapshot the tick takes when
//! someone has asked for one, handed to every reader waiting. Readers never
//! take the balancer's lock, so a burst of scrapes or status calls cannot
//! hold up a tick, a probe or a ring swap, and each burst costs one read of
//! the kernel's counters, not one per reader.

use super::balancer::Balancer;
use crate::status::metrics::{Histogram, Snapshot};
use anyhow::{anyhow, Result};
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio::sync::watch;

/// The latest snapshot, or why the tick could not take it.
type Taken = Option<Result<Arc<Snapshot>, String>>;

/// The tick's side and the readers' side of the snapshots.
pub struct Snapshots {
    wanted: AtomicBool,
    tx: watch::Sender<Taken>,
    /// How long a reader waits for the tick before giving up.
    patience: Duration,
}

impl Snapshots {
    /// Snapshots for a balancer that ticks every `tick`.
    #[must_use]
    pub fn new(tick: Duration) -> Self {
        Self {
            wanted: AtomicBool::new(false),
            tx: watch::channel(None).0,
            // Two ticks and a second: a tick delayed by a slow reload is
            // waited for; a stopped one is reported.
            patience: tick * 2 + Duration::from_secs(1),
        }
    }

    /// Called by the tick with the lock held: takes a snapshot if anyone
    /// asked since the last one.
    pub fn take_if_wanted(&self, b: &Balancer) {
        if self.wanted.swap(false, Ordering::AcqRel) {
            let taken = take(b).map(Arc::new).map_err(|e| format!("{e:#}"));
            self.tx.send_replace(Some(taken));
        }
    }

    /// A snapshot the tick takes after this call.
    pub async fn fresh(&self) -> Result<Arc<Snapshot>> {
        // Subscribed before asking, so the answer to this ask is never
        // missed.
        let mut rx = self.tx.subscribe();
        rx.mark_unchanged();
        self.wanted.store(true, Ordering::Release);
        match tokio::time::timeout(self.patience, rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(anyhow!("the balancer is stopping")),
            Err(_) => {
                return Err(anyhow!(
                    "the balancer's tick has not run for {:?} (a reload or a stuck kernel read holds it)",
                    self.patience
                ))
            }
        }
        let taken = rx.borrow_and_update().clone();
        match taken {
            Some(Ok(s)) => Ok(s),
            Some(Err(e)) => Err(anyhow!("reading the kernel's counters: {e}")),
            None => Err(anyhow!("no snapshot taken")),
        }
    }
}

/// One snapshot: the status and each backend's latency histograms.
fn take(b: &Balancer) -> Result<Snapshot> {
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
        per_backend: b.cfg.huddle.metrics_per_backend,
        ttfb,
        connect,
    })
}
