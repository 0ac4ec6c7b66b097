//! The daemon's side of a cluster: the rings it serves and follows, the
//! readings it pools, the flows it hands over, and the VIPs it announces.

use super::balancer::{lock, Balancer};
use crate::sys::host;
use anyhow::Result;
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};
use tracing::{info, warn};

impl Balancer {
    /// This balancer's own kernel counters, per backend, for the other
    /// members (`/readings`).
    pub fn own_readings(&self) -> crate::cluster::pooled::ReadingsAnswer {
        let mut services = std::collections::BTreeMap::new();
        for (si, slot) in self.dp.services.iter().enumerate() {
            let readings = slot
                .backend_ids
                .iter()
                .zip(&slot.service.backends)
                .filter_map(|(id, addr)| {
                    let st = self.dp.backend_stats(*id).ok()?;
                    let (ttfb, heavy) = self.dp.latency_parts(*id).ok()?;
                    let connect = self.dp.connect_latency(*id).unwrap_or_default();
                    Some(crate::cluster::pooled::reading(
                        *addr, &st, &ttfb, &heavy, &connect,
                    ))
                })
                .collect();
            services.insert(self.cfg.services[si].name(), readings);
        }
        crate::cluster::pooled::ReadingsAnswer {
            fields: crate::cluster::pooled::fields(),
            services,
        }
    }

    /// Takes one poll of the other members' readings.
    pub fn pool_readings(
        &mut self,
        answers: Vec<(SocketAddr, Result<crate::cluster::pooled::ReadingsAnswer>)>,
    ) {
        let mut from = Vec::new();
        let mut passed = Vec::new();
        let mut dropped = Vec::new();
        let answering = answers
            .iter()
            .filter(|(_, a)| a.is_ok())
            .map(|(p, _)| *p)
            .collect();
        let now = self.now();
        if let Some((until, why)) = self.cluster.members.take(answering, now) {
            info!(
                event = "cluster",
                "cluster: {why}; the rings hold for {:?} while connections move between balancers",
                until.saturating_sub(now)
            );
            for h in &mut self.huddles {
                h.engine.hold_until = until;
                h.dirty = true;
            }
            self.cluster.hold = Some((until, why));
        }
        for (peer, a) in answers {
            match a {
                Ok(mut a) => {
                    let unknown = self.known_readings(&mut a);
                    let bad = self.cluster.pool.take(peer, &a);
                    if unknown > 0 {
                        dropped.push(format!("{unknown} from {peer}"));
                    }
                    if bad == 0 {
                        from.push(peer.to_string());
                    } else {
                        passed.push(format!("{peer}: {bad} unreadable backend readings"));
                    }
                }
                Err(e) => passed.push(format!("{peer}: {e:#}")),
            }
        }
        self.cluster.pool_note = Some(format!(
            "readings: this balancer's{}{}{}",
            if from.is_empty() {
                " alone".to_string()
            } else {
                format!(" with {}'s", from.join(", "))
            },
            if passed.is_empty() {
                String::new()
            } else {
                format!("; passed over {}", passed.join("; "))
            },
            if dropped.is_empty() {
                String::new()
            } else {
                format!(
                    "; dropped readings of backends not configured here: {}",
                    dropped.join(", ")
                )
            }
        ));
    }

    /// Keeps of a peer's readings only those of services and backends this
    /// balancer has (the pool is keyed by them: a peer naming others would
    /// grow it without bound); how many went.
    fn known_readings(&self, a: &mut crate::cluster::pooled::ReadingsAnswer) -> usize {
        let before: usize = a.services.values().map(Vec::len).sum();
        let known: std::collections::HashMap<String, std::collections::HashSet<_>> = self
            .cfg
            .services
            .iter()
            .map(|s| (s.name(), s.backends.iter().copied().collect()))
            .collect();
        a.services.retain(|name, readings| {
            let Some(backends) = known.get(name) else {
                return false;
            };
            let mut seen = std::collections::HashSet::new();
            readings.retain(|r| backends.contains(&r.backend) && seen.insert(r.backend));
            true
        });
        before - a.services.values().map(Vec::len).sum::<usize>()
    }

    /// The rings this balancer's own huddle decides, by address.
    #[must_use]
    pub fn own_rings(&self) -> crate::cluster::peers::Rings {
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
    /// Each backend once (a ring naming one many times would give it all
    /// the traffic), and none this balancer has drained or found
    /// unhealthy itself: a peer decides temperatures, not what the
    /// operator or the local probes said.
    pub(super) fn leader_ring(&self, si: usize) -> Option<Vec<u32>> {
        let leader = self.cluster.leader.as_ref()?;
        let slot = &self.dp.services[si];
        // Backend j of the service is member j of its huddle.
        let members = &self.huddles[si].engine.members;
        let index: std::collections::HashMap<_, usize> = slot
            .service
            .backends
            .iter()
            .enumerate()
            .map(|(j, a)| (*a, j))
            .collect();
        let mut seen = std::collections::HashSet::new();
        let ids: Vec<u32> = leader
            .rings
            .get(&self.cfg.services[si].name())?
            .iter()
            .filter_map(|a| index.get(a).copied())
            .filter(|j| {
                let out = members
                    .get(*j)
                    .is_some_and(|m| m.drained || m.unhealthy.is_some());
                !out && seen.insert(*j)
            })
            .filter_map(|j| slot.backend_ids.get(j).copied())
            .collect();
        (!ids.is_empty()).then_some(ids)
    }

    /// Takes the result of a leader poll: follows `leader` (or decides
    /// alone), saying when that changes.
    pub fn follow(&mut self, leader: Option<crate::cluster::peers::Leader>, problems: &[String]) {
        let was = self.cluster.leader.as_ref().map(|l| l.addr);
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
        self.cluster.leader_note = Some(match (&leader, problems.is_empty()) {
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
        let changed =
            self.cluster.leader.as_ref().map(|l| &l.rings) != leader.as_ref().map(|l| &l.rings);
        let lost = if leader.is_none() {
            self.cluster.leader.take()
        } else {
            None
        };
        self.cluster.leader = leader;
        if let Some(lost) = lost {
            self.carry_on_from(&lost);
        }
        // At once, not at the next tick: the rings disagree meanwhile.
        if changed {
            for si in 0..self.huddles.len() {
                if let Err(e) = self.publish(si) {
                    warn!("{e:#}");
                }
            }
        }
    }

    /// Deciding from now on, after following `lost`: each huddle starts
    /// from the ring the cluster had (as this balancer took it), not from
    /// its own, which would move connections at the worst moment.
    fn carry_on_from(&mut self, lost: &crate::cluster::peers::Leader) {
        let now = self.now();
        for si in 0..self.huddles.len() {
            let Some(ring) = lost.rings.get(&self.cfg.services[si].name()) else {
                continue;
            };
            let backends = &self.cfg.services[si].backends;
            let inner: Vec<usize> = ring
                .iter()
                .filter_map(|a| backends.iter().position(|b| b == a))
                .collect();
            if inner.is_empty() {
                continue;
            }
            let moves = self.huddles[si].engine.follow(&inner, now);
            self.record_moves(si, moves, now);
        }
    }

    /// The VIPs to announce now: those with a service whose ring holds a
    /// healthy backend, while the data plane is attached.
    pub(super) fn vips_to_announce(&self) -> std::collections::BTreeSet<std::net::IpAddr> {
        if self.dp.attach.mode.is_none() {
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
}

pub(super) fn log_bgp(r: Option<std::result::Result<String, String>>) {
    match r {
        Some(Ok(m)) => info!(event = "bgp", "{m}"),
        Some(Err(m)) => warn!(event = "bgp", "{m}"),
        None => {}
    }
}

/// Asks the earlier members of `[cluster]` for their rings once a tick,
/// off the balancer's lock.
pub(super) async fn follower(
    shared: Arc<Mutex<Balancer>>,
    cluster: crate::config::Cluster,
    every: Duration,
) {
    let mut t = tokio::time::interval(every);
    // A member that does not answer costs at most this much of a poll.
    let timeout = every.min(Duration::from_millis(200));
    loop {
        t.tick().await;
        let (leader, problems) =
            crate::cluster::peers::find_leader(&cluster.members, cluster.me, &cluster.key, timeout)
                .await;
        lock(&shared).follow(leader, &problems);
    }
}

/// Polls every other member of `[cluster]` for its readings once a tick,
/// all at once and off the lock (a dead member costs a timeout, not a
/// tick).
pub(super) async fn pool(
    shared: Arc<Mutex<Balancer>>,
    cluster: crate::config::Cluster,
    every: Duration,
) {
    let mut t = tokio::time::interval(every);
    let timeout = every.min(Duration::from_millis(200));
    let key = std::sync::Arc::new(cluster.key.clone());
    loop {
        t.tick().await;
        let mut set = tokio::task::JoinSet::new();
        for (i, m) in cluster.members.iter().enumerate() {
            if i != cluster.me {
                let (m, key) = (*m, key.clone());
                set.spawn(
                    async move { (m, crate::cluster::pooled::fetch(m, &key, timeout).await) },
                );
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
pub(super) async fn handoff(
    shared: Arc<Mutex<Balancer>>,
    cluster: crate::config::Cluster,
    book: crate::cluster::handoff::FlowBook,
) {
    let mut t = tokio::time::interval(crate::cluster::handoff::QUICK / 2);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = Duration::from_millis(500);
    let mut book = Some(book);
    let mut pace = crate::cluster::handoff::Pace::default();
    let start = tokio::time::Instant::now();
    loop {
        t.tick().await;
        let swaps = ring_swaps(&lock(&shared));
        if !pace.due(start.elapsed(), swaps) {
            continue;
        }
        let tables = lock(&shared).dp.maglev_tables();
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
            answers.push((
                *p,
                crate::cluster::handoff::fetch(*p, &cluster.key, timeout).await,
            ));
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
                        if got.over_cap > 0 {
                            parts.push(format!(
                                "{p}: {} (and {} past the {} a peer may share, ignored)",
                                got.held,
                                got.over_cap,
                                crate::cluster::handoff::MAX_SHARED
                            ));
                        } else {
                            parts.push(format!("{p}: {}", got.held));
                        }
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
        bal.cluster.handoff_note = Some(format!(
            "handoff: shares {}{} flows its Maglev tables no longer explain; holds peers' ({})",
            mine.len(),
            if truncated { " (the first)" } else { "" },
            parts.join("; ")
        ));
        bal.cluster.shared_flows = Arc::new(crate::cluster::handoff::FlowsAnswer {
            flows: mine,
            truncated,
        });
    }
}

/// Keeps bird's announcements in line with the balancer's state, once a
/// tick, off the balancer's lock (bird may be slow or gone).
pub(super) async fn announcer(
    shared: Arc<Mutex<Balancer>>,
    bgp: Arc<Mutex<crate::cluster::bgp::Announcer>>,
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
pub(super) const CALM_BEFORE_MOVING: Duration = Duration::from_secs(10);

/// How long the data plane keeps forwarding after the VIPs are withdrawn
/// on the way out: the router's update takes milliseconds (measured
/// 0.3 s from the file's write to the router's FIB, bird 2.0.12).
pub(super) const WITHDRAW_GRACE: Duration = Duration::from_secs(1);
