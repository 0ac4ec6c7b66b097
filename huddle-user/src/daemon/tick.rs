//! One tick of the huddle: read every backend, judge, rotate, swap the
//! rings that changed, and watch what the data plane does.

use super::{
    balancer::{Balancer, TxWatch, EVENTS_KEPT, TICKS_TIMED, TX_WATCH, TX_WATCH_MIN_SENT},
    cluster::CALM_BEFORE_MOVING,
};
use crate::{status::RotationEvent, sys::host};
use anyhow::Result;
use huddle_common::{backend_flags, BackendStats, Latency, Pulse, LATENCY_BUCKETS};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// The histogram a quiet backend is observed with (`Tracker::quiet`: it is
/// not looked at).
static NO_SAMPLES: Latency = Latency {
    buckets: [0; LATENCY_BUCKETS],
};

/// What every backend of a service is read against in one tick.
#[derive(Clone, Copy)]
struct Reading<'a> {
    service: &'a str,
    now_ns: u64,
    hung_after: Duration,
}

impl Balancer {
    /// One huddle tick: read the kernel's counters, update temperatures,
    /// rotate, and swap changed rings in. Errors are logged, never fatal.
    pub fn tick(&mut self) {
        let began = Instant::now();
        self.tick_inner();
        let took = began.elapsed();
        if took > self.cfg.huddle.tick {
            let judged = self.huddles.len() - self.seen.passed_by;
            debug!(
                "a tick took {} ms (longer than the tick): {judged} of {} services judged",
                took.as_millis(),
                self.huddles.len()
            );
        }
        let timed = &mut self.seen.tick_took;
        if timed.len() == TICKS_TIMED {
            timed.pop_front();
        }
        timed.push_back(took);
    }

    fn tick_inner(&mut self) {
        let now = self.now();
        let plan = self.plan_reads();
        // Those of the services this tick reads into the last tick's read
        // (`settle`), or, with nothing kept, every backend's counters at
        // once (each alone if that fails).
        let marks = if plan.pass {
            self.marks_of(&plan.read)
        } else {
            Vec::new()
        };
        let mut kept = self.kept.take();
        self.snapshot = match self.dp.refresh_snapshot(&mut kept, &plan.ranges) {
            Ok(()) => kept,
            Err(e) => {
                debug!("backend counters read one by one: {e:#}");
                None
            }
        };
        let now_ns = host::monotonic_ns();
        let mut rotated = false;
        // SYNs sent and answers seen over all backends, for `watch_tx`.
        let mut tx = TxWatch {
            sent: 0,
            answered: 0,
            done: false,
        };
        self.seen.passed_by = 0;
        for si in 0..self.huddles.len() {
            if plan.pass && self.huddles[si].settled && !self.wakes(si, plan.read[si]) {
                self.seen.passed_by += 1;
                continue;
            }
            let service = self.cfg.services[si].name();
            let hung_after = self.huddles[si].hung_after_at(&self.cfg.huddle, now);
            for bi in 0..self.huddles[si].trackers.len() {
                let at = Reading {
                    service: &service,
                    now_ns,
                    hung_after,
                };
                self.observe_backend(si, bi, at, &mut tx);
                self.ask_if_suspected(si, bi);
            }
            let moved = self.rotate(si, now);
            rotated |= moved;
            if let Err(e) = self.publish(si) {
                warn!("{e:#}");
            }
            self.tune(si);
            if self.cfg.huddle.move_flows_off_dead {
                self.mark_dead(si);
            }
            // DSR rings judge on windows of their own (`observe_connect`):
            // never passed by.
            let dsr = self.cfg.services[si].mode.is_dsr();
            let h = &mut self.huddles[si];
            h.dirty = false;
            let settled = !moved && !dsr && h.at_rest(now);
            h.settle(settled, &self.cfg.huddle, marks.get(si).copied().flatten());
        }
        if now < TX_WATCH + self.cfg.huddle.tick {
            // Services passed by sent and answered too.
            if plan.pass {
                tx = self.tx_of_all().unwrap_or(tx);
            }
            self.watch_tx(now, tx);
        }
        // Kept for the next tick's partial read (`settle`).
        self.kept = self.snapshot.take().filter(|_| plan.pass);
        // A restart must not undo a rotation: save it at once.
        if rotated {
            self.save_state();
        }
    }

    /// SYNs sent and answers seen over every backend, from the read kept
    /// across ticks (`settle`: each backend's counters at most a few ticks
    /// old, each backend's pair from one read); `None` without one.
    fn tx_of_all(&self) -> Option<TxWatch> {
        let snap = self.snapshot.as_ref()?;
        let mut tx = TxWatch {
            sent: 0,
            answered: 0,
            done: false,
        };
        for (s, slot) in self.cfg.services.iter().zip(&self.dp.services) {
            let dsr = s.mode.is_dsr();
            for id in &slot.backend_ids {
                let (st, _) = snap.get(*id)?;
                tx.add(&st, dsr);
            }
        }
        Some(tx)
    }

    /// Reads backend `bi` of service `si` (its counters, latency and owed
    /// answer, pooled with the cluster's) into its tracker, adding its
    /// SYNs and answers to `tx`.
    fn observe_backend(&mut self, si: usize, bi: usize, at: Reading, tx: &mut TxWatch) {
        let id = self.huddles[si].trackers[bi].id;
        let dsr = self.cfg.services[si].mode.is_dsr();
        let connect = dsr || self.cfg.services[si].latency == crate::config::LatencyMode::Connect;
        let addr = self.cfg.services[si].backends[bi];
        // Histograms only pool with the cluster's, and connect ones are
        // windowed apart: only then may a quiet backend's be left unread.
        let alone = !connect && self.cluster.pool.sum(at.service, addr).is_none();
        let (own, st, pulse) = match self.read_backend(si, bi, id, connect, alone) {
            Ok(r) => r,
            Err(e) => {
                warn!("reading counters of backend {id}: {e:#}");
                return;
            }
        };
        // The huddle judges from every balancer's samples (`alone`: there
        // are none but its own, already looked for).
        let all = own.map(|mut all| {
            let peers = (!alone)
                .then(|| self.cluster.pool.sum(at.service, addr))
                .flatten();
            self.huddles[si].trackers[bi].pooled = peers.is_some();
            if let Some(peers) = peers {
                all.add(peers);
            }
            all
        });
        if let Some(all) = &all {
            if dsr {
                self.huddles[si].trackers[bi].observe_connect(&all.connect);
            }
            if self.cfg.services[si].latency == crate::config::LatencyMode::Connect {
                let min = self.cfg.huddle.min_samples;
                self.huddles[si].trackers[bi].observe_connect_time(&all.stats, &all.connect, min);
            }
        }
        tx.add(&st, dsr);
        self.watch_nat_reuse(si, bi, id, st.nat_reuse_early);
        let tracker = &mut self.huddles[si].trackers[bi];
        let (stats, ttfb) = match &all {
            Some(all) => {
                if !tracker.quiet(&all.stats) {
                    tracker.observe_heavy(&all.ttfb_heavy);
                }
                (all.stats, &all.ttfb)
            }
            None => (st, &NO_SAMPLES),
        };
        tracker.observe(
            &stats,
            ttfb,
            &pulse,
            at.now_ns,
            &self.cfg.huddle,
            at.hung_after,
        );
    }

    /// Backend `id`'s kernel counters and latency (with its connect
    /// histogram if `connect`), and the answer it owes (cleared first if
    /// its tracker asked).
    fn read_backend(
        &mut self,
        si: usize,
        bi: usize,
        id: u32,
        connect: bool,
        alone: bool,
    ) -> Result<(
        Option<Box<crate::cluster::pooled::Counts>>,
        BackendStats,
        Pulse,
    )> {
        let (stats, mut pulse) = match self.snapshot.as_ref().and_then(|s| s.get(id)) {
            Some(read) => read,
            None => (self.dp.backend_stats(id)?, self.dp.pulse(id)?),
        };
        if std::mem::take(&mut self.huddles[si].trackers[bi].clear_pulse) {
            self.dp.clear_pulse(id)?;
            pulse = Pulse::default();
        }
        // Nothing answered since the tracker's last tick (and no peer's
        // samples to add): it keeps the histograms it has, so none is
        // read or copied (`Tracker::quiet`).
        if alone && self.huddles[si].trackers[bi].quiet(&stats) {
            return Ok((None, stats, pulse));
        }
        // A histogram gains a sample only with `answered`: unchanged, the
        // two per-CPU reads (2 KiB a CPU) are skipped. A sample counted
        // between the two reads shows with the backend's next one. Kept
        // only where the quiet path above cannot serve (2 KiB a backend).
        let cached = (!alone).then(|| self.hist_cache.get(&id)).flatten();
        let (ttfb, ttfb_heavy) = match cached {
            Some((answered, all, heavy)) if *answered == stats.answered => (*all, *heavy),
            _ => {
                let (all, heavy) = self.dp.latency_parts(id)?;
                if !alone {
                    self.hist_cache.insert(id, (stats.answered, all, heavy));
                }
                (all, heavy)
            }
        };
        let mut own = crate::cluster::pooled::Counts {
            stats,
            ttfb,
            ttfb_heavy,
            connect: huddle_common::Latency::default(),
        };
        if connect {
            own.connect = self.dp.connect_latency(id)?;
        }
        Ok((Some(Box::new(own)), stats, pulse))
    }

    /// Service `si`'s rotation step: each move logged and kept, panic mode
    /// announced when it starts and ends. Whether anything moved.
    fn rotate(&mut self, si: usize, now: Duration) -> bool {
        let service = self.cfg.services[si].name();
        let was_panic = self.huddles[si].engine.panic;
        let moves = self.huddles[si].step(&self.cfg.huddle, now);
        let rotated = !moves.is_empty();
        self.record_moves(si, moves, now);
        let panic = self.huddles[si].engine.panic;
        if panic && !was_panic {
            warn!("{service}: panic mode: too few healthy backends; keeping the least hot ones in the ring");
        } else if was_panic && !panic {
            info!("{service}: panic mode over");
        }
        rotated
    }

    /// Logs service `si`'s `moves` (made at `now`) and keeps them for
    /// `huddle status`.
    pub(super) fn record_moves(
        &mut self,
        si: usize,
        moves: Vec<crate::huddle::rotation::Move>,
        now: Duration,
    ) {
        let service = self.cfg.services[si].name();
        for m in moves {
            let backend = self.cfg.services[si].backends[m.member];
            // What made it hot, for whoever reads the log.
            let why = {
                let t = &self.huddles[si].trackers[m.member];
                let c = t.components;
                let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1} ms"));
                // Judged against the ring's spread (half its p99, at most
                // its p75) rather than its median (`readings::shared_spread`).
                let ring = self.huddles[si].ring_p50_ms;
                let spread = match (t.against_ms, ring) {
                    (Some(a), Some(m)) if a > m => format!(" (its spread; its median {m:.1} ms)"),
                    _ => String::new(),
                };
                format!(
                    "latency {} ({}) against the ring's {}{spread}: anomaly {:.2}, cpu {:.2}, memory {:.2}, errors {:.2}, load {:.2}",
                    ms(t.latency_ms),
                    t.latency_source,
                    ms(t.against_ms),
                    c.anomaly,
                    c.cpu,
                    c.memory,
                    c.errors,
                    c.load
                )
            };
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
                "rotation: {service} backend {backend} -> {} ring ({}), temperature {:.2}; {why}",
                m.to.as_str(),
                ev.reason,
                m.temperature
            );
            self.seen.events.push_back(ev);
            if self.seen.events.len() > EVENTS_KEPT {
                self.seen.events.pop_front();
            }
        }
    }

    /// Says when new flows toward a backend start (and stop) getting NAT
    /// tuples used less than a TIME_WAIT ago: the backend may still hold
    /// the old connection, and then the client waits a retransmission.
    pub(super) fn watch_nat_reuse(&mut self, si: usize, bi: usize, id: u32, count: u64) {
        let e = self.seen.nat_reuse.entry(id).or_insert((count, false));
        let new = count.wrapping_sub(e.0);
        e.0 = count;
        let addr = self.cfg.services[si].backends[bi];
        let ports = self.dp.settings.nat_ports;
        let snat = self.dp.settings.snat.len();
        let (tuples, rate) = (ports.tuples(snat), ports.sustainable_rate(snat));
        if new > 0 && !e.1 {
            e.1 = true;
            warn!(
                event = "nat_reuse_early",
                backend = %addr,
                new_flows = new,
                "NAT tuples toward backend {addr} are being reused less than 60 s after their last use ({new} new flows this tick): more new connections a second toward it than {tuples} tuples / 60 s = {rate} a second; the oldest tuple goes first, but the backend may still hold it in TIME_WAIT (widen nat_ports or add snat_ips); counted in nat_reuse_early"
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
    pub(super) fn watch_tx(&mut self, now: Duration, cur: TxWatch) {
        if self.seen.watch.is_some_and(|w| w.done) {
            return;
        }
        let Some(first) = self.seen.watch else {
            self.seen.watch = Some(cur);
            return;
        };
        let sent = cur.sent.wrapping_sub(first.sent);
        if cur.answered != first.answered {
            self.seen.watch = Some(TxWatch { done: true, ..cur });
            return;
        }
        if sent >= TX_WATCH_MIN_SENT && now >= TX_WATCH {
            let mode = self.dp.attach.mode.map_or("detached", |m| m.as_str());
            let note = format!(
                "forwarding nothing: {sent} SYNs sent toward backends in the first {}s in {mode} mode and not one answer came back; either every backend is down, or this mode loses what it transmits (on a veth, native XDP_TX needs an XDP program on the peer and senders that compute checksums: try --xdp-mode generic)",
                TX_WATCH.as_secs()
            );
            warn!(event = "forwarding_nothing", mode, sent, "{note}");
            self.seen.notes.push(note);
            self.seen.watch = Some(TxWatch { done: true, ..cur });
        }
    }

    /// Flags backends that left for being unhealthy so the kernel moves
    /// their flows; unflags them once healthy.
    pub(super) fn mark_dead(&mut self, si: usize) {
        // In panic mode (too few healthy backends), and for a while after,
        // nothing is moved: a balancer that finds most backends gone at
        // once is likelier cut off itself. Measured: a balancer whose link
        // was cut reset 43-45 of its connections when the link came back,
        // moving them off backends it had judged dead from its own
        // isolation (also when only panic mode itself held it back: the
        // panic ended a tick before the backends' probes passed again).
        if self.huddles[si].engine.panic {
            self.seen.last_panic.insert(si, Instant::now());
        }
        let calm = self
            .seen
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
}
