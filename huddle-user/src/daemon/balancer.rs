//! The running balancer's state, behind one lock: its data plane, config,
//! huddle per service, and what it reports; reloads and the ring swaps
//! every other part goes through.

use crate::huddle::state::Saved;
use crate::{
    config::{Config, Service},
    huddle::readings::ServiceHuddle,
    kernel::dataplane::Dataplane,
    status::RotationEvent,
};
use anyhow::{bail, Context, Result};
use std::{
    collections::{HashMap, HashSet, VecDeque},
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tracing::{debug, info, warn};

/// The running balancer's state, behind one lock: the data plane, the
/// config and a huddle per service, then one struct per concern.
pub struct Balancer {
    pub dp: Dataplane,
    pub cfg: Config,
    /// One per service, parallel to `cfg.services`.
    pub huddles: Vec<ServiceHuddle>,
    /// Backends whose flows the kernel is moving off (marked dead).
    pub(super) moving: HashSet<u32>,
    /// Pass-over limits last written, per service id.
    pub(super) tuned: HashMap<u32, huddle_common::Tuning>,
    /// Per backend id: `answered` when its latency histograms were last
    /// read, and what they held (`read_backend` skips unchanged ones).
    pub(super) hist_cache: HashMap<u32, (u64, huddle_common::Latency, huddle_common::Latency)>,
    /// This tick's read of every backend's counters (`Dataplane::backend_snapshot`).
    pub(super) snapshot: Option<crate::kernel::dataplane::stats::BackendSnapshot>,
    /// The counters as last read, kept between ticks (`settle`), and
    /// the next settled service whose backends a tick looks at.
    pub(super) kept: Option<crate::kernel::dataplane::stats::BackendSnapshot>,
    pub(super) wake_cursor: usize,
    /// Where `watch_quiet` goes on from.
    pub(super) quiet_cursor: usize,
    /// Start, reload and stop.
    pub life: Lifecycle,
    /// What the balancer has seen and tells an operator.
    pub(super) seen: Seen,
    /// Its cluster and its BGP announcements.
    pub cluster: ClusterSide,
    /// Where suspected hangs go to be asked about (`suspects`).
    pub(super) asks:
        Option<tokio::sync::mpsc::UnboundedSender<crate::huddle::readings::suspicion::Ask>>,
}

/// The daemon's life: when it started, how it re-reads its config, how
/// it is told to stop and what it leaves behind.
pub struct Lifecycle {
    pub(super) started: Instant,
    /// Told when an operator asks the daemon to stop and remove everything.
    pub stop: Arc<tokio::sync::Notify>,
    /// Set with `stop`: remove the data plane on the way out.
    pub remove_on_exit: bool,
    /// Sysctl values from before the first start, kept in the state file.
    pub sysctl_originals: Vec<(PathBuf, String)>,
    /// Re-reads the configuration (file and flags) for a reload.
    pub reloader: Option<Reloader>,
}

/// What the balancer has seen that an operator must hear about once, or
/// find in `huddle status`.
#[derive(Default)]
pub struct Seen {
    /// Recent rotations, newest last.
    pub events: VecDeque<RotationEvent>,
    /// Things about the data plane an operator must know (shown by
    /// `huddle status`): how it was attached and why, pins that do not
    /// outlive the daemon, a mode that forwards nothing.
    pub notes: Vec<String>,
    /// Start-up check that transmitted frames get answers.
    pub(super) watch: Option<TxWatch>,
    /// Per backend id: early NAT tuple reuses counted so far, and whether
    /// they are being reported (one line when they start, one when they
    /// stop).
    pub(super) nat_reuse: HashMap<u32, (u64, bool)>,
    /// Per service: when it was last seen in panic mode.
    pub(super) last_panic: HashMap<usize, Instant>,
    /// Probes sent since start.
    pub(super) probes_sent: u64,
    /// Services the last tick passed by (`settle`).
    pub(super) passed_by: usize,
    /// How long the last ticks took, newest last (`TICKS_TIMED`).
    pub(super) tick_took: VecDeque<Duration>,
}

/// Ticks whose duration `huddle status` summarises.
pub(super) const TICKS_TIMED: usize = 600;

/// The balancer's side of its cluster and of BGP.
pub struct ClusterSide {
    /// The member of `[cluster]` whose rings this balancer takes (`None`:
    /// it decides its own), and what the poll last found wrong.
    pub leader: Option<crate::cluster::peers::Leader>,
    pub(super) leader_note: Option<String>,
    /// The flows this balancer shares with its cluster (`/flows`), and
    /// what the last exchange did (see `handoff`).
    pub shared_flows: Arc<crate::cluster::handoff::FlowsAnswer>,
    pub(super) handoff_note: Option<String>,
    /// The other balancers' readings, added to this one's (see `pooled`),
    /// and what the last poll found.
    pub(super) pool: crate::cluster::pooled::Pool,
    pub(super) pool_note: Option<String>,
    /// Which members answer the poll; the rings hold while that changes.
    pub(super) members: crate::cluster::membership::Membership,
    /// Until when the rings hold, and why.
    pub(super) hold: Option<(Duration, String)>,
    /// Announces the VIPs through bird (with `[bgp]`); its own lock, so
    /// a slow bird never holds up a tick or `huddle status`.
    pub bgp: Option<Arc<Mutex<crate::cluster::bgp::Announcer>>>,
}

/// SYNs sent toward backends and answers translated at the first tick, to
/// tell an attach mode that loses what it transmits (SYNs sent, nothing
/// ever answered) in the first seconds.
#[derive(Clone, Copy)]
pub(super) struct TxWatch {
    pub(super) sent: u64,
    pub(super) answered: u64,
    /// Answered, or already reported: nothing more to watch.
    pub(super) done: bool,
}

impl TxWatch {
    /// Adds one backend's SYNs sent and answers seen. DSR replies bypass
    /// the balancer: a completed handshake is the proof that SYNs arrived.
    pub(super) fn add(&mut self, st: &huddle_common::BackendStats, dsr: bool) {
        self.sent += st.syns;
        self.answered += if dsr { st.syn_acks } else { st.pkts_from };
    }
}

/// How long after start the daemon checks that sent frames are answered.
pub(super) const TX_WATCH: Duration = Duration::from_secs(5);

/// SYNs that must go out unanswered before it says so.
pub(super) const TX_WATCH_MIN_SENT: u64 = 20;

/// Produces a fresh, validated configuration.
pub type Reloader = Arc<dyn Fn() -> Result<Config> + Send + Sync>;

/// Rotations kept for `huddle status`.
pub(super) const EVENTS_KEPT: usize = 50;

/// Locks the balancer; a panic elsewhere must not stop the data plane's
/// control. A hold longer than `LONG_HOLD` is logged with where it was
/// taken: every other task (ticks, probes, the control socket) waits on it.
#[track_caller]
pub fn lock<T>(shared: &Mutex<T>) -> Held<'_, T> {
    Held::new(
        shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

/// `lock` if nobody holds it now. For a task with clocks running (the
/// prober's probes in flight): blocked on the lock, a runtime worker polls
/// none of them, and their latencies grow by the wait.
#[track_caller]
pub fn try_lock<T>(shared: &Mutex<T>) -> Option<Held<'_, T>> {
    match shared.try_lock() {
        Ok(g) => Some(Held::new(g)),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(Held::new(p.into_inner())),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Holds of the balancer's lock logged as long (a tick is 100 ms).
const LONG_HOLD: Duration = Duration::from_millis(500);

/// The balancer's lock, held (`lock`).
pub struct Held<'a, T> {
    guard: std::sync::MutexGuard<'a, T>,
    since: std::time::Instant,
    at: &'static std::panic::Location<'static>,
}

impl<'a, T> Held<'a, T> {
    /// A hold starting now, logged (if long) with where `lock` or
    /// `try_lock` was called.
    #[track_caller]
    fn new(guard: std::sync::MutexGuard<'a, T>) -> Self {
        Held {
            guard,
            since: std::time::Instant::now(),
            at: std::panic::Location::caller(),
        }
    }
}

impl<T> std::ops::Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> std::ops::DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        let held = self.since.elapsed();
        if held > LONG_HOLD {
            tracing::info!(
                "the balancer's lock was held {} ms (taken at {}); ticks, probes and the control socket waited",
                held.as_millis(),
                self.at
            );
        }
    }
}

impl Balancer {
    /// The balancer over a loaded data plane, carrying on from `saved` if
    /// given.
    #[must_use]
    pub fn new(dp: Dataplane, cfg: Config, saved: Option<&Saved>) -> Balancer {
        let huddles = cfg
            .services
            .iter()
            .zip(&dp.services)
            .map(|(s, slot)| ServiceHuddle::new(s, &slot.backend_ids, &cfg.huddle, Duration::ZERO))
            .collect();
        let bgp = cfg
            .bgp
            .clone()
            .map(|b| Arc::new(Mutex::new(crate::cluster::bgp::Announcer::new(b))));
        let mut b = Balancer {
            dp,
            cfg,
            huddles,
            moving: HashSet::new(),
            tuned: HashMap::new(),
            hist_cache: HashMap::new(),
            kept: None,
            wake_cursor: 0,
            quiet_cursor: 0,
            snapshot: None,
            life: Lifecycle {
                started: Instant::now(),
                stop: Arc::new(tokio::sync::Notify::new()),
                remove_on_exit: false,
                sysctl_originals: Vec::new(),
                reloader: None,
            },
            seen: Seen::default(),
            cluster: ClusterSide {
                leader: None,
                leader_note: None,
                shared_flows: Arc::default(),
                handoff_note: None,
                pool: crate::cluster::pooled::Pool::default(),
                pool_note: None,
                members: Default::default(),
                hold: None,
                bgp,
            },
            asks: None,
        };
        if let Some(saved) = saved {
            b.restore(saved);
        }
        // A warm-up or the saved state may have some backends resting.
        for si in 0..b.huddles.len() {
            if let Err(e) = b.publish(si) {
                warn!("{e:#}");
            }
        }
        b
    }

    pub(super) fn now(&self) -> Duration {
        self.life.started.elapsed()
    }

    /// Re-reads the configuration and applies it to the running data plane:
    /// services and backends are added, removed or changed in place, flows
    /// that stay valid are untouched, temperatures carry on. A new config
    /// that fails validation, or changes what only a restart can change,
    /// changes nothing.
    pub fn reload(&mut self) -> Result<String> {
        let reloader = self
            .life
            .reloader
            .clone()
            .context("this balancer has no configuration to reload")?;
        let mut lap = Laps::new();
        let new = reloader().context("reload refused, nothing changed")?;
        lap.mark("read");
        refuse_restart_only(&self.cfg, &new)?;
        super::preflight::backends(&new)
            .map_err(|e| new.placed(e))
            .context("reload refused, nothing changed")?;
        lap.mark("preflight");
        warn_mode_changes(&self.cfg, &new);
        let saved = self.snapshot();
        lap.mark("snapshot");
        // A service the reload leaves as it was (same settings, backends
        // and slots) keeps its huddle: windows, probes, rest, settledness.
        // Rebuilt, 65,536 backends took 42-310 ms and the next two ticks
        // judged every one of them (424-507 ms, then 113-129).
        let mut before: HashMap<String, (Service, Vec<u32>, ServiceHuddle)> =
            if new.huddle == self.cfg.huddle {
                let huddles = std::mem::take(&mut self.huddles);
                self.cfg
                    .services
                    .iter()
                    .zip(&self.dp.services)
                    .zip(huddles)
                    .map(|((s, slot), h)| (s.name(), (s.clone(), slot.backend_ids.clone(), h)))
                    .collect()
            } else {
                HashMap::new()
            };
        self.dp.reconcile(&new)?;
        lap.mark("reconcile");
        // Ids may now name other backends.
        self.hist_cache.clear();
        let now = self.now();
        let mut fresh = Vec::with_capacity(new.services.len());
        self.huddles = new
            .services
            .iter()
            .zip(&self.dp.services)
            .map(|(s, slot)| {
                let kept = before
                    .remove(&s.name())
                    .filter(|(was, ids, _)| was == s && *ids == slot.backend_ids);
                fresh.push(kept.is_none());
                match kept {
                    Some((_, _, h)) => h,
                    None => ServiceHuddle::new(s, &slot.backend_ids, &new.huddle, now),
                }
            })
            .collect();
        self.cfg = new;
        lap.mark("huddles");
        // Reconciling rewrote every backend without flags.
        self.moving.clear();
        self.restore_where(&saved, &fresh);
        lap.mark("restore");
        for si in 0..self.huddles.len() {
            self.publish(si)?;
        }
        lap.mark("publish");
        self.save_state();
        lap.mark("save");
        crate::sys::addresses::warm_neighbours(&self.backend_addrs());
        lap.mark("neighbours");
        let n: usize = self.cfg.services.iter().map(|s| s.backends.len()).sum();
        let msg = format!(
            "reloaded: {} service(s), {n} backend(s)",
            self.cfg.services.len()
        );
        info!("{msg}");
        debug!("reload took {}", lap.said());
        Ok(msg)
    }

    /// Every backend address, for neighbour resolution.
    #[must_use]
    pub fn backend_addrs(&self) -> Vec<SocketAddr> {
        self.cfg
            .services
            .iter()
            .flat_map(|s| s.backends.iter().copied())
            .collect()
    }

    /// Writes service `si`'s pass-over limits into the kernel when they
    /// moved by more than a millisecond (they follow the ring's p99).
    pub(super) fn tune(&mut self, si: usize) {
        let udp = self.cfg.services[si].proto == crate::config::Proto::Udp;
        let t = self.huddles[si].tuning(&self.cfg.huddle, udp);
        let id = self.dp.services[si].id;
        let close = |a: u64, b: u64| a.abs_diff(b) < 1_000_000;
        let last = self.tuned.get(&id).copied();
        if last.is_some_and(|l| {
            close(l.turn_skip_ns, t.turn_skip_ns) && close(l.syn_skip_ns, t.syn_skip_ns)
        }) {
            return;
        }
        match self.dp.set_tuning(id, t) {
            Ok(()) => {
                self.tuned.insert(id, t);
            }
            Err(e) => warn!(
                "writing the pass-over limits of {}: {e:#}",
                self.cfg.services[si].name()
            ),
        }
    }

    /// Writes service `si`'s inner ring into the kernel if it changed.
    pub(super) fn publish(&mut self, si: usize) -> Result<()> {
        let ring = self
            .leader_ring(si)
            .unwrap_or_else(|| self.huddles[si].ring());
        if ring != self.dp.services[si].ring {
            self.dp.swap_ring(si, &ring).with_context(|| {
                format!("swapping the ring of {}", self.cfg.services[si].name())
            })?;
        }
        Ok(())
    }

    /// (service, backend, address, how much a probe tells: `probing`) of
    /// every backend of a TCP service, for probes (a UDP service's
    /// protocol is unknown to us).
    #[must_use]
    pub fn probe_targets(&self) -> Vec<ProbeTarget> {
        let huddles = &self.huddles;
        let settings = &self.cfg.huddle;
        self.cfg
            .services
            .iter()
            .enumerate()
            .filter(|(_, s)| s.probe.kind != crate::config::ProbeKind::None)
            .flat_map(|(si, s)| {
                let needs = huddles
                    .get(si)
                    .map_or_else(Default::default, |h| h.needs_probes(settings));
                s.backends
                    .iter()
                    .enumerate()
                    .map(move |(bi, a)| ProbeTarget {
                        si,
                        bi,
                        addr: *a,
                        need: needs
                            .get(bi)
                            .copied()
                            .unwrap_or(crate::huddle::probing::Need::Now),
                        probe: s.probe.clone(),
                    })
            })
            .collect()
    }

    /// (service, backend, URL) of every backend with a metrics endpoint.
    #[must_use]
    /// (service, backend, metrics URL, the service's VIP address, whose
    /// agent figures the page may hold) of every backend with a URL.
    pub fn scrape_targets(&self) -> Vec<(usize, usize, String, String)> {
        let mut v = Vec::new();
        for (si, s) in self.cfg.services.iter().enumerate() {
            for (bi, o) in s.options.iter().enumerate() {
                if let Some(url) = &o.metrics {
                    v.push((si, bi, url.clone(), s.vip.ip().to_string()));
                }
            }
        }
        v
    }
}

/// A backend to probe: service `si`'s backend `bi` at `addr`, how much a
/// probe would tell, and the service's probe.
pub struct ProbeTarget {
    pub si: usize,
    pub bi: usize,
    pub addr: SocketAddr,
    pub need: crate::huddle::probing::Need,
    pub probe: std::sync::Arc<crate::config::Probe>,
}

impl ProbeTarget {
    /// Its planner key: the address, and which probe.
    #[must_use]
    pub fn key(&self) -> crate::huddle::probing::Key {
        (self.addr, std::sync::Arc::as_ptr(&self.probe) as usize)
    }
}

/// Refuses a reload that changes what only a restart can change.
fn refuse_restart_only(old: &Config, new: &Config) -> Result<()> {
    let fixed = [
        ("interface", old.interface == new.interface),
        ("snat_ips", old.snat_ips == new.snat_ips),
        ("snat_ips6", old.snat_ips6 == new.snat_ips6),
        ("nat_ports", old.nat_ports == new.nat_ports),
        (
            "flow_table_size",
            old.flow_table_size == new.flow_table_size,
        ),
        (
            "maglev_table_size",
            old.maglev_table_size == new.maglev_table_size,
        ),
        ("bgp", old.bgp == new.bgp),
        ("cluster", old.cluster == new.cluster),
        ("xdp_mode", old.xdp_mode == new.xdp_mode),
        ("pin_dir", old.pin_dir == new.pin_dir),
        ("control_socket", old.control_socket == new.control_socket),
        ("state_file", old.state_file == new.state_file),
        ("huddle.tick_ms", old.huddle.tick == new.huddle.tick),
        ("huddle.probe", old.huddle.probe == new.huddle.probe),
        ("huddle.listen", old.huddle.listen == new.huddle.listen),
        (
            "huddle.scrape_interval_ms",
            old.huddle.scrape_interval == new.huddle.scrape_interval,
        ),
        (
            "huddle.scrape_timeout_ms",
            old.huddle.scrape_timeout == new.huddle.scrape_timeout,
        ),
    ];
    if let Some((field, _)) = fixed.iter().find(|(_, same)| !same) {
        bail!(
            "reload refused, nothing changed: {field} cannot change while running; \
             restart `huddle run` instead (it takes over the data plane without dropping flows)"
        );
    }
    Ok(())
}

/// Warns of services whose mode a reload changes: their connections break.
fn warn_mode_changes(old: &Config, new: &Config) {
    for s in &new.services {
        if let Some(o) = old
            .services
            .iter()
            .find(|o| o.vip == s.vip && o.proto == s.proto)
        {
            if o.mode != s.mode {
                warn!(
                    "service {}: mode {} -> {}: its established connections break (their packets now reach the backends another way)",
                    s.name(),
                    o.mode,
                    s.mode
                );
            }
        }
    }
}

/// Time of each step of a long operation, for a debug line.
pub(crate) struct Laps {
    at: Instant,
    steps: Vec<(&'static str, Duration)>,
}

impl Laps {
    pub(crate) fn new() -> Laps {
        Laps {
            at: Instant::now(),
            steps: Vec::new(),
        }
    }

    /// The step `name` ended now.
    pub(crate) fn mark(&mut self, name: &'static str) {
        self.steps.push((name, self.at.elapsed()));
        self.at = Instant::now();
    }

    /// "name N ms, ..." of every step.
    pub(crate) fn said(&self) -> String {
        let parts: Vec<String> = self
            .steps
            .iter()
            .map(|(n, d)| format!("{n} {} ms", d.as_millis()))
            .collect();
        parts.join(", ")
    }
}
