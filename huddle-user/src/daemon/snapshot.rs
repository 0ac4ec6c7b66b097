//! What `/metrics` and `huddle status` read: a snapshot the tick takes when
//! someone has asked for one, handed to every reader waiting. Readers never
//! take the balancer's lock, so a burst of scrapes or status calls cannot
//! hold up a tick, a probe or a ring swap, and each burst costs one read of
//! the kernel's counters, not one per reader. Only `/metrics` wants the
//! latency histograms (two per-CPU map reads a backend: at 65,536 backends
//! a status call polled every 10 ms spent most of every tick on them and
//! held a 5x slow backend in its ring for 5-6 s), so a status call's
//! snapshot skips them.

use super::balancer::Balancer;
use crate::status::metrics::{Histogram, Snapshot};
use anyhow::{anyhow, Result};
use std::{
    sync::{
        atomic::{AtomicU8, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio::sync::watch;

/// The latest snapshot, or why the tick could not take it.
type Taken = Option<Result<Arc<Snapshot>, String>>;

/// The tick's side and the readers' side of the snapshots.
pub struct Snapshots {
    /// `STATUS` and `HISTOGRAMS`, as asked since the last snapshot.
    wanted: AtomicU8,
    tx: watch::Sender<Taken>,
    /// How long a reader waits for the tick before giving up.
    patience: Duration,
    /// When the last snapshot was sent, while it is still held.
    sent: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Snapshots {
    /// Snapshots for a balancer that ticks every `tick`.
    #[must_use]
    pub fn new(tick: Duration) -> Self {
        Self {
            wanted: AtomicU8::new(0),
            tx: watch::channel(None).0,
            // Two ticks and a second: a tick delayed by a slow reload is
            // waited for; a stopped one is reported.
            patience: tick * 2 + Duration::from_secs(1),
            sent: std::sync::Mutex::new(None),
        }
    }

    /// Called by the tick with the lock held: takes a snapshot if anyone
    /// asked since the last one.
    pub fn take_if_wanted(&self, b: &Balancer) {
        let wanted = self.wanted.swap(0, Ordering::AcqRel);
        let mut sent = self
            .sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if wanted != 0 {
            let taken = take(b, wanted & HISTOGRAMS != 0)
                .map(Arc::new)
                .map_err(|e| format!("{e:#}"));
            self.tx.send_replace(Some(taken));
            *sent = Some(std::time::Instant::now());
        } else if sent.is_some_and(|t| t.elapsed() > KEEP) {
            // Let go of it once its readers have long had it (without
            // waking anyone), and give the heap back: at 65,536 backends
            // a whole status is a few hundred MiB that otherwise stayed
            // in the daemon's RSS until the next call.
            *sent = None;
            self.tx.send_if_modified(|v| {
                *v = None;
                false
            });
            // SAFETY: malloc_trim only returns free heap pages to the
            // system; glibc allows it at any time.
            unsafe {
                libc::malloc_trim(0);
            }
        }
    }

    /// A snapshot the tick takes after this call, with the latency
    /// histograms if `histograms`.
    pub async fn fresh(&self, histograms: bool) -> Result<Arc<Snapshot>> {
        let ask = if histograms {
            STATUS | HISTOGRAMS
        } else {
            STATUS
        };
        // A snapshot without histograms, taken for a status call that
        // asked just before, is answered by asking again (once).
        for _ in 0..2 {
            // Subscribed before asking, so the answer to this ask is never
            // missed.
            let mut rx = self.tx.subscribe();
            rx.mark_unchanged();
            self.wanted.fetch_or(ask, Ordering::AcqRel);
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
                Some(Ok(s)) if s.histograms || !histograms => return Ok(s),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(anyhow!("reading the kernel's counters: {e}")),
                None => return Err(anyhow!("no snapshot taken")),
            }
        }
        Err(anyhow!("no snapshot with histograms taken in two ticks"))
    }
}

/// How long a sent snapshot is held for late readers: they are woken when
/// it is sent and read it at once.
const KEEP: Duration = Duration::from_secs(5);

/// `Snapshots::wanted`: someone waits for a snapshot.
const STATUS: u8 = 1;
/// ... and for its latency histograms (`/metrics`).
const HISTOGRAMS: u8 = 2;

/// One snapshot: the status and, if `histograms`, each backend's latency
/// histograms (the connect ones only where `/metrics` shows them).
fn take(b: &Balancer, histograms: bool) -> Result<Snapshot> {
    let status = b.status()?;
    let (mut ttfb, mut connect) = (Vec::new(), Vec::new());
    let with_connect = b.cfg.huddle.metrics_per_backend == crate::config::BackendMetrics::All;
    for s in status.services.iter().filter(|_| histograms) {
        for be in &s.backends {
            let sum = |c: &str| be.counters.get(c).copied().unwrap_or(0);
            let key = (s.name.clone(), be.addr.clone());
            ttfb.push((
                key.0.clone(),
                key.1.clone(),
                Histogram::from_kernel(&b.dp.latency(be.id)?, sum("ttfb_ns")),
            ));
            if with_connect {
                connect.push((
                    key.0,
                    key.1,
                    Histogram::from_kernel(&b.dp.connect_latency(be.id)?, sum("connect_ns")),
                ));
            }
        }
    }
    Ok(Snapshot {
        status,
        per_backend: b.cfg.huddle.metrics_per_backend,
        histograms,
        ttfb,
        connect,
    })
}
