//! `huddle status` of the running balancer: services, rings, every
//! backend's temperature and its terms, counters, rotations.

use super::balancer::{lock, Balancer};
use crate::{
    huddle::rotation::Place,
    status::{counters, BackendStatus, ServiceStatus, Status},
};
use anyhow::Result;
use huddle_common::BackendStats;
use std::time::Duration;

impl Balancer {
    /// The whole status: the balancer, then each service with its backends.
    pub fn status(&self) -> Result<Status> {
        self.status_of(&[])
    }

    /// The status with only the services whose names contain one of
    /// `names` (all when empty), the others never built: at 65,536
    /// backends the whole took seconds, with the tick waiting.
    pub fn status_of(&self, names: &[String]) -> Result<Status> {
        self.status_with(names, true)
    }

    /// The status without any backend's or recent move's entries (every
    /// service's own figures and counters kept): what `/metrics` shows
    /// past 8,192 backends (no backend entry built: at 65,536 a full
    /// status took 200-800 ms of the lock).
    pub fn status_lean(&self) -> Result<Status> {
        self.status_with(&[], false)
    }

    fn status_with(&self, names: &[String], backends: bool) -> Result<Status> {
        let now = self.now();
        let services = (0..self.dp.services.len())
            .filter(|si| crate::status::named(&self.dp.services[*si].service.name(), names))
            .map(|si| self.service_status(si, now, backends))
            .collect::<Result<Vec<_>>>()?;
        if services.is_empty() && !names.is_empty() {
            anyhow::bail!("no service's name contains {}", names.join(" or "));
        }
        Ok(Status {
            interface: self.cfg.interface.clone(),
            xdp_mode: self
                .dp
                .attach
                .mode
                .map_or("detached", |m| m.as_str())
                .to_string(),
            program_id: self.dp.program_id(),
            snat: self
                .dp
                .settings
                .snat
                .iter()
                .map(ToString::to_string)
                .chain(self.dp.settings.snat6.iter().map(ToString::to_string))
                .collect::<Vec<_>>()
                .join(", "),
            nat_ports: self.dp.settings.nat_ports.to_string(),
            uptime_s: now.as_secs_f64(),
            tick_ms: self.cfg.huddle.tick.as_secs_f64() * 1e3,
            services,
            global: counters(&self.dp.global_stats()?),
            notes: self
                .dp
                .attach
                .mode_note
                .iter()
                .chain(&self.seen.notes)
                .chain(&self.cluster.leader_note)
                .chain(&self.cluster.handoff_note)
                .chain(&self.cluster.pool_note)
                .cloned()
                .chain(self.cluster.hold.as_ref().and_then(|(until, why)| {
                    let left = until.checked_sub(self.now())?;
                    Some(format!(
                        "cluster: rings held {:.1} s more ({why}): no backend rests hot or returns meanwhile",
                        left.as_secs_f64()
                    ))
                }))
                .collect(),
            bgp: self.cluster.bgp.as_ref().map(|b| lock(b).status()),
            control: self.control_cost(),
        })
    }

    /// How long the last ticks took and how many probes went out.
    fn control_cost(&self) -> crate::status::ControlCost {
        let mut t: Vec<f64> = self
            .seen
            .tick_took
            .iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        t.sort_by(f64::total_cmp);
        let q = |f: f64| {
            t.get(((t.len() as f64 - 1.0) * f).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        let (map_bytes, maps) = crate::sys::host::bpf_map_memory().unwrap_or_default();
        let (hangs_cleared, hangs_confirmed) = self.suspicions();
        crate::status::ControlCost {
            tick_p50_ms: q(0.5),
            tick_p99_ms: q(0.99),
            tick_max_ms: t.last().copied().unwrap_or(0.0),
            probes_sent: self.seen.probes_sent,
            map_bytes,
            maps,
            services_at_rest: self.seen.passed_by,
            hangs_cleared,
            hangs_confirmed,
        }
    }

    /// Service `si`: its ring, tuning, counters, backends and rotations.
    fn service_status(&self, si: usize, now: Duration, full: bool) -> Result<ServiceStatus> {
        let slot = &self.dp.services[si];
        let h = &self.huddles[si];
        let mut backends = Vec::new();
        let mut read = Vec::new();
        for (bi, id) in slot.backend_ids.iter().enumerate() {
            // The tick's read, kept between ticks from 1,024 backends
            // (`settle`; a settled service's re-read in turn, while
            // nothing of it moves), else the kernel's: at 65,536 backends
            // two system calls a backend were a third of a status.
            let last = self.snapshot.as_ref().or(self.kept.as_ref());
            let st = match last.and_then(|s| s.get(*id)) {
                Some((st, _)) => st,
                None => self.dp.backend_stats(*id)?,
            };
            if full {
                backends.push(self.backend_status(si, bi, &st, now));
            }
            read.push(st);
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
        Ok(ServiceStatus {
            mode: slot.service.mode.to_string(),
            selection: slot.service.selection.to_string(),
            rotation: h.rotation,
            panic: h.engine.panic,
            ring_generation: slot.generation,
            ring,
            counters: counters(&self.dp.service_stats_from(slot.id, &read)?),
            hung_after_ms: h.hung_after_at(&self.cfg.huddle, now).as_secs_f64() * 1e3,
            pass_over_ms: tuning.turn_skip_ns as f64 / 1e6,
            pass_over_syn_ms: tuning.syn_skip_ns as f64 / 1e6,
            backends,
            recent: self
                .seen
                .events
                .iter()
                .filter(|e| full && e.service == name)
                .cloned()
                .collect(),
            name,
        })
    }

    /// Backend `bi` of service `si`: place, temperature and every term,
    /// latency by source, health and its kernel counters `st`.
    fn backend_status(
        &self,
        si: usize,
        bi: usize,
        st: &BackendStats,
        now: Duration,
    ) -> BackendStatus {
        let slot = &self.dp.services[si];
        let id = slot.backend_ids[bi];
        let t = &self.huddles[si].trackers[bi];
        let m = &self.huddles[si].engine.members[bi];
        let place = match (m.drained, m.place) {
            (true, _) => "drained",
            (false, Place::Inner) => "inner",
            (false, Place::Outer) => "outer",
        };
        BackendStatus {
            addr: slot.service.backends[bi].to_string(),
            id,
            place: place.into(),
            in_ring: slot.ring.contains(&id),
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
            heavy_samples: t.window.heavy_samples,
            mean_ms: t.window.mean_ms,
            p50_ms: t.window.p50_ms,
            p75_ms: t.window.p75_ms,
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
            counters: counters(st),
        }
    }
}
