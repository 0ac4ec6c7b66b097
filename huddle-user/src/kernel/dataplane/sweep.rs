//! The idle UDP sweep's own handles on the maps, for a thread of its own.

use anyhow::Result;
use aya::maps::{Array, HashMap, MapData};
use huddle_common::{
    flow_flags, Backend, FlowKey, FlowValue, NatKey, NatValue, MAX_SNAT, PROTO_UDP,
    UDP_UNCONFIRMED_IDLE_NS,
};
use std::collections::HashMap as StdHashMap;

/// Removes established UDP flows that stayed silent past their service's
/// idle timeout (`UDP_UNCONFIRMED_IDLE_NS`, if shorter, for a source-NAT
/// flow of one exchange), with their NAT entries: their tuples are free
/// again and they stop counting as active. The program keeps each UDP flow's last
/// datagram time in `FlowValue::stamp_ns`; it never removes flows itself.
pub struct Sweeper {
    /// `UDP_FLOWS` and `DSR_FLOWS` (`FLOWS` holds no UDP flow).
    pub(super) flows: [HashMap<MapData, FlowKey, FlowValue>; 2],
    /// `UDP_NAT`.
    pub(super) nat: HashMap<MapData, NatKey, NatValue>,
    pub(super) backends: Array<MapData, Backend>,
    pub(super) swept: Array<MapData, u64>,
    pub(super) snat_addrs: [huddle_common::Addr; MAX_SNAT],
}

impl Sweeper {
    /// One pass: every UDP flow of a service in `idle_ns` (service id ->
    /// idle timeout) silent for longer than that at `now_ns`
    /// (CLOCK_MONOTONIC). Returns how many it removed.
    pub fn sweep(&mut self, now_ns: u64, idle_ns: &StdHashMap<u32, u64>) -> Result<u64> {
        if idle_ns.is_empty() {
            return Ok(0);
        }
        let mut by_backend: StdHashMap<u32, u64> = StdHashMap::new();
        for table in 0..self.flows.len() {
            self.sweep_table(table, now_ns, idle_ns, &mut by_backend);
        }
        let mut removed = 0;
        for (id, n) in by_backend {
            let before = self.swept.get(&id, 0).unwrap_or(0);
            self.swept.set(id, before + n, 0)?;
            removed += n;
        }
        Ok(removed)
    }

    /// One flow table's idle UDP flows removed, counted per backend.
    fn sweep_table(
        &mut self,
        table: usize,
        now_ns: u64,
        idle_ns: &StdHashMap<u32, u64>,
        by_backend: &mut StdHashMap<u32, u64>,
    ) {
        let mut idle = Vec::new();
        for entry in self.flows[table].iter() {
            let Ok((k, v)) = entry else { continue };
            let Some(limit) = idle_ns.get(&v.service) else {
                continue;
            };
            let limit = if table == 0 && v.flags & flow_flags::UDP_CONFIRMED == 0 {
                (*limit).min(UDP_UNCONFIRMED_IDLE_NS)
            } else {
                *limit
            };
            if k.proto == PROTO_UDP
                && v.flags & flow_flags::CLOSING == 0
                && now_ns.saturating_sub(v.stamp_ns) > limit
            {
                idle.push((k, v));
            }
        }
        for (k, v) in &idle {
            // Alive again since the scan read it: leave it.
            match self.flows[table].get(k, 0) {
                Ok(now) if now.stamp_ns == v.stamp_ns => {}
                _ => continue,
            }
            if self.flows[table].remove(k).is_err() {
                continue;
            }
            if let Ok(b) = self.backends.get(&v.backend, 0) {
                let key = NatKey::new(
                    self.snat_addrs[usize::from(v.snat) % MAX_SNAT],
                    b.addr,
                    b.port_be,
                    v.nat_port_be,
                    PROTO_UDP,
                    b.family,
                );
                // Only if it still names this flow (the tuple may have been
                // handed to another since).
                if self.nat.get(&key, 0).is_ok_and(|n| n.flow == *k) {
                    let _ = self.nat.remove(&key);
                }
            }
            *by_backend.entry(v.backend).or_default() += 1;
        }
    }
}
