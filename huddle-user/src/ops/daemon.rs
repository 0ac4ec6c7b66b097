//! `huddle run`: validate, load, program, attach, serve the control socket,
//! and on SIGINT/SIGTERM detach and undo everything.

use crate::{
    config::Config,
    control::{Reply, Request, MAX_REQUEST},
    dataplane::{self, Dataplane},
    host,
    huddle::ServiceHuddle,
    rotation::Place,
    status::{counters, BackendStatus, RotationEvent, ServiceStatus, Status},
};
use crate::{
    state::{self, Saved, SavedBackend, SavedService},
    thermal,
};
use anyhow::{bail, Context, Result};
use huddle_common::{backend_flags, Pulse};
use std::net::Ipv4Addr;
use std::{
    collections::{HashSet, VecDeque},
    net::SocketAddr,
    os::unix::net::UnixStream as StdUnixStream,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{TcpListener, UnixListener, UnixStream},
    signal::unix::{signal, SignalKind},
};
use tracing::{debug, info, warn};

/// How often backend neighbours are refreshed in the kernel's cache.
const NEIGHBOUR_REFRESH: Duration = Duration::from_secs(15);

/// The running balancer's state, behind one lock.
pub struct Balancer {
    pub dp: Dataplane,
    pub cfg: Config,
    /// One per service, parallel to `cfg.services`.
    pub huddles: Vec<ServiceHuddle>,
    /// Recent rotations, newest last.
    pub events: VecDeque<RotationEvent>,
    /// Backends whose flows the kernel is moving off (marked dead).
    moving: HashSet<u32>,
    started: Instant,
    /// Told when an operator asks the daemon to stop and remove everything.
    pub stop: Arc<tokio::sync::Notify>,
    /// Set with `stop`: remove the data plane on the way out.
    pub remove_on_exit: bool,
    /// Sysctl values from before the first start, kept in the state file.
    pub sysctl_originals: Vec<(PathBuf, String)>,
    /// Re-reads the configuration (file and flags) for a reload.
    pub reloader: Option<Reloader>,
    /// Things about the data plane an operator must know (shown by
    /// `huddle status`): how it was attached and why, pins that do not
    /// outlive the daemon, a mode that forwards nothing.
    pub notes: Vec<String>,
    /// Start-up check that transmitted frames get answers.
    watch: Option<TxWatch>,
    /// Per backend id: early NAT tuple reuses counted so far, and whether
    /// they are being reported (one line when they start, one when they
    /// stop).
    nat_reuse: std::collections::HashMap<u32, (u64, bool)>,
    /// Pass-over limits last written, per service id.
    tuned: std::collections::HashMap<u32, huddle_common::Tuning>,
    /// The member of `[cluster]` whose rings this balancer takes (`None`:
    /// it decides its own), and what the poll last found wrong.
    pub leader: Option<crate::peers::Leader>,
    cluster_note: Option<String>,
    /// The flows this balancer shares with its cluster (`/flows`), and
    /// what the last exchange did (see `handoff`).
    pub shared_flows: Arc<crate::handoff::FlowsAnswer>,
    handoff_note: Option<String>,
    /// The other balancers' readings, added to this one's (see `pooled`),
    /// and what the last poll found.
    pool: crate::pooled::Pool,
    pool_note: Option<String>,
    /// Per service: when it was last seen in panic mode.
    last_panic: std::collections::HashMap<usize, Instant>,
    /// Announces the VIPs through bird (with `[bgp]`); its own lock, so
    /// a slow bird never holds up a tick or `huddle status`.
    pub bgp: Option<Arc<Mutex<crate::bgp::Announcer>>>,
}

/// SYNs sent toward backends and answers translated at the first tick, to
/// tell an attach mode that loses what it transmits (SYNs sent, nothing
/// ever answered) in the first seconds.
#[derive(Clone, Copy)]
struct TxWatch {
    sent: u64,
    answered: u64,
    /// Answered, or already reported: nothing more to watch.
    done: bool,
}

/// How long after start the daemon checks that sent frames are answered.
const TX_WATCH: Duration = Duration::from_secs(5);
/// SYNs that must go out unanswered before it says so.
const TX_WATCH_MIN_SENT: u64 = 20;

/// Produces a fresh, validated configuration.
pub type Reloader = Arc<dyn Fn() -> Result<Config> + Send + Sync>;

/// Rotations kept for `huddle status`.
const EVENTS_KEPT: usize = 50;

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
            .map(|b| Arc::new(Mutex::new(crate::bgp::Announcer::new(b))));
        let mut b = Balancer {
            dp,
            cfg,
            huddles,
            events: VecDeque::new(),
            moving: HashSet::new(),
            started: Instant::now(),
            stop: Arc::new(tokio::sync::Notify::new()),
            remove_on_exit: false,
            sysctl_originals: Vec::new(),
            reloader: None,
            notes: Vec::new(),
            watch: None,
            nat_reuse: std::collections::HashMap::new(),
            tuned: std::collections::HashMap::new(),
            last_panic: std::collections::HashMap::new(),
            leader: None,
            cluster_note: None,
            shared_flows: Arc::default(),
            handoff_note: None,
            pool: crate::pooled::Pool::default(),
            pool_note: None,
            bgp,
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

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Re-reads the configuration and applies it to the running data plane:
    /// services and backends are added, removed or changed in place, flows
    /// that stay valid are untouched, temperatures carry on. A new config
    /// that fails validation, or changes what only a restart can change,
    /// changes nothing.
    pub fn reload(&mut self) -> Result<String> {
        let reloader = self
            .reloader
            .clone()
            .context("this balancer has no configuration to reload")?;
        let new = reloader().context("reload refused, nothing changed")?;
        let old = &self.cfg;
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
            (
                "huddle.metrics_listen",
                old.huddle.metrics_listen == new.huddle.metrics_listen,
            ),
            (
                "huddle.metrics_interval_ms",
                old.huddle.metrics_interval == new.huddle.metrics_interval,
            ),
            (
                "huddle.metrics_timeout_ms",
                old.huddle.metrics_timeout == new.huddle.metrics_timeout,
            ),
        ];
        if let Some((field, _)) = fixed.iter().find(|(_, same)| !same) {
            bail!(
                "reload refused, nothing changed: {field} cannot change while running; \
                 restart `huddle run` instead (it takes over the data plane without dropping flows)"
            );
        }
        host::check_reachable(&new).context("reload refused, nothing changed")?;
        host::check_dsr(&new).context("reload refused, nothing changed")?;
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
        let saved = self.snapshot();
        self.dp.reconcile(&new)?;
        let now = self.now();
        self.huddles = new
            .services
            .iter()
            .zip(&self.dp.services)
            .map(|(s, slot)| ServiceHuddle::new(s, &slot.backend_ids, &new.huddle, now))
            .collect();
        self.cfg = new;
        // Reconciling rewrote every backend without flags.
        self.moving.clear();
        self.restore(&saved);
        for si in 0..self.huddles.len() {
            self.publish(si)?;
        }
        self.save_state();
        host::warm_neighbours(&self.backend_addrs());
        let n: usize = self.cfg.services.iter().map(|s| s.backends.len()).sum();
        let msg = format!(
            "reloaded: {} service(s), {n} backend(s)",
            self.cfg.services.len()
        );
        info!("{msg}");
        Ok(msg)
    }

    /// Writes the state file; a failure is logged, never fatal.
    pub fn save_state(&self) {
        self.save_state_and_walk(false);
    }

    /// `save_state`, and the NAT walk file with the TIME_WAIT tuples when
    /// `last` (see `save_nat_walk`).
    pub fn save_state_and_walk(&self, last: bool) {
        if let Err(e) = state::save(&self.cfg.state_file, &self.snapshot()) {
            warn!("{e:#}");
        }
        self.save_nat_walk(last);
    }

    /// Writes where the NAT walks stand (kept after `huddle stop`: see
    /// `state::NatWalk`); on the way out (`last`) also the tuples the
    /// backends hold in TIME_WAIT, with their timestamps, for a fresh
    /// start to check new SYNs against (a scan of the flow table).
    pub fn save_nat_walk(&self, last: bool) {
        let path = state::nat_walk_file(&self.cfg.state_file);
        let mut walk = self.dp.nat_walk();
        if last {
            walk.hints = self.dp.tw_hints(host::monotonic_ns());
        }
        if let Err(e) = state::save_nat_walk(&path, &walk) {
            warn!("{e:#}");
        }
    }

    /// Temperatures and places, for the state file.
    #[must_use]
    pub fn snapshot(&self) -> Saved {
        let now = self.now();
        let mut saved = Saved::new(&self.cfg.interface);
        saved.sysctls = self.sysctl_originals.clone();
        for (si, s) in self.cfg.services.iter().enumerate() {
            let h = &self.huddles[si];
            saved.services.push(SavedService {
                name: s.name(),
                backends: s
                    .backends
                    .iter()
                    .enumerate()
                    .map(|(bi, a)| {
                        let m = &h.engine.members[bi];
                        SavedBackend {
                            addr: a.to_string(),
                            temperature: m.temperature,
                            place: m.place,
                            drained: m.drained,
                            unhealthy: m.unhealthy.clone(),
                            strikes: m.strikes,
                            rotations: m.rotations,
                            rest_left_ms: m.rest_until.saturating_sub(now).as_millis() as u64,
                        }
                    })
                    .collect(),
            });
        }
        saved
    }

    /// Carries on from a saved state: temperatures, places, rests. Backends
    /// and services not in it start fresh.
    pub fn restore(&mut self, saved: &Saved) {
        let now = self.now();
        let mut n = 0;
        for (si, s) in self.cfg.services.iter().enumerate() {
            let Some(ss) = saved.services.iter().find(|x| x.name == s.name()) else {
                continue;
            };
            for (bi, a) in s.backends.iter().enumerate() {
                let Some(sb) = ss.backends.iter().find(|b| b.addr == a.to_string()) else {
                    continue;
                };
                let h = &mut self.huddles[si];
                let t = thermal::unit(sb.temperature);
                h.trackers[bi].temperature = t;
                h.trackers[bi].unhealthy = sb.unhealthy.clone();
                let m = &mut h.engine.members[bi];
                m.temperature = t;
                m.place = sb.place;
                m.drained = sb.drained;
                m.unhealthy = sb.unhealthy.clone();
                m.strikes = sb.strikes;
                m.rotations = sb.rotations;
                m.rest_until = now + Duration::from_millis(sb.rest_left_ms);
                n += 1;
            }
            // The engine's floor holds at once, whatever the file said.
            let _ = self.huddles[si].engine.tick(now);
        }
        info!("carried on the temperatures and places of {n} backend(s) from the last run");
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
    fn tune(&mut self, si: usize) {
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
    fn publish(&mut self, si: usize) -> Result<()> {
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

    /// This balancer's own kernel counters, per backend, for the other
    /// members (`/readings`).
    pub fn own_readings(&self) -> crate::pooled::ReadingsAnswer {
        let mut services = std::collections::BTreeMap::new();
        for (si, slot) in self.dp.services.iter().enumerate() {
            let readings = slot
                .backend_ids
                .iter()
                .zip(&slot.service.backends)
                .filter_map(|(id, addr)| {
                    let st = self.dp.backend_stats(*id).ok()?;
                    let ttfb = self.dp.latency(*id).ok()?;
                    let connect = self.dp.connect_latency(*id).unwrap_or_default();
                    Some(crate::pooled::reading(*addr, &st, &ttfb, &connect))
                })
                .collect();
            services.insert(self.cfg.services[si].name(), readings);
        }
        crate::pooled::ReadingsAnswer {
            fields: crate::pooled::fields(),
            services,
        }
    }

    /// Takes one poll of the other members' readings.
    pub fn pool_readings(
        &mut self,
        answers: Vec<(SocketAddr, Result<crate::pooled::ReadingsAnswer>)>,
    ) {
        let mut from = Vec::new();
        let mut passed = Vec::new();
        for (peer, a) in answers {
            match a {
                Ok(a) => {
                    let bad = self.pool.take(peer, &a);
                    if bad == 0 {
                        from.push(peer.to_string());
                    } else {
                        passed.push(format!("{peer}: {bad} unreadable backend readings"));
                    }
                }
                Err(e) => passed.push(format!("{peer}: {e:#}")),
            }
        }
        self.pool_note = Some(format!(
            "readings: this balancer's{}{}",
            if from.is_empty() {
                " alone".to_string()
            } else {
                format!(" with {}'s", from.join(", "))
            },
            if passed.is_empty() {
                String::new()
            } else {
                format!("; passed over {}", passed.join("; "))
            }
        ));
    }

    /// The rings this balancer's own huddle decides, by address.
    #[must_use]
    pub fn own_rings(&self) -> crate::peers::Rings {
        self.huddles
            .iter()
            .enumerate()
            .map(|(si, h)| {
                let slot = &self.dp.services[si];
                let addrs = h
                    .ring()
                    .iter()
                    .filter_map(|id| {
                        let j = slot.backend_ids.iter().position(|b| b == id)?;
                        slot.service.backends.get(j).copied()
                    })
                    .collect();
                (self.cfg.services[si].name(), addrs)
            })
            .collect()
    }

    /// Service `si`'s ring as the leader decided it, in this balancer's
    /// backend ids; `None` without a leader, or when its ring names no
    /// backend this balancer knows (never an empty ring from a peer).
    fn leader_ring(&self, si: usize) -> Option<Vec<u32>> {
        let leader = self.leader.as_ref()?;
        let slot = &self.dp.services[si];
        let ids: Vec<u32> = leader
            .rings
            .get(&self.cfg.services[si].name())?
            .iter()
            .filter_map(|a| {
                let j = slot.service.backends.iter().position(|b| b == a)?;
                slot.backend_ids.get(j).copied()
            })
            .collect();
        (!ids.is_empty()).then_some(ids)
    }

    /// Takes the result of a leader poll: follows `leader` (or decides
    /// alone), saying when that changes.
    pub fn follow(&mut self, leader: Option<crate::peers::Leader>, problems: &[String]) {
        let was = self.leader.as_ref().map(|l| l.addr);
        let now = leader.as_ref().map(|l| l.addr);
        if was != now {
            match now {
                Some(a) => info!(event = "cluster", "cluster: taking the rings of {a}"),
                None => info!(
                    event = "cluster",
                    "cluster: deciding the rings here (no earlier member answers{})",
                    if problems.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", problems.join("; "))
                    }
                ),
            }
        }
        self.cluster_note = Some(match (&leader, problems.is_empty()) {
            (Some(l), true) => format!("cluster: rings from {}", l.addr),
            (Some(l), false) => format!(
                "cluster: rings from {}; passed over {}",
                l.addr,
                problems.join("; ")
            ),
            (None, true) => "cluster: this balancer leads, its rings are the others'".into(),
            (None, false) => format!(
                "cluster: this balancer decides alone; passed over {}",
                problems.join("; ")
            ),
        });
        let changed = self.leader.as_ref().map(|l| &l.rings) != leader.as_ref().map(|l| &l.rings);
        self.leader = leader;
        // At once, not at the next tick: the rings disagree meanwhile.
        if changed {
            for si in 0..self.huddles.len() {
                if let Err(e) = self.publish(si) {
                    warn!("{e:#}");
                }
            }
        }
    }

    /// One huddle tick: read the kernel's counters, update temperatures,
    /// rotate, and swap changed rings in. Errors are logged, never fatal.
    pub fn tick(&mut self) {
        let now = self.now();
        let now_ns = host::monotonic_ns();
        let mut rotated = false;
        // SYNs sent and answers seen over all backends, for `watch_tx`.
        let mut tx = TxWatch {
            sent: 0,
            answered: 0,
            done: false,
        };
        for si in 0..self.huddles.len() {
            let hung_after = self.huddles[si].hung_after(&self.cfg.huddle);
            let service = self.cfg.services[si].name();
            for bi in 0..self.huddles[si].trackers.len() {
                let id = self.huddles[si].trackers[bi].id;
                let read = (|| -> Result<_> {
                    let mut pulse = self.dp.pulse(id)?;
                    if std::mem::take(&mut self.huddles[si].trackers[bi].clear_pulse) {
                        self.dp.clear_pulse(id)?;
                        pulse = Pulse::default();
                    }
                    let mut own = crate::pooled::Counts {
                        stats: self.dp.backend_stats(id)?,
                        ttfb: self.dp.latency(id)?,
                        connect: huddle_common::Latency::default(),
                    };
                    if self.cfg.services[si].mode.is_dsr() {
                        own.connect = self.dp.connect_latency(id)?;
                    }
                    Ok((own, pulse))
                })();
                match read {
                    Ok((own, pulse)) => {
                        let st = own.stats;
                        // The huddle judges from every balancer's samples.
                        let mut all = own;
                        let addr = self.cfg.services[si].backends[bi];
                        if let Some(peers) = self.pool.sum(&service, addr) {
                            all.add(peers);
                        }
                        if self.cfg.services[si].mode.is_dsr() {
                            self.huddles[si].trackers[bi].observe_connect(&all.connect);
                        }
                        tx.sent += st.syns;
                        // DSR replies bypass the balancer: a completed
                        // handshake is the proof that SYNs arrived.
                        tx.answered += if self.cfg.services[si].mode.is_dsr() {
                            st.syn_acks
                        } else {
                            st.pkts_from
                        };
                        self.watch_nat_reuse(si, bi, id, st.nat_reuse_early);
                        self.huddles[si].trackers[bi].observe(
                            &all.stats,
                            &all.ttfb,
                            &pulse,
                            now_ns,
                            &self.cfg.huddle,
                            hung_after,
                        );
                    }
                    Err(e) => warn!("reading counters of backend {id}: {e:#}"),
                }
            }
            let was_panic = self.huddles[si].engine.panic;
            let moves = self.huddles[si].step(&self.cfg.huddle, now);
            rotated |= !moves.is_empty();
            for m in moves {
                let backend = self.cfg.services[si].backends[m.member];
                let ev = RotationEvent {
                    at_s: now.as_secs_f64(),
                    service: service.clone(),
                    backend: backend.to_string(),
                    to: m.to,
                    reason: m.reason.to_string(),
                    temperature: m.temperature,
                };
                info!(
                    event = "rotation",
                    service = %service,
                    backend = %backend,
                    to = m.to.as_str(),
                    reason = %ev.reason,
                    temperature = m.temperature,
                    "rotation: {service} backend {backend} -> {} ring ({}), temperature {:.2}",
                    m.to.as_str(),
                    ev.reason,
                    m.temperature
                );
                self.events.push_back(ev);
                if self.events.len() > EVENTS_KEPT {
                    self.events.pop_front();
                }
            }
            let panic = self.huddles[si].engine.panic;
            if panic && !was_panic {
                warn!("{service}: panic mode: too few healthy backends; keeping the least hot ones in the ring");
            } else if was_panic && !panic {
                info!("{service}: panic mode over");
            }
            if let Err(e) = self.publish(si) {
                warn!("{e:#}");
            }
            self.tune(si);
            if self.cfg.huddle.move_flows_off_dead {
                self.mark_dead(si);
            }
        }
        // A restart must not undo a rotation: save it at once.
        if rotated {
            self.save_state();
        }
        if now < TX_WATCH + self.cfg.huddle.tick {
            self.watch_tx(now, tx);
        }
    }

    /// Says when new flows toward a backend start (and stop) getting NAT
    /// tuples used less than a TIME_WAIT ago: the backend may still hold
    /// the old connection, and then the client waits a retransmission.
    fn watch_nat_reuse(&mut self, si: usize, bi: usize, id: u32, count: u64) {
        let e = self.nat_reuse.entry(id).or_insert((count, false));
        let new = count.wrapping_sub(e.0);
        e.0 = count;
        let addr = self.cfg.services[si].backends[bi];
        let tuples = u64::from(self.dp.nat_ports.max - self.dp.nat_ports.min + 1)
            * self.dp.snat.len() as u64;
        if new > 0 && !e.1 {
            e.1 = true;
            warn!(
                event = "nat_reuse_early",
                backend = %addr,
                new_flows = new,
                "NAT tuples toward backend {addr} are being reused less than 60 s after their last use ({new} new flows this tick): more new connections a second toward it than {tuples} tuples / 60 s = {} a second; the oldest tuple goes first, but the backend may still hold it in TIME_WAIT (widen nat_ports or add snat_ips); counted in nat_reuse_early",
                tuples / 60
            );
        } else if new == 0 && e.1 {
            e.1 = false;
            info!(
                event = "nat_reuse_over",
                backend = %addr,
                "NAT tuples toward backend {addr} rest 60 s again before reuse"
            );
        }
    }

    /// In the first seconds: frames sent toward backends while not one
    /// answer came back means every backend is down or the attach mode
    /// loses transmitted frames; either way the operator must hear it.
    /// `cur`: the SYNs sent and answers seen so far, read by this tick.
    /// TCP only: a SYN always gets an answer (SYN-ACK or RST) from a live
    /// backend, while a UDP service may be one-way by design.
    fn watch_tx(&mut self, now: Duration, cur: TxWatch) {
        if self.watch.is_some_and(|w| w.done) {
            return;
        }
        let Some(first) = self.watch else {
            self.watch = Some(cur);
            return;
        };
        let sent = cur.sent.wrapping_sub(first.sent);
        if cur.answered != first.answered {
            self.watch = Some(TxWatch { done: true, ..cur });
            return;
        }
        if sent >= TX_WATCH_MIN_SENT && now >= TX_WATCH {
            let mode = self.dp.mode.map_or("detached", |m| m.as_str());
            let note = format!(
                "forwarding nothing: {sent} SYNs sent toward backends in the first {}s in {mode} mode and not one answer came back; either every backend is down, or this mode loses what it transmits (on a veth, native XDP_TX needs an XDP program on the peer and senders that compute checksums: try --xdp-mode generic)",
                TX_WATCH.as_secs()
            );
            warn!(event = "forwarding_nothing", mode, sent, "{note}");
            self.notes.push(note);
            self.watch = Some(TxWatch { done: true, ..cur });
        }
    }

    /// Flags backends that left for being unhealthy so the kernel moves
    /// their flows; unflags them once healthy.
    fn mark_dead(&mut self, si: usize) {
        // In panic mode (too few healthy backends), and for a while after,
        // nothing is moved: a balancer that finds most backends gone at
        // once is likelier cut off itself. Measured: a balancer whose link
        // was cut reset 43-45 of its connections when the link came back,
        // moving them off backends it had judged dead from its own
        // isolation (also when only panic mode itself held it back: the
        // panic ended a tick before the backends' probes passed again).
        if self.huddles[si].engine.panic {
            self.last_panic.insert(si, Instant::now());
        }
        let calm = self
            .last_panic
            .get(&si)
            .is_none_or(|t| t.elapsed() >= CALM_BEFORE_MOVING);
        for bi in 0..self.huddles[si].trackers.len() {
            let h = &self.huddles[si];
            let id = h.trackers[bi].id;
            let dead = calm && h.out_sick(bi) && h.trackers[bi].unhealthy.is_some();
            if dead == self.moving.contains(&id) {
                continue;
            }
            let addr = self.cfg.services[si].backends[bi];
            let flags = if dead { backend_flags::MOVE_FLOWS } else { 0 };
            match self.dp.set_backend_flags(id, addr, flags) {
                Ok(()) if dead => {
                    info!("moving existing flows off dead backend {addr}");
                    self.moving.insert(id);
                }
                Ok(()) => {
                    self.moving.remove(&id);
                }
                Err(e) => warn!("{e:#}"),
            }
        }
    }

    /// (service, backend, address) of every backend of a TCP service, for
    /// probes (a UDP service's protocol is unknown to us).
    #[must_use]
    pub fn probe_targets(&self) -> Vec<(usize, usize, SocketAddr)> {
        self.cfg
            .services
            .iter()
            .enumerate()
            .filter(|(_, s)| s.proto == crate::config::Proto::Tcp)
            .flat_map(|(si, s)| {
                s.backends
                    .iter()
                    .enumerate()
                    .map(move |(bi, a)| (si, bi, *a))
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

    pub fn status(&self) -> Result<Status> {
        let now = self.now();
        let mut services = Vec::new();
        for (si, slot) in self.dp.services.iter().enumerate() {
            let h = &self.huddles[si];
            let mut backends = Vec::new();
            let mut read = Vec::new();
            for (bi, (addr, id)) in slot
                .service
                .backends
                .iter()
                .zip(&slot.backend_ids)
                .enumerate()
            {
                let st = self.dp.backend_stats(*id)?;
                read.push(st);
                let t = &h.trackers[bi];
                let m = &h.engine.members[bi];
                let place = match (m.drained, m.place) {
                    (true, _) => "drained",
                    (false, Place::Inner) => "inner",
                    (false, Place::Outer) => "outer",
                };
                backends.push(BackendStatus {
                    addr: addr.to_string(),
                    id: *id,
                    place: place.into(),
                    in_ring: slot.ring.contains(id),
                    drained: m.drained,
                    temperature: t.temperature,
                    components: t.components,
                    latency_source: t.latency_source.into(),
                    rtt_ms: t
                        .agent
                        .as_ref()
                        .and_then(|a| a.bias_ms)
                        .or_else(|| t.rtt.as_ref().and_then(|r| r.p50_ms)),
                    agent_ttfb_ms: t.agent.as_ref().and_then(|a| a.ttfb_ms),
                    ack_clock_ms: t.agent.as_ref().and_then(|a| a.ack_ms),
                    samples: t.window.samples,
                    mean_ms: t.window.mean_ms,
                    p50_ms: t.window.p50_ms,
                    p99_ms: t.window.p99_ms,
                    probe_ms: t.probe.as_ref().map(|p| p.latency_ms),
                    probe_error: t.probe.as_ref().and_then(|p| p.error.clone()),
                    error_rate: t.error_rate,
                    cpu: t.host.cpu,
                    memory: t.host.memory,
                    host_note: match (&t.opts.metrics, &t.host_error) {
                        (None, _) => Some("no metrics URL: cpu and memory count as 0".into()),
                        (Some(_), Some(e)) => Some(e.clone()),
                        (Some(_), None) => None,
                    },
                    unhealthy: t.unhealthy.clone(),
                    weight: t.opts.weight,
                    rotations: m.rotations,
                    last_reason: m.last_reason.as_ref().map(ToString::to_string),
                    last_move_s_ago: m.moved_at.map(|at| now.saturating_sub(at).as_secs_f64()),
                    rest_left_s: (m.place == Place::Outer && !m.drained)
                        .then(|| m.rest_until.saturating_sub(now).as_secs_f64()),
                    active_flows: t.active_flows,
                    counters: counters(&st),
                });
            }
            let ring = slot
                .ring
                .iter()
                .filter_map(|id| slot.backend_ids.iter().position(|b| b == id))
                .map(|i| slot.service.backends[i].to_string())
                .collect();
            let name = slot.service.name();
            // What the kernel has, as `tune` last wrote it.
            let tuning = self.tuned.get(&slot.id).copied().unwrap_or_default();
            services.push(ServiceStatus {
                mode: slot.service.mode.to_string(),
                selection: slot.service.selection.to_string(),
                rotation: h.rotation,
                panic: h.engine.panic,
                ring_generation: slot.generation,
                ring,
                counters: counters(&self.dp.service_stats_from(slot.id, &read)?),
                hung_after_ms: h.hung_after(&self.cfg.huddle).as_secs_f64() * 1e3,
                pass_over_ms: tuning.turn_skip_ns as f64 / 1e6,
                pass_over_syn_ms: tuning.syn_skip_ns as f64 / 1e6,
                backends,
                recent: self
                    .events
                    .iter()
                    .filter(|e| e.service == name)
                    .cloned()
                    .collect(),
                name,
            });
        }
        Ok(Status {
            interface: self.cfg.interface.clone(),
            xdp_mode: self.dp.mode.map_or("detached", |m| m.as_str()).to_string(),
            program_id: self.dp.program_id(),
            snat: self
                .dp
                .snat
                .iter()
                .map(ToString::to_string)
                .chain(self.dp.snat6.iter().map(ToString::to_string))
                .collect::<Vec<_>>()
                .join(", "),
            nat_ports: self.dp.nat_ports.to_string(),
            uptime_s: now.as_secs_f64(),
            tick_ms: self.cfg.huddle.tick.as_secs_f64() * 1e3,
            services,
            global: counters(&self.dp.global_stats()?),
            notes: self
                .dp
                .mode_note
                .iter()
                .chain(&self.notes)
                .chain(&self.cluster_note)
                .chain(&self.handoff_note)
                .chain(&self.pool_note)
                .cloned()
                .collect(),
            bgp: self.bgp.as_ref().map(|b| lock(b).status()),
        })
    }

    /// The VIPs to announce now: those with a service whose ring holds a
    /// healthy backend, while the data plane is attached.
    fn vips_to_announce(&self) -> std::collections::BTreeSet<std::net::IpAddr> {
        if self.dp.mode.is_none() {
            return Default::default();
        }
        self.dp
            .services
            .iter()
            .zip(&self.huddles)
            .filter(|(slot, h)| {
                !slot.ring.is_empty() && h.trackers.iter().any(|t| t.unhealthy.is_none())
            })
            .map(|(slot, _)| slot.service.vip.ip())
            .collect()
    }

    /// Withdraws every VIP (`drain`) or announces them again.
    fn drain_balancer(&mut self, drain: bool) -> Result<String> {
        let Some(bgp) = self.bgp.clone() else {
            bail!("this balancer announces nothing: its config has no [bgp]");
        };
        let want = self.vips_to_announce();
        let mut b = lock(&bgp);
        b.drained = drain;
        b.retry_now();
        log_bgp(b.sync(want));
        let st = b.status();
        if let Some(e) = st.error {
            bail!("bird did not take it: {e}");
        }
        Ok(if drain {
            "drained: every VIP withdrawn; the data plane keeps forwarding what still arrives, so its flows finish".into()
        } else {
            format!("announcing again: {}", st.announced.join(", "))
        })
    }

    /// Finds (service index, backend index) of `backend`, optionally within
    /// the service `vip` (`IP:PORT[/proto]`).
    fn locate(&self, backend: &str, vip: Option<&str>) -> Result<Vec<(usize, usize)>> {
        let addr = crate::config::parse_endpoint(backend)?;
        let vip = vip.map(crate::config::parse_vip).transpose()?;
        let found: Vec<_> = self
            .cfg
            .services
            .iter()
            .enumerate()
            .filter(|(_, s)| vip.is_none_or(|(v, p)| s.vip == v && p.is_none_or(|p| p == s.proto)))
            .filter_map(|(si, s)| {
                s.backends
                    .iter()
                    .position(|b| *b == addr)
                    .map(|bi| (si, bi))
            })
            .collect();
        if found.is_empty() {
            bail!(
                "backend {addr} is not configured{}",
                vip.map_or(String::new(), |(v, _)| format!(" for {v}"))
            );
        }
        Ok(found)
    }

    /// Drains (`drain = true`) or restores a backend, swapping the affected
    /// rings. Refuses to empty a ring.
    pub fn set_drained(&mut self, backend: &str, vip: Option<&str>, drain: bool) -> Result<String> {
        let targets = self.locate(backend, vip)?;
        if drain {
            for &(si, bi) in &targets {
                if self.huddles[si].engine.inner() == [bi] {
                    bail!(
                        "refusing to drain the last backend of {}",
                        self.cfg.services[si].name()
                    );
                }
            }
        }
        let now = self.now();
        for &(si, bi) in &targets {
            self.huddles[si].engine.set_drained(bi, drain, now);
            self.publish(si)?;
        }
        self.save_state();
        let verb = if drain { "drained" } else { "restored" };
        let msg = format!("{backend} {verb} in {} service(s)", targets.len());
        info!("{msg}");
        Ok(msg)
    }

    fn handle(&mut self, req: Request) -> Reply {
        let result = match req {
            Request::Status => self.status().map(|s| Reply {
                ok: true,
                error: None,
                status: Some(s),
                message: None,
            }),
            Request::Drain { backend, vip } => self
                .set_drained(&backend, vip.as_deref(), true)
                .map(Reply::message),
            Request::Undrain { backend, vip } => self
                .set_drained(&backend, vip.as_deref(), false)
                .map(Reply::message),
            Request::Reload => self.reload().map(Reply::message),
            Request::DrainBalancer { undo } => self.drain_balancer(!undo).map(Reply::message),
            Request::Stop => {
                self.remove_on_exit = true;
                self.stop.notify_one();
                Ok(Reply::message(format!(
                    "stopping: detaching from {} and removing its pinned maps",
                    self.cfg.interface
                )))
            }
        };
        result.unwrap_or_else(|e| Reply::error(&e))
    }
}

fn log_bgp(r: Option<std::result::Result<String, String>>) {
    match r {
        Some(Ok(m)) => info!(event = "bgp", "{m}"),
        Some(Err(m)) => warn!(event = "bgp", "{m}"),
        None => {}
    }
}

/// Asks the earlier members of `[cluster]` for their rings once a tick,
/// off the balancer's lock.
async fn follower(shared: Arc<Mutex<Balancer>>, cluster: crate::config::Cluster, every: Duration) {
    let mut t = tokio::time::interval(every);
    // A member that does not answer costs at most this much of a poll.
    let timeout = every.min(Duration::from_millis(200));
    loop {
        t.tick().await;
        let (leader, problems) =
            crate::peers::find_leader(&cluster.members, cluster.me, timeout).await;
        lock(&shared).follow(leader, &problems);
    }
}

/// Polls every other member of `[cluster]` for its readings once a tick,
/// all at once and off the lock (a dead member costs a timeout, not a
/// tick).
async fn pool(shared: Arc<Mutex<Balancer>>, cluster: crate::config::Cluster, every: Duration) {
    let mut t = tokio::time::interval(every);
    let timeout = every.min(Duration::from_millis(200));
    loop {
        t.tick().await;
        let mut set = tokio::task::JoinSet::new();
        for (i, m) in cluster.members.iter().enumerate() {
            if i != cluster.me {
                let m = *m;
                set.spawn(async move { (m, crate::pooled::fetch(m, timeout).await) });
            }
        }
        let mut answers = Vec::new();
        while let Some(r) = set.join_next().await {
            if let Ok(a) = r {
                answers.push(a);
            }
        }
        answers.sort_by_key(|(m, _)| *m);
        lock(&shared).pool_readings(answers);
    }
}

/// Sum of the services' ring generations: moves whenever a ring does.
fn ring_swaps(bal: &Balancer) -> u64 {
    bal.dp.services.iter().map(|s| s.generation).sum()
}

/// Shares flows with the other members of `[cluster]`: lists this
/// balancer's for `/flows`, and writes each peer's into the flow table.
/// The flow table is scanned on a blocking thread, off the lock.
async fn handoff(
    shared: Arc<Mutex<Balancer>>,
    cluster: crate::config::Cluster,
    book: crate::handoff::FlowBook,
) {
    let mut t = tokio::time::interval(crate::handoff::QUICK / 2);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = Duration::from_millis(500);
    let mut book = Some(book);
    let mut pace = crate::handoff::Pace::default();
    let start = tokio::time::Instant::now();
    loop {
        t.tick().await;
        let swaps = ring_swaps(&lock(&shared));
        if !pace.due(start.elapsed(), swaps) {
            continue;
        }
        let tables = lock(&shared).dp.handoff_tables();
        if tables.is_empty() {
            continue;
        }
        let peers: Vec<SocketAddr> = cluster
            .members
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != cluster.me)
            .map(|(_, m)| *m)
            .collect();
        let mut answers = Vec::new();
        for p in &peers {
            answers.push((*p, crate::handoff::fetch(*p, timeout).await));
        }
        let Some(b) = book.take() else { return };
        let done = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let (mine, truncated) = b.scan(&tables);
            let mut b = b;
            let now = host::monotonic_ns();
            let mut parts = Vec::new();
            for (p, a) in answers {
                match a {
                    Ok(a) => {
                        let got = b.adopt(p, &a.flows, &tables, now);
                        parts.push(format!("{p}: {}", got.held));
                    }
                    Err(e) => parts.push(format!("{p}: no answer, its last list kept ({e:#})")),
                }
            }
            (b, mine, truncated, parts, started.elapsed())
        })
        .await;
        let Ok((b, mine, truncated, parts, scanned_in)) = done else {
            warn!("flow sharing with the cluster stopped");
            return;
        };
        pace.scanned(scanned_in);
        book = Some(b);
        let mut bal = lock(&shared);
        bal.handoff_note = Some(format!(
            "handoff: shares {}{} flows its Maglev tables no longer explain; holds peers' ({})",
            mine.len(),
            if truncated { " (the first)" } else { "" },
            parts.join("; ")
        ));
        bal.shared_flows = Arc::new(crate::handoff::FlowsAnswer {
            flows: mine,
            truncated,
        });
    }
}

/// Keeps bird's announcements in line with the balancer's state, once a
/// tick, off the balancer's lock (bird may be slow or gone).
async fn announcer(
    shared: Arc<Mutex<Balancer>>,
    bgp: Arc<Mutex<crate::bgp::Announcer>>,
    every: Duration,
) {
    let mut t = tokio::time::interval(every);
    loop {
        t.tick().await;
        let want = lock(&shared).vips_to_announce();
        let bgp = bgp.clone();
        let _ = tokio::task::spawn_blocking(move || log_bgp(lock(&bgp).sync(want))).await;
    }
}

/// After a service's panic mode, flows stay on backends judged dead this
/// long: the balancer itself was likelier the one cut off.
const CALM_BEFORE_MOVING: Duration = Duration::from_secs(10);

/// How long the data plane keeps forwarding after the VIPs are withdrawn
/// on the way out: the router's update takes milliseconds (measured
/// 0.3 s from the file's write to the router's FIB, bird 2.0.12).
const WITHDRAW_GRACE: Duration = Duration::from_secs(1);

/// Claims the control socket path, refusing if a live daemon owns it.
fn bind_control(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        if StdUnixStream::connect(path).is_ok() {
            bail!(
                "a balancer already answers on {} (stop it first)",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("binding control socket {}", path.display()))
}

/// Removes the control socket when dropped.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs the balancer until SIGINT or SIGTERM (or `huddle stop`); SIGHUP
/// reloads the configuration through `reloader`.
pub async fn run(cfg: Config, reloader: Option<Reloader>) -> Result<()> {
    host::check_privileges()?;
    let ifindex = host::ifindex(&cfg.interface)?;
    let snat_family = |v6: bool| {
        cfg.services
            .iter()
            .any(|s| s.mode == crate::config::Mode::Snat && s.vip.is_ipv6() == v6)
    };
    let snat: Vec<Ipv4Addr> = if cfg.snat_ips.is_empty() {
        match host::interface_ipv4(&cfg.interface)? {
            Some(ip) => vec![ip],
            None if !snat_family(false) => Vec::new(),
            None => bail!(
                "interface {} has no IPv4 address; pass --snat-ip",
                cfg.interface
            ),
        }
    } else {
        let local = host::ipv4_addrs()?;
        for ip in &cfg.snat_ips {
            if !local.iter().any(|(_, a)| a == ip) {
                bail!(
                    "snat_ips: {ip} is not an address of this host, so backends' replies to it would not reach the balancer; add it (`ip addr add {ip}/32 dev {}`) or leave it out",
                    cfg.interface
                );
            }
        }
        cfg.snat_ips.clone()
    };
    let ipip4 = cfg
        .services
        .iter()
        .any(|s| s.mode == crate::config::Mode::DsrIpip && s.vip.is_ipv4());
    if ipip4 && snat.is_empty() && cfg.encap_prefix.is_none() {
        bail!(
            "interface {} has no IPv4 address for the outer source of dsr-ipip packets; set encap_prefix",
            cfg.interface
        );
    }
    let snat6: Vec<std::net::Ipv6Addr> = if cfg.snat_ips6.is_empty() {
        match host::interface_ipv6(&cfg.interface)? {
            _ if !snat_family(true) => Vec::new(),
            Some(ip) => vec![ip],
            None => bail!(
                "interface {} has no global IPv6 address for the IPv6 services' source NAT; add one or set snat_ips6",
                cfg.interface
            ),
        }
    } else {
        let local = host::ipv6_addrs()?;
        for ip in &cfg.snat_ips6 {
            if !local.iter().any(|(_, a)| a == ip) {
                bail!(
                    "snat_ips6: {ip} is not an address of this host, so backends' replies to it would not reach the balancer; add it (`ip addr add {ip}/128 dev {}`) or leave it out",
                    cfg.interface
                );
            }
        }
        cfg.snat_ips6.clone()
    };
    let ephemeral = host::ephemeral_ports()?;
    if cfg.nat_ports.overlaps(&ephemeral) {
        bail!(
            "nat_ports {} overlap the kernel's ephemeral ports {ephemeral} (net.ipv4.ip_local_port_range); \
             choose --nat-ports outside them so NAT never collides with the host's own connections",
            cfg.nat_ports
        );
    }
    for s in &cfg.services {
        if snat.iter().any(|a| s.vip.ip() == *a)
            && (cfg.nat_ports.min..=cfg.nat_ports.max).contains(&s.vip.port())
        {
            bail!(
                "VIP {} lies in the SNAT address's NAT port range {}",
                s.name(),
                cfg.nat_ports
            );
        }
    }
    let listener = bind_control(&cfg.control_socket)?;
    let _socket_file = SocketFile(cfg.control_socket.clone());
    let metrics_listener = match cfg.huddle.metrics_listen {
        Some(addr) => Some(TcpListener::bind(addr).await.with_context(|| {
            format!("binding the metrics endpoint {addr} (set huddle.metrics_listen, or \"off\")")
        })?),
        None => None,
    };

    host::check_reachable(&cfg)?;
    host::check_dsr(&cfg)?;
    let pins = cfg
        .pin_dir
        .clone()
        .unwrap_or_else(|| host::default_pin_dir(&cfg.interface));
    let place = host::pin_place(&pins)?;
    if let Some(n) = place.note.as_ref().filter(|_| place.survives) {
        info!("{n}");
    }
    let shown = pins.clone();
    let pins = place.dir.clone();
    let saved = state::load(&cfg.state_file);
    // A start that fails must leave nothing behind: pins it created go.
    let existed = pins.join(huddle_common::maps::FLOWS).exists();
    let started = (|| -> Result<_> {
        let resume = state::load_nat_walk(&state::nat_walk_file(&cfg.state_file));
        let mut dp = Dataplane::load(&cfg, &snat, &snat6, Some(&pins), resume)?;
        let ipip6 = cfg
            .services
            .iter()
            .any(|s| s.mode == crate::config::Mode::DsrIpip && s.vip.is_ipv6());
        if ipip6 {
            let src = host::interface_ipv6(&cfg.interface)?.with_context(|| {
                format!(
                    "interface {} has no global IPv6 address for the outer source of dsr-ipip IPv6 packets",
                    cfg.interface
                )
            })?;
            dp.set_encap6(src)?;
        }
        let sysctls = host::Sysctls::apply(
            &cfg.interface,
            saved
                .as_ref()
                .map(|s| s.sysctls.clone())
                .unwrap_or_default(),
            cfg.services.iter().any(|s| s.vip.is_ipv6()),
        )?;
        let mut balancer = Balancer::new(dp, cfg.clone(), saved.as_ref());
        host::warm_neighbours(&balancer.backend_addrs());
        let mode = balancer.dp.attach(ifindex, cfg.xdp_mode)?;
        Ok((balancer, sysctls, mode))
    })();
    let (balancer, mut sysctls, mode) = match started {
        Ok(s) => s,
        Err(e) => {
            if !existed {
                let _ = dataplane::unpin(&pins);
            }
            return Err(e);
        }
    };
    let adopted = balancer.dp.adopted;
    if adopted {
        info!(
            "took over the running data plane on {} (pinned under {}): flows, NAT entries and counters carry on",
            cfg.interface,
            shown.display()
        );
    }
    info!(
        "attached to {} in {} mode; SNAT {}, NAT ports {}; control socket {}; pinned under {}",
        cfg.interface,
        mode.as_str(),
        snat.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        cfg.nat_ports,
        cfg.control_socket.display(),
        shown.display()
    );
    host::sd_notify(&format!(
        "READY=1\nSTATUS=attached to {} in {} mode",
        cfg.interface,
        mode.as_str()
    ));
    let mut balancer = balancer;
    if let Some(n) = place.note.clone().filter(|_| !place.survives) {
        balancer.notes.push(n);
    }
    balancer.sysctl_originals = sysctls.saved.clone();
    balancer.reloader = reloader;
    balancer.save_state();
    for s in &cfg.services {
        info!("service {} -> {} backends", s.name(), s.backends.len());
    }
    let backends = balancer.backend_addrs();
    let h = &cfg.huddle;
    info!(
        "huddle: rotation {}, tick {:?}, heat {} cool {}, min inner {}, {} probes every {:?}",
        if h.rotation {
            "on"
        } else {
            "off (round robin)"
        },
        h.tick,
        h.rotation_params.heat,
        h.rotation_params.cool,
        h.rotation_params.min_inner,
        match h.probe.kind {
            crate::config::ProbeKind::Tcp => "TCP".to_string(),
            crate::config::ProbeKind::Http => format!("HTTP GET {}", h.probe.path),
        },
        h.probe.interval
    );
    let stop = balancer.stop.clone();
    let sweeper = balancer.dp.take_sweeper();
    let flow_book = match balancer.dp.flow_book() {
        Ok(b) => Some(b),
        Err(e) => {
            warn!("no flow sharing with the cluster: {e:#}");
            None
        }
    };
    let bgp = balancer.bgp.clone();
    let shared = Arc::new(Mutex::new(balancer));

    let mut tasks = vec![
        tokio::spawn(serve(listener, shared.clone())),
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(NEIGHBOUR_REFRESH);
            loop {
                tick.tick().await;
                host::warm_neighbours(&backends);
            }
        }),
        tokio::spawn(ticker(shared.clone(), cfg.huddle.tick)),
        tokio::spawn(saver(shared.clone())),
        tokio::spawn(sweep_idle(shared.clone(), sweeper)),
        tokio::spawn(prober(shared.clone(), cfg.huddle.probe.clone())),
        tokio::spawn(scraper(
            shared.clone(),
            cfg.huddle.metrics_interval,
            cfg.huddle.metrics_timeout,
        )),
    ];
    if let Some(c) = cfg.cluster.clone() {
        tasks.push(tokio::spawn(follower(
            shared.clone(),
            c.clone(),
            cfg.huddle.tick,
        )));
        tasks.push(tokio::spawn(pool(
            shared.clone(),
            c.clone(),
            cfg.huddle.tick,
        )));
        if let Some(book) = flow_book {
            tasks.push(tokio::spawn(handoff(shared.clone(), c, book)));
        }
    }
    if let Some(b) = &bgp {
        tasks.push(tokio::spawn(announcer(
            shared.clone(),
            b.clone(),
            cfg.huddle.tick,
        )));
    }
    if let Some(l) = metrics_listener {
        info!("Prometheus metrics on http://{}/metrics", l.local_addr()?);
        let shared = shared.clone();
        tasks.push(tokio::spawn(crate::http::serve(l, move |path| {
            let shared = shared.clone();
            async move { crate::metrics::route(&shared, &path) }
        })));
    }

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => { info!("SIGTERM"); break; }
            _ = int.recv() => { info!("SIGINT"); break; }
            () = stop.notified() => { info!("stop requested"); break; }
            _ = hup.recv() => {
                info!("SIGHUP: reloading the configuration");
                host::sd_notify("RELOADING=1");
                match lock(&shared).reload() {
                    Ok(m) => info!(event = "reload", "{m}"),
                    Err(e) => warn!(event = "reload_refused", error = %format!("{e:#}"), "{e:#}"),
                }
                host::sd_notify("READY=1");
            }
        }
    }
    host::sd_notify("STOPPING=1");
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        let _ = t.await;
    }
    let remove = cfg.detach_on_exit || lock(&shared).remove_on_exit;
    if !remove && place.survives {
        lock(&shared).save_state_and_walk(true);
        sysctls.keep();
        info!(
            "exiting; the data plane keeps running on {} (pinned under {}); `huddle run` again takes it over, `huddle stop --iface {}` removes it",
            cfg.interface,
            shown.display(),
            cfg.interface
        );
        return Ok(());
    }
    if !remove {
        info!(
            "exiting; the pins die with this process's mount namespace, so the data plane on {} goes with it",
            cfg.interface
        );
    }
    // The router must stop sending here before the data plane goes.
    if let Some(b) = &bgp {
        let withdrawn = lock(b).withdraw_all();
        match withdrawn {
            Ok(()) => {
                info!(
                    event = "bgp",
                    "bgp: every VIP withdrawn; removing the data plane in {} ms",
                    WITHDRAW_GRACE.as_millis()
                );
                tokio::time::sleep(WITHDRAW_GRACE).await;
            }
            Err(e) => warn!(event = "bgp", "bgp: withdrawing before removal: {e:#}"),
        }
    }
    lock(&shared).save_nat_walk(true);
    // Unpin first, then close our descriptors: the link goes with the last.
    match dataplane::unpin(&pins) {
        Ok(n) => info!("removed {n} pinned objects under {}", shown.display()),
        Err(e) => warn!("{e:#}"),
    }
    match Arc::try_unwrap(shared) {
        Ok(m) => drop(m.into_inner()),
        Err(_) => warn!("control connections still open; the program detaches as they close"),
    }
    drop(sysctls);
    let _ = std::fs::remove_file(&cfg.state_file);
    info!(
        "detached from {}; maps freed and sysctls restored",
        cfg.interface
    );
    Ok(())
}

/// Writes the state file every second (and `tick` after any rotation),
/// and moves the next-hop generation on so every CPU asks the FIB again.
async fn saver(shared: Arc<Mutex<Balancer>>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut unresolved = 0;
    loop {
        tick.tick().await;
        let mut b = lock(&shared);
        b.save_state();
        if let Err(e) = b.dp.refresh_next_hops() {
            warn!("{e:#}");
        }
        // L2 DSR cannot hand a packet to the kernel to resolve its next
        // hop (the kernel would route it by its VIP): resolve it here.
        if let Ok(g) = b.dp.global_stats() {
            if g.drop_no_neigh != unresolved {
                unresolved = g.drop_no_neigh;
                host::warm_neighbours(&b.backend_addrs());
            }
        }
    }
}

/// Every second, removes the established UDP flows silent past their
/// service's `udp_idle_ms` (on a blocking thread, without the lock: a
/// large flow table takes a while to walk).
async fn sweep_idle(shared: Arc<Mutex<Balancer>>, sweeper: Option<crate::dataplane::Sweeper>) {
    let Some(mut sweeper) = sweeper else {
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let idle: std::collections::HashMap<u32, u64> = {
            let b = lock(&shared);
            b.cfg
                .services
                .iter()
                .zip(&b.dp.services)
                .filter(|(s, _)| s.proto == crate::config::Proto::Udp)
                .map(|(s, slot)| (slot.id, s.udp_idle.as_nanos() as u64))
                .collect()
        };
        if idle.is_empty() {
            continue;
        }
        let now = host::monotonic_ns();
        let done = tokio::task::spawn_blocking(move || {
            let r = sweeper.sweep(now, &idle);
            (sweeper, r)
        })
        .await;
        match done {
            Ok((s, r)) => {
                sweeper = s;
                match r {
                    Ok(0) => {}
                    Ok(n) => debug!("removed {n} idle UDP flows"),
                    Err(e) => warn!("sweeping idle UDP flows: {e:#}"),
                }
            }
            Err(e) => {
                warn!("the idle UDP sweep stopped: {e}");
                return;
            }
        }
    }
}

/// Stops the balancer of `cfg`'s interface: through its daemon if one
/// answers, else by removing what a daemon left pinned. Returns what was
/// done.
pub fn stop(socket: &Path, pins: &Path, state_file: &Path) -> Result<String> {
    if let Ok(reply) = crate::control::call(socket, &Request::Stop) {
        if !reply.ok {
            bail!("{}", reply.error.unwrap_or_default());
        }
        // Wait for the daemon to finish (it removes its socket last).
        for _ in 0..100 {
            if !socket.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        return Ok(reply.message.unwrap_or_default());
    }
    let saved = state::load(state_file);
    let n = dataplane::unpin(&host::host_pin_dir(pins).unwrap_or_else(|| pins.to_path_buf()))?;
    let mut restored = false;
    if let Some(s) = &saved {
        // The sysctls are per namespace: restore only in the daemon's own.
        if s.netns == state::netns_inode() {
            host::Sysctls::restore_saved(&s.sysctls);
            restored = true;
        } else {
            warn!(
                "the daemon ran in another network namespace: its sysctls on {} are left as they are",
                s.interface
            );
        }
    }
    let _ = std::fs::remove_file(state_file);
    if n == 0 && saved.is_none() {
        bail!(
            "nothing to stop: no daemon answers on {} and nothing is pinned under {}",
            socket.display(),
            pins.display()
        );
    }
    Ok(format!(
        "no daemon was running; removed {n} pinned objects under {} (the program detached){}",
        pins.display(),
        if restored {
            " and restored the sysctls"
        } else {
            ""
        }
    ))
}

/// Locks the balancer; a panic elsewhere must not stop the data plane's
/// control.
pub fn lock<T>(shared: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn ticker(shared: Arc<Mutex<Balancer>>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        lock(&shared).tick();
    }
}

/// Probes every backend concurrently, every `p.interval`.
async fn prober(shared: Arc<Mutex<Balancer>>, p: crate::config::Probe) {
    let mut tick = tokio::time::interval(p.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let targets = lock(&shared).probe_targets();
        let addrs: Vec<SocketAddr> = targets.iter().map(|t| t.2).collect();
        let results = crate::probe::probe_all(&addrs, &p).await;
        let mut b = lock(&shared);
        for ((si, bi, _), r) in targets.into_iter().zip(results) {
            b.huddles[si].trackers[bi].probed(r);
        }
    }
}

/// Largest metrics page read from a backend.
const MAX_METRICS_BYTES: usize = 4 << 20;

/// Scrapes every backend's metrics URL concurrently, every `every`.
async fn scraper(shared: Arc<Mutex<Balancer>>, every: Duration, timeout: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let targets = lock(&shared).scrape_targets();
        if targets.is_empty() {
            continue;
        }
        let mut set = tokio::task::JoinSet::new();
        for (i, (_, _, url, vip)) in targets.iter().enumerate() {
            let (url, vip) = (url.clone(), vip.clone());
            set.spawn(async move {
                let r = async {
                    let u = crate::http::Url::parse(&url)?;
                    let addr = tokio::time::timeout(timeout, crate::http::resolve(&u))
                        .await
                        .map_err(|_| anyhow::anyhow!("resolving {} timed out", u.host))??;
                    let resp = crate::http::get(addr, &u.host, &u.path, timeout, MAX_METRICS_BYTES)
                        .await?;
                    if resp.status != 200 {
                        bail!("HTTP status {}", resp.status);
                    }
                    let text = String::from_utf8_lossy(&resp.body);
                    let sample = crate::scrape::parse(&text);
                    if sample.cpu_total_s.is_none() && sample.mem_total.is_none() {
                        bail!("no usable node_cpu_seconds_total or node_memory_* values in the answer");
                    }
                    Ok((sample, crate::scrape::agent_ttfb(&text, &vip)))
                }
                .await;
                (
                    i,
                    r.map_err(|e: anyhow::Error| format!("metrics {url}: {e:#}")),
                )
            });
        }
        let mut results = Vec::new();
        while let Some(r) = set.join_next().await {
            if let Ok(r) = r {
                results.push(r);
            }
        }
        let mut b = lock(&shared);
        for (i, r) in results {
            let (si, bi, _, _) = &targets[i];
            let dsr = b.cfg.services[*si].mode.is_dsr();
            let min_samples = b.cfg.huddle.min_samples;
            let t = &mut b.huddles[*si].trackers[*bi];
            match r {
                Ok((sample, agent)) => {
                    t.host.update(sample);
                    t.host_error = None;
                    if dsr {
                        t.agent_scraped(agent, min_samples);
                    }
                }
                Err(e) => {
                    if t.host_error.is_none() {
                        warn!("{e}; its cpu and memory count as unknown (0)");
                    }
                    t.host.clear();
                    t.host_error = Some(e);
                }
            }
        }
    }
}

async fn serve(listener: UnixListener, shared: Arc<Mutex<Balancer>>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(client(stream, shared.clone()));
            }
            Err(e) => {
                warn!("control socket accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn client(stream: UnixStream, shared: Arc<Mutex<Balancer>>) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read.take(MAX_REQUEST as u64)).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(req) => lock(&shared).handle(req),
            Err(e) => Reply::error(&anyhow::anyhow!("bad request: {e}")),
        };
        let mut out = serde_json::to_string(&reply).unwrap_or_else(|_| "{\"ok\":false}".into());
        out.push('\n');
        if write.write_all(out.as_bytes()).await.is_err() {
            return;
        }
    }
}
