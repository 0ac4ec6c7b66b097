//! The NAT tuple walk: where each backend's cursors start, the TIME_WAIT
//! hints a fresh start checks new SYNs against, and what is saved of both.

use super::*;
use crate::kernel::batch;
use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use huddle_common::{maps, FlowKey, FlowValue, NatCursor, NatKey, MAX_SNAT};
use std::{
    collections::HashMap as StdHashMap,
    net::{IpAddr, SocketAddr},
};

impl Dataplane {
    /// Sets backend `id`'s NAT cursor on every CPU to where a walk of one
    /// round per TIME_WAIT would stand now, as if it had always walked at
    /// that pace. A balancer started afresh (after `huddle stop`, or a
    /// backend given a new slot) then does not hand out the tuples a
    /// previous run used moments ago, which the backends still hold in
    /// TIME_WAIT, as long as that run stayed within the capacity.
    pub(super) fn start_cursor(&mut self, id: u32, addr: SocketAddr) -> Result<()> {
        let cursor = cursor_at(
            crate::sys::host::monotonic_ns(),
            u64::from(self.settings.kernel_config.slice_ports),
            u64::from(self.settings.kernel_config.snat_count),
        );
        let mut per_cpu = vec![cursor; self.cpus];
        // An earlier run's walk, if it walked the same slices: carry on.
        if let Some(saved) = self.nat.resume.as_ref().filter(|w| {
            w.slice_ports == u32::from(self.settings.kernel_config.slice_ports)
                && w.snat_count == u32::from(self.settings.kernel_config.snat_count)
                && w.cpus == self.cpus
        }) {
            if let Some(pos) = saved.backends.get(&addr.to_string()) {
                for (c, (port, a)) in per_cpu.iter_mut().zip(pos) {
                    c.port = *port;
                    c.addr = *a;
                }
            }
        }
        self.nat
            .nat_cursor
            .set(id, aya::maps::PerCpuValues::try_from(per_cpu)?, 0)
            .with_context(|| format!("setting the NAT cursor of backend id {id}"))
    }

    /// Writes the last run's TIME_WAIT tuples (those still under a minute
    /// old at `now_ns`) for the kernel to check new SYNs against; returns
    /// how many.
    pub(super) fn load_tw_hints(
        &mut self,
        hints: &[walk::TimeWaitHint],
        now_ns: u64,
    ) -> Result<usize> {
        let mut until = 0;
        let mut n = 0;
        for h in hints.iter().take(huddle_common::MAX_TW_HINTS as usize) {
            let walk::TimeWaitHint(local, port, backend, proto, tsval, closed_ns) = *h;
            if now_ns.saturating_sub(closed_ns) >= huddle_common::TIME_WAIT_NS || tsval == 0 {
                continue;
            }
            let family = if backend.is_ipv4() {
                huddle_common::FAMILY_V4
            } else {
                huddle_common::FAMILY_V6
            };
            let key = NatKey::new(
                ip_bytes(local),
                ip_bytes(backend.ip()),
                backend.port().to_be(),
                port.to_be(),
                proto,
                family,
            );
            let v = huddle_common::TwHint {
                tsval,
                _pad: 0,
                closed_ns,
            };
            if self.nat.tw_hints.insert(key, v, 0).is_ok() {
                n += 1;
                until = until.max(closed_ns + huddle_common::TIME_WAIT_NS);
            }
        }
        if n > 0 {
            self.nat.tw_hints_until.set(0, until, 0)?;
        }
        Ok(n)
    }

    /// The tuples the backends may hold in TIME_WAIT at `now_ns`: closed
    /// source-NAT flows whose backend sent the first FIN, with the
    /// client's last timestamp, and the hints still loaded from the run
    /// before. Scans the flow table (for the exit, not every tick).
    pub fn tw_hints(&self, now_ns: u64) -> Vec<walk::TimeWaitHint> {
        use huddle_common::{flow_flags, TIME_WAIT_NS};
        type Tuple = (IpAddr, u16, SocketAddr, u8);
        let fresh = |closed: u64| now_ns.saturating_sub(closed) < TIME_WAIT_NS;
        // Per tuple, its latest close: a hint loaded from the run before
        // is stale once a flow of this run used the tuple.
        let mut latest: StdHashMap<Tuple, (u32, u64)> = StdHashMap::new();
        let mut keep = |t: Tuple, ts: u32, at: u64| {
            let e = latest.entry(t).or_insert((ts, at));
            if at > e.1 {
                *e = (ts, at);
            }
        };
        if let Ok(flows) = reopen(&self.ebpf, maps::FLOWS)
            .and_then(|m| Ok(HashMap::<MapData, FlowKey, FlowValue>::try_from(m)?))
        {
            for (_, v) in flows.iter().flatten() {
                let tw = flow_flags::BACKEND_TIME_WAIT | flow_flags::CLOSING;
                if v.flags & tw != tw || v.synack_seq == 0 || !fresh(v.stamp_ns) {
                    continue;
                }
                let Ok(b) = self.maps.backends_map.get(&v.backend, 0) else {
                    continue;
                };
                let local = self.settings.kernel_config.snat_addrs[usize::from(v.snat) % MAX_SNAT];
                let t = (
                    ip_of(&local, b.family),
                    u16::from_be(v.nat_port_be),
                    backend_addr(&b),
                    huddle_common::PROTO_TCP,
                );
                keep(t, v.synack_seq, v.stamp_ns);
            }
        }
        for (k, h) in self.nat.tw_hints.iter().flatten() {
            if fresh(h.closed_ns) {
                let backend =
                    SocketAddr::new(ip_of(&k.backend, k.family), u16::from_be(k.backend_port_be));
                let t = (
                    ip_of(&k.local, k.family),
                    u16::from_be(k.nat_port_be),
                    backend,
                    k.proto,
                );
                keep(t, h.tsval, h.closed_ns);
            }
        }
        let mut out: Vec<walk::TimeWaitHint> = latest
            .into_iter()
            .map(|((local, port, backend, proto), (ts, at))| {
                walk::TimeWaitHint(local, port, backend, proto, ts, at)
            })
            .collect();
        // The newest first, if there are more than the map holds.
        out.sort_by_key(|h| std::cmp::Reverse(h.5));
        out.truncate(huddle_common::MAX_TW_HINTS as usize);
        out
    }

    /// Every backend slot's cursors as read now, raw (ids `lo..=hi`, then
    /// each CPU's): to see whether the walk moved before `nat_walk` builds
    /// its map of 65,536 named backends (at that size the build, each
    /// second, was a ninth of an idle daemon's time). `None` if the batch
    /// read failed.
    pub fn nat_cursors(&self) -> Option<(u32, u32, Vec<NatCursor>)> {
        let (lo, hi) = self.backend_id_range().unwrap_or_default();
        let mut out = Vec::with_capacity((hi - lo + 1) as usize * self.cpus);
        batch::per_cpu_fold(&self.nat.nat_cursor, lo, hi - lo + 1, self.cpus, |_, c| {
            out.push(*c);
        })
        .ok()?;
        Some((lo, hi, out))
    }

    /// Where each backend's NAT walk stands now, per CPU (for the next
    /// run: `start_cursor`).
    pub fn nat_walk(&self) -> walk::NatWalk {
        let mut w = walk::NatWalk {
            slice_ports: u32::from(self.settings.kernel_config.slice_ports),
            snat_count: u32::from(self.settings.kernel_config.snat_count),
            cpus: self.cpus,
            backends: std::collections::BTreeMap::new(),
            hints: Vec::new(),
        };
        // Every cursor in one read (one a backend took 65,536 system
        // calls a second at that size); each alone if that fails.
        let (lo, hi) = self.backend_id_range().unwrap_or_default();
        let all: Option<Vec<Vec<NatCursor>>> =
            batch::per_cpu(&self.nat.nat_cursor, lo, hi - lo + 1, self.cpus).ok();
        for slot in &self.services {
            for (id, addr) in slot.backend_ids.iter().zip(&slot.service.backends) {
                let cursors: Option<Vec<NatCursor>> = match &all {
                    Some(all) => all.get((id - lo) as usize).cloned(),
                    None => self.nat.nat_cursor.get(id, 0).ok().map(|v| v.to_vec()),
                };
                if let Some(c) = cursors {
                    let c = c.iter().map(|c| (c.port, c.addr)).collect();
                    w.backends.insert(addr.to_string(), c);
                }
            }
        }
        w
    }
}

/// The NAT cursor of a walk over `ports` x `addrs` tuples that has taken
/// one tuple every TIME_WAIT / (ports x addrs) since the clock's zero.
pub(super) fn cursor_at(now_ns: u64, ports: u64, addrs: u64) -> NatCursor {
    let space = (ports * addrs).max(1);
    let step = (huddle_common::TIME_WAIT_NS / space).max(1);
    let pos = (now_ns / step) % space;
    NatCursor {
        port: (pos % ports.max(1)) as u32,
        addr: (pos / ports.max(1)) as u32,
        // This run has handed out nothing yet: the round it is in counts
        // as a full TIME_WAIT old, so early reuse is counted from the
        // second round on (the first wrap is never early).
        round_ns: now_ns.saturating_sub(huddle_common::TIME_WAIT_NS).max(1),
        early: 0,
        _pad: 0,
    }
}
