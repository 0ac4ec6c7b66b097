//! What the balancer writes so a restart carries on: the state file
//! (temperatures, places, rests, sysctls) and the NAT walk file.

use super::balancer::Balancer;
use crate::sys::host;
use crate::{
    huddle::state::{self, Saved, SavedBackend, SavedService},
    huddle::thermal,
};
use std::time::Duration;
use tracing::{info, warn};

impl Balancer {
    /// Writes the state file; a failure is logged, never fatal. (The NAT
    /// walk file is the saver's, once a second when it moved, and the
    /// exit's: `save_state_and_walk`.)
    pub fn save_state(&self) {
        if let Err(e) = state::save(&self.cfg.state_file, &self.snapshot()) {
            warn!("{e:#}");
        }
    }

    /// `save_state`, and the NAT walk file with the TIME_WAIT tuples when
    /// `last` (see `save_nat_walk`).
    pub fn save_state_and_walk(&self, last: bool) {
        self.save_state();
        self.save_nat_walk(last);
    }

    /// Writes where the NAT walks stand (kept after `huddle stop`: see
    /// `walk::NatWalk`); on the way out (`last`) also the tuples the
    /// backends hold in TIME_WAIT, with their timestamps, for a fresh
    /// start to check new SYNs against (a scan of the flow table).
    pub fn save_nat_walk(&self, last: bool) {
        let path = crate::kernel::dataplane::walk::nat_walk_file(&self.cfg.state_file);
        let mut walk = self.dp.nat_walk();
        if last {
            walk.hints = self.dp.tw_hints(host::monotonic_ns());
        }
        if let Err(e) = crate::kernel::dataplane::walk::save_nat_walk(&path, &walk) {
            warn!("{e:#}");
        }
    }

    /// Temperatures and places, for the state file.
    #[must_use]
    pub fn snapshot(&self) -> Saved {
        let now = self.now();
        let mut saved = Saved::new(&self.cfg.interface);
        saved.sysctls = self.life.sysctl_originals.clone();
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
        let all = vec![true; self.huddles.len()];
        self.restore_where(saved, &all);
    }

    /// `restore` for the services `si` with `which[si]` (a reload's new
    /// or changed ones; the others kept their huddle).
    pub(super) fn restore_where(&mut self, saved: &Saved, which: &[bool]) {
        let now = self.now();
        let mut n = 0;
        // By name: a search of the list for each service was 4,096^2
        // compares of formatted names, 0.6 s of a reload at that size.
        let by_name: std::collections::HashMap<&str, &SavedService> = saved
            .services
            .iter()
            .map(|x| (x.name.as_str(), x))
            .collect();
        for (si, s) in self.cfg.services.iter().enumerate() {
            if !which.get(si).copied().unwrap_or(true) {
                continue;
            }
            let Some(ss) = by_name.get(s.name().as_str()) else {
                continue;
            };
            for (bi, a) in s.backends.iter().enumerate() {
                let addr = a.to_string();
                let Some(sb) = ss.backends.iter().find(|b| b.addr == addr) else {
                    continue;
                };
                let h = &mut self.huddles[si];
                h.dirty = true;
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
}
