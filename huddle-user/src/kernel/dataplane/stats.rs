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
        let ids = self.services.iter().flat_map(|s| s.backend_ids.iter());
        Some((*ids.clone().min()?, *ids.max()?))
    }

    /// `BackendSnapshot` of the ids the services hold (from the lowest to
    /// the highest; ids are given from the top down, so they sit together).
    pub fn backend_snapshot(&self) -> Result<BackendSnapshot> {
        use crate::kernel::batch;
        let Some((lo, hi)) = self.backend_id_range() else {
            return Ok(BackendSnapshot {
                first: 0,
                stats: Vec::new(),
                pulse: Vec::new(),
            });
        };
        let n = hi - lo + 1;
        let per_cpu: Vec<Vec<BackendStats>> =
            batch::per_cpu(&self.stats.backend_stats, lo, n, self.cpus)?;
        let swept = batch::plain(&self.nat.swept, lo, n)?;
        let pulse = batch::plain(&self.stats.pulse, lo, n)?;
        let stats = per_cpu
            .iter()
            .enumerate()
            .map(|(i, cpus)| {
                let mut st = BackendStats::default();
                for v in cpus {
                    st.accumulate(v);
                }
                st.flows_closed += swept.get(i).copied().unwrap_or(0);
                st
            })
            .collect();
        Ok(BackendSnapshot {
            first: lo,
            stats,
            pulse,
        })
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
        for (a, h) in all.buckets.iter_mut().zip(heavy.buckets.iter()) {
            *a = a.wrapping_add(*h);
        }
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
        for (t, v) in total.buckets.iter_mut().zip(cpu.buckets.iter()) {
            *t = t.wrapping_add(*v);
        }
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
