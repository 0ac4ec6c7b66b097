//! Ticks that leave settled services be. At 4,096 services x 16 backends
//! reading and judging every backend every tick took the whole 100 ms
//! tick (a core) with no traffic at all. A service whose last tick
//! changed nothing and would change nothing again (`ServiceHuddle::at_rest`:
//! every backend inside, healthy, owing nothing, with no samples in its
//! window and a temperature at rest) is passed by until one of its
//! backends' counters move or owe (`Tracker::wakes`), a probe or host
//! reading comes (`Balancer::stir`) or an operator changes it
//! (`ServiceHuddle::dirty`). Its counters are read again in turn,
//! `WAKE_SLICE` backends a tick, so new traffic to it is seen within
//! (backends / `WAKE_SLICE`) ticks.

use super::balancer::Balancer;
use tracing::debug;

/// Below this many backends every service is read and judged every tick,
/// as it always was.
pub(super) const PASS_SETTLED_FROM: usize = 1_024;

/// Backends of settled services whose counters a tick reads again.
const WAKE_SLICE: usize = 4_096;

/// Quiet settled services (no backend holding a flow) whose service
/// counters a tick reads: every 4,096 of them within 0.8 s, one element
/// each where their backends' were sixteen.
const QUIET_SLICE: usize = 512;

/// What one tick reads: whether it may pass settled services by, which
/// services it reads, and their backend id ranges (inclusive, merged).
pub(super) struct Plan {
    pub(super) pass: bool,
    pub(super) read: Vec<bool>,
    pub(super) ranges: Vec<(u32, u32)>,
}

impl Balancer {
    /// Backend `bi` of service `si` got something besides its counters (a
    /// probe's result, a host reading): its service is judged next tick.
    pub(super) fn stir(&mut self, si: usize, bi: usize) {
        let h = &mut self.huddles[si];
        h.trackers[bi].stirred = true;
        h.dirty = true;
    }

    /// This tick's reads at `now`.
    pub(super) fn plan_reads(&mut self) -> Plan {
        let n = self.huddles.len();
        let backends: usize = self.huddles.iter().map(|h| h.trackers.len()).sum();
        // Never with peers (their samples change a backend with no
        // counter of ours moving).
        let pass = backends >= PASS_SETTLED_FROM && self.cluster.pool.is_empty();
        // Also in the first seconds, when `watch_tx` sums every backend's
        // SYNs and answers (from the kept read, each backend's at most
        // backends / `WAKE_SLICE` ticks old: `tx_of_all`). Judging all
        // 65,536 backends then made the first 50 ticks 110-480 ms each,
        // and reading all of them (24 MiB of per-CPU counters) still
        // 104-129 ms: the daemon's tick p99.
        if !pass {
            return Plan {
                pass,
                read: vec![true; n],
                ranges: Vec::new(),
            };
        }
        let mut read: Vec<bool> = self.huddles.iter().map(|h| !h.settled || h.dirty).collect();
        self.watch_quiet(&mut read);
        // The next settled services that are not quiet, in turn, up to
        // the slice.
        let mut taken = 0;
        for k in 0..n {
            if taken >= WAKE_SLICE {
                break;
            }
            let si = (self.wake_cursor + k) % n;
            let h = &self.huddles[si];
            if h.settled && h.quiet_mark.is_none() {
                read[si] = true;
                taken += h.trackers.len();
            }
            self.wake_cursor = (si + 1) % n;
        }
        let ranges: Vec<(u32, u32)> = (0..n)
            .filter(|&si| read[si])
            .filter_map(|si| {
                let ids = self.dp.services.get(si)?.backend_ids.iter();
                Some((*ids.clone().min()?, *ids.max()?))
            })
            .collect();
        Plan {
            pass,
            read,
            ranges: crate::kernel::batch::merged(ranges, 64),
        }
    }

    /// The next `QUIET_SLICE` quiet services' service counters: one that
    /// moved is read and judged this tick (`read`), as is each of them if
    /// the read fails.
    fn watch_quiet(&mut self, read: &mut [bool]) {
        let n = self.huddles.len();
        let mut picked = Vec::with_capacity(QUIET_SLICE);
        let mut k = 0;
        while picked.len() < QUIET_SLICE && k < n {
            let si = (self.quiet_cursor + k) % n;
            k += 1;
            let h = &self.huddles[si];
            if h.settled && !h.dirty && h.quiet_mark.is_some() {
                picked.push(si);
            }
        }
        self.quiet_cursor = (self.quiet_cursor + k) % n.max(1);
        if picked.is_empty() {
            return;
        }
        match self.marks_for(&picked) {
            Ok(marks) => {
                for (&si, m) in picked.iter().zip(marks) {
                    if self.huddles[si].quiet_mark != Some(m) {
                        read[si] = true;
                        self.huddles[si].dirty = true;
                    }
                }
            }
            Err(e) => {
                debug!("quiet services read by their backends: {e:#}");
                for si in picked {
                    read[si] = true;
                }
            }
        }
    }

    /// The service counters' sums (`Dataplane::service_marks`) of the
    /// services this tick reads, by service; read before their backends'
    /// counters, so a flow between the two reads shows in the backends'
    /// (the service is not at rest) or moves the sum after it.
    pub(super) fn marks_of(&self, read: &[bool]) -> Vec<Option<u64>> {
        let picked: Vec<usize> = (0..read.len()).filter(|&si| read[si]).collect();
        let mut out = vec![None; read.len()];
        match self.marks_for(&picked) {
            Ok(marks) => {
                for (si, m) in picked.into_iter().zip(marks) {
                    out[si] = Some(m);
                }
            }
            Err(e) => debug!("service counters: {e:#}"),
        }
        out
    }

    /// `Dataplane::service_marks` of services `sis` (indices), in order.
    fn marks_for(&self, sis: &[usize]) -> anyhow::Result<Vec<u64>> {
        let ids: Vec<u32> = sis.iter().map(|&si| self.dp.services[si].id).collect();
        self.dp.service_marks(&ids)
    }

    /// Whether settled service `si` must be judged this tick: read
    /// (`read`), one of its backends moved or owes; or something came
    /// besides its counters.
    pub(super) fn wakes(&self, si: usize, read: bool) -> bool {
        let h = &self.huddles[si];
        // A probe or scrape that stirs a backend marks its service dirty
        // (`stir`): 65,536 trackers are not looked at to find out.
        if h.dirty {
            return true;
        }
        read && h.trackers.iter().any(|t| {
            self.snapshot
                .as_ref()
                .and_then(|s| s.get(t.id))
                .is_none_or(|(st, pulse)| t.wakes(&st, &pulse))
        })
    }
}
