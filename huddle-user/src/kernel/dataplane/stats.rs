//! Reading the program's counters, histograms and handles.

use super::*;
use anyhow::{Context, Result};
use aya::{
    maps::{HashMap, MapData, PerCpuArray, PerCpuValues},
    programs::Xdp,
};
use huddle_common::{
    maps, BackendStats, Counters, FlowKey, FlowValue, GlobalStats, Latency, Pulse, ServiceStats,
    PROGRAM6_NAME, PROGRAM_NAME,
};

/// Every configured backend's counters (summed over CPUs, with the idle
/// UDP flows swept) and the answer it owes, read at once: three system
/// calls a tick instead of three a backend.
pub struct BackendSnapshot {
    first: u32,
    stats: Vec<BackendStats>,
    pulse: Vec<Pulse>,
}

impl BackendSnapshot {
    /// Backend `id`'s counters and owed answer, if it was read.
    #[must_use]
    pub fn get(&self, id: u32) -> Option<(BackendStats, Pulse)> {
        let i = id.checked_sub(self.first)? as usize;
        Some((*self.stats.get(i)?, *self.pulse.get(i)?))
    }
}

impl Dataplane {
    /// The lowest and highest backend id the services hold.
    pub(super) fn backend_id_range(&self) -> Option<(u32, u32)> {
        // One pass a slot over its ids (two chained iterators over 65,536
        // ids were 3% of an idle daemon at that size).
        let (mut lo, mut hi, mut any) = (u32::MAX, 0, false);
        for s in &self.services {
            for &id in &s.backend_ids {
                lo = lo.min(id);
                hi = hi.max(id);
            }
            any |= !s.backend_ids.is_empty();
        }
        any.then_some((lo, hi))
    }

    /// `BackendSnapshot` of the ids the services hold (from the lowest to
    /// the highest; ids are given from the lowest up, so they sit together).
    pub fn backend_snapshot(&self) -> Result<BackendSnapshot> {
        let Some((lo, hi)) = self.backend_id_range() else {
            return Ok(BackendSnapshot {
                first: 0,
                stats: Vec::new(),
                pulse: Vec::new(),
            });
        };
        let n = (hi - lo + 1) as usize;
        let mut snap = BackendSnapshot {
            first: lo,
            stats: vec![BackendStats::default(); n],
            pulse: vec![Pulse::default(); n],
        };
        self.read_into(&mut snap, lo, hi)?;
        Ok(snap)
    }

    /// Reads ids `lo..=hi` of each of `ranges` into `snap` again, or all
    /// of them when `snap` holds another id range (or none).
    pub fn refresh_snapshot(
        &self,
        snap: &mut Option<BackendSnapshot>,
        ranges: &[(u32, u32)],
    ) -> Result<()> {
        let whole = self.backend_id_range();
        match (snap.as_mut(), whole) {
            (Some(s), Some((lo, hi)))
                if s.first == lo && s.stats.len() == (hi - lo + 1) as usize =>
            {
                for &(a, b) in ranges {
                    self.read_into(s, a.max(lo), b.min(hi))?;
                }
            }
            _ => *snap = Some(self.backend_snapshot()?),
        }
        Ok(())
    }

    /// Ids `a..=b` (within `snap`'s) read into `snap`: three batch reads.
    fn read_into(&self, snap: &mut BackendSnapshot, a: u32, b: u32) -> Result<()> {
        use crate::kernel::batch;
        if a > b {
            return Ok(());
        }
        let (n, off) = (b - a + 1, (a - snap.first) as usize);
        let swept = batch::plain(&self.nat.swept, a, n)?;
        let pulse = batch::plain(&self.stats.pulse, a, n)?;
        let stats = &mut snap.stats[off..off + n as usize];
        stats.fill(BackendStats::default());
        batch::per_cpu_fold(&self.stats.backend_stats, a, n, self.cpus, |i, v| {
            stats[i].accumulate(v);
        })?;
        for (st, sw) in stats.iter_mut().zip(&swept) {
            st.flows_closed += sw;
        }
        snap.pulse[off..off + pulse.len()].copy_from_slice(&pulse);
        Ok(())
    }

    /// For each of the service ids `ids`, all its counters summed over
    /// CPUs and fields: a number that moves with any new flow, drop or
    /// promotion of the service, which is how a quiet settled service is
    /// watched (`daemon::settle`: one element a service, not its backends'
    /// sixteen). Read in batches over runs of near ids.
    pub fn service_marks(&self, ids: &[u32]) -> Result<Vec<u64>> {
        use crate::kernel::batch;
        let mut got: std::collections::HashMap<u32, u64> =
            std::collections::HashMap::with_capacity(ids.len());
        for (a, b) in batch::merged(ids.iter().map(|&id| (id, id)).collect(), 16) {
            batch::per_cpu_fold(
                &self.stats.service_stats,
                a,
                b - a + 1,
                self.cpus,
                |k, v| {
                    let v: &ServiceStats = v;
                    let mut sum = 0u64;
                    v.for_each(|_, x| sum = sum.wrapping_add(x));
                    let e = got.entry(a + k as u32).or_insert(0);
                    *e = e.wrapping_add(sum);
                },
            )?;
        }
        Ok(ids
            .iter()
            .map(|id| got.get(id).copied().unwrap_or(0))
            .collect())
    }

    /// Sum over CPUs of one backend's counters; `flows_closed` includes
    /// the idle UDP flows `sweep_idle_udp` removed.
    pub fn backend_stats(&self, id: u32) -> Result<BackendStats> {
        let mut st: BackendStats = sum(&self.stats.backend_stats.get(&id, 0)?);
        st.flows_closed += self.nat.swept.get(&id, 0).unwrap_or(0);
        Ok(st)
    }

    /// A handle of its own on the DSR flow table, for sharing flows with
    /// the other balancers of a cluster (see `cluster::handoff`: Maglev
    /// DSR flows are the ones another balancer can carry on).
    pub fn flow_map(&self) -> Result<HashMap<MapData, FlowKey, FlowValue>> {
        Ok(HashMap::try_from(reopen(&self.ebpf, maps::DSR_FLOWS)?)?)
    }

    /// The idle sweep's own handles on the maps, for a thread of its own
    /// (a sweep of a large flow table must not hold up the huddle's tick).
    /// Given once.
    pub fn take_sweeper(&mut self) -> Option<Sweeper> {
        self.nat.sweeper.take()
    }

    /// Sum over CPUs of one service's counters; its packets and bytes are
    /// its backends' (the program counts them only per backend).
    pub fn service_stats(&self, id: u32) -> Result<ServiceStats> {
        let backends = self
            .services
            .iter()
            .find(|s| s.id == id)
            .map_or(&[][..], |s| &s.backend_ids[..])
            .iter()
            .map(|b| self.backend_stats(*b))
            .collect::<Result<Vec<_>>>()?;
        self.service_stats_from(id, &backends)
    }

    /// As `service_stats`, from its backends' counters already read.
    pub fn service_stats_from(&self, id: u32, backends: &[BackendStats]) -> Result<ServiceStats> {
        let mut st: ServiceStats = sum(&self.stats.service_stats.get(&id, 0)?);
        for b in backends {
            st.pkts += b.pkts_to;
            st.bytes += b.bytes_to;
        }
        Ok(st)
    }

    pub fn global_stats(&self) -> Result<GlobalStats> {
        Ok(sum(&self.stats.global_stats.get(&0, 0)?))
    }

    /// Sum over CPUs of one backend's time-to-first-byte histogram (all
    /// sources).
    pub fn latency(&self, id: u32) -> Result<Latency> {
        Ok(self.latency_parts(id)?.0)
    }

    /// `latency`, and the part of it from the backend's heavy source
    /// (`HeavySource`), each map read once.
    pub fn latency_parts(&self, id: u32) -> Result<(Latency, Latency)> {
        let mut all = histogram(&self.stats.latency, id)?;
        let heavy = histogram(&self.stats.latency_heavy, id)?;
        all.add(&heavy);
        Ok((all, heavy))
    }

    /// Sum over CPUs of one backend's connect-time histogram.
    pub fn connect_latency(&self, id: u32) -> Result<Latency> {
        histogram(&self.stats.connect, id)
    }

    /// Since when backend `id` owes an answer (kernel monotonic ns, 0: none).
    pub fn pulse(&self, id: u32) -> Result<Pulse> {
        Ok(self.stats.pulse.get(&id, 0)?)
    }

    /// The loaded program (for BPF_PROG_TEST_RUN).
    pub fn program(&self) -> Result<&Xdp> {
        Ok(self
            .ebpf
            .program(PROGRAM_NAME)
            .context("program missing")?
            .try_into()?)
    }

    /// The seed of the program's flow hashes (which slot a tuple takes):
    /// fixtures that need tuples sharing a slot compute them with it.
    #[must_use]
    pub fn hash_seed(&self) -> u64 {
        self.settings.kernel_config.hash_seed
    }

    /// The secret seed of the Maglev flow hash (`slot_of`'s `seed`).
    #[must_use]
    pub fn maglev_seed(&self) -> u64 {
        self.settings.kernel_config.maglev_seed
    }

    /// Instructions the verifier went through for each program (IPv4,
    /// IPv6): its budget is 1M a program, and a change that grows this is
    /// one step nearer to a program that no longer loads.
    #[must_use]
    pub fn verified_instructions(&self) -> [Option<u32>; 2] {
        [PROGRAM_NAME, PROGRAM6_NAME].map(|name| {
            let prog: &Xdp = self.ebpf.program(name)?.try_into().ok()?;
            prog.info().ok()?.verified_instruction_count()
        })
    }

    /// The program's kernel id, for bpftool.
    pub fn program_id(&self) -> Option<u32> {
        let prog: &Xdp = self.ebpf.program(PROGRAM_NAME)?.try_into().ok()?;
        prog.info().ok().map(|i| i.id())
    }
}

/// Sum over CPUs of one backend's histogram in `map`.
pub(super) fn histogram(map: &PerCpuArray<MapData, Latency>, id: u32) -> Result<Latency> {
    let mut total = Latency::default();
    for cpu in map.get(&id, 0)?.iter() {
        total.add(cpu);
    }
    Ok(total)
}

/// Sum over CPUs of one per-CPU counter element.
pub(super) fn sum<T: Counters + aya::Pod>(per_cpu: &PerCpuValues<T>) -> T {
    let mut total = T::default();
    for v in per_cpu.iter() {
        total.accumulate(v);
    }
    total
}
