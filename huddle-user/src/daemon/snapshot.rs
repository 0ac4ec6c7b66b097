//! What `/metrics` and `huddle status` read: a snapshot the tick takes when
//! someone has asked for one, handed to every reader waiting. Readers never
//! take the balancer's lock, so a burst of scrapes or status calls cannot
//! hold up a tick, a probe or a ring swap, and each burst costs one read of
//! the kernel's counters, not one per reader. Only `/metrics` wants the
//! latency histograms (two per-CPU map reads a backend: at 65,536 backends
//! a status call polled every 10 ms spent most of every tick on them and
//! held a 5x slow backend in its ring for 5-6 s), so a status call's
//! snapshot skips them.

use super::balancer::{lock, Balancer};
use crate::status::metrics::{render, Histogram, Snapshot};
use anyhow::{anyhow, Result};
use huddle_common::Latency;
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
    /// The last `/metrics` page and when it was rendered.
    page: std::sync::Mutex<Option<(std::time::Instant, Arc<String>)>>,
    /// When the pages of the last second were served.
    served: std::sync::Mutex<std::collections::VecDeque<std::time::Instant>>,
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
            page: std::sync::Mutex::new(None),
            served: std::sync::Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// Called by the tick with the lock held: takes a snapshot if anyone
    /// asked since the last one.
    pub fn take_if_wanted(&self, b: &Balancer) {
        let wanted = self.wanted.swap(0, Ordering::AcqRel);
        let mut sent = lock(&self.sent);
        if wanted != 0 {
            let taken = take(b, wanted).map(Arc::new).map_err(|e| format!("{e:#}"));
            self.tx.send_replace(Some(taken));
            *sent = Some(std::time::Instant::now());
        } else if sent.is_some_and(|t| t.elapsed() > KEEP) {
            // Let go of it once its readers have long had it (without
            // waking anyone), and give the heap back: at 65,536 backends
            // a whole status is a few hundred MiB that otherwise stayed
            // in the daemon's RSS until the next call.
            *sent = None;
            *lock(&self.page) = None;
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

    /// The `/metrics` page: the one rendered less than `PAGE_REUSE` ago,
    /// else one from a fresh snapshot, rendered off the runtime's workers;
    /// `None` past `PAGES_PER_SECOND` (the caller says 429). Measured at
    /// 4,096 x 16 (hc-scale --scrape, a client fetching it in a loop; it
    /// needs no credentials): with a snapshot a scrape, 17 pages, a
    /// snapshot holding the lock 350-1,294 ms each, a 5x slow backend
    /// out in 1.7-2.1 s against 0.4-0.5 without; reusing the page, 670-713
    /// pages of 14 MiB in the run, the tick's p99 as without (58 ms), the
    /// CPU at 85% against 28% and the slow backend out in 0.9 s: the
    /// sending alone. Prometheus scrapes every 15 s and never meets it.
    pub async fn metrics_page(&self) -> Result<Option<Arc<String>>> {
        {
            let mut served = lock(&self.served);
            while served
                .front()
                .is_some_and(|t| t.elapsed() > Duration::from_secs(1))
            {
                served.pop_front();
            }
            if served.len() >= PAGES_PER_SECOND {
                return Ok(None);
            }
            served.push_back(std::time::Instant::now());
        }
        if let Some((at, page)) = lock(&self.page).as_ref() {
            if at.elapsed() < PAGE_REUSE {
                return Ok(Some(page.clone()));
            }
        }
        let snapshot = self.fresh(true).await?;
        let page = tokio::task::spawn_blocking(move || render(snapshot))
            .await
            .map_err(|e| anyhow!("rendering /metrics: {e}"))?;
        let page = Arc::new(page);
        *lock(&self.page) = Some((std::time::Instant::now(), page.clone()));
        Ok(Some(page))
    }

    /// A snapshot the tick takes after this call: for `/metrics` (with
    /// the latency histograms; without backends' entries where the page
    /// shows none) if `metrics`, else a status call's (every backend).
    pub async fn fresh(&self, metrics: bool) -> Result<Arc<Snapshot>> {
        let ask = if metrics { METRICS } else { STATUS };
        // A snapshot taken for the other kind of reader, asked for just
        // before, is answered by asking again (once).
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
                Some(Ok(s)) if (metrics && s.histograms) || (!metrics && !s.lean) => return Ok(s),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(anyhow!("reading the kernel's counters: {e}")),
                None => return Err(anyhow!("no snapshot taken")),
            }
        }
        Err(anyhow!(
            "no snapshot of the kind asked for taken in two ticks"
        ))
    }
}

/// How long a rendered `/metrics` page answers later scrapes.
const PAGE_REUSE: Duration = Duration::from_secs(1);

/// The most `/metrics` pages served a second, over every client (two
/// Prometheus servers of a pair scraping at once both get theirs).
const PAGES_PER_SECOND: usize = 4;

/// How long a sent snapshot is held for late readers: they are woken when
/// it is sent and read it at once.
const KEEP: Duration = Duration::from_secs(5);

/// `Snapshots::wanted`: a status call waits (every backend's entry).
const STATUS: u8 = 1;
/// ... `/metrics` waits (the latency histograms).
const METRICS: u8 = 2;

/// One snapshot for the readers `wanted` asks for. `/metrics` past 8,192
/// backends shows none of theirs, so alone it gets a lean status; its
/// histograms are the ones the tick last read (`Tracker::own_ttfb`), a
/// map read only for a backend pooled with a cluster's or not yet seen.
/// Measured at 4,096 x 16 (hc-scale --scrape, 7 December 2026), both
/// read afresh under the lock: 350-1,294 ms a snapshot, the status
/// 204-802 of it; a 5x slow backend left in 1.7-2.1 s, not 0.4.
fn take(b: &Balancer, wanted: u8) -> Result<Snapshot> {
    use crate::config::BackendMetrics;
    let t = std::time::Instant::now();
    let (metrics, per) = (wanted & METRICS != 0, b.cfg.huddle.metrics_per_backend);
    let lean = metrics && wanted & STATUS == 0 && per == BackendMetrics::None;
    let status = if lean { b.status_lean()? } else { b.status()? };
    let status_ms = t.elapsed().as_millis();
    let (mut ttfb, mut connect) = (Vec::new(), Vec::new());
    for (si, slot) in b.dp.services.iter().enumerate().filter(|_| metrics) {
        let name = slot.service.name();
        // Past 1,024 backends only the service's sum is shown.
        let mut sum: Option<(Latency, u64)> = None;
        for (bi, &id) in slot.backend_ids.iter().enumerate() {
            let tracker = b.huddles.get(si).and_then(|h| h.trackers.get(bi));
            let own = tracker.and_then(|t| t.own_ttfb()).map(|(h, ns)| (*h, ns));
            // The counters are read only where the tracker has none or
            // the page shows the connect histogram's sum.
            let each = per == BackendMetrics::All;
            let stats = (own.is_none() || each)
                .then(|| b.dp.backend_stats(id))
                .transpose()?;
            let (hist, ns) = match own {
                Some(o) => o,
                None => (b.dp.latency(id)?, stats.map_or(0, |s| s.ttfb_ns)),
            };
            if each {
                let addr = slot.service.backends[bi].to_string();
                ttfb.push((
                    name.clone(),
                    addr.clone(),
                    Histogram::from_kernel(&hist, ns),
                ));
                let c_ns = stats.map_or(0, |s| s.connect_ns);
                let c = Histogram::from_kernel(&b.dp.connect_latency(id)?, c_ns);
                connect.push((name.clone(), addr, c));
                continue;
            }
            let (all, all_ns) = sum.get_or_insert_with(|| (Latency::default(), 0));
            all.add(&hist);
            *all_ns = all_ns.wrapping_add(ns);
        }
        if let Some((all, ns)) = sum {
            ttfb.push((name, String::new(), Histogram::from_kernel(&all, ns)));
        }
    }
    if t.elapsed() > Duration::from_millis(300) {
        tracing::info!(
            "a snapshot for status or /metrics took {} ms: the status {status_ms} ms, then the histograms",
            t.elapsed().as_millis()
        );
    }
    Ok(Snapshot {
        status,
        per_backend: per,
        histograms: metrics,
        lean,
        ttfb,
        connect,
    })
}
