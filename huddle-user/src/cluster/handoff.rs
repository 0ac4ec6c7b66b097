//! Connections that keep their backend when the router moves them to
//! another balancer although the rings changed since they opened.
//!
//! A balancer that takes over a connection it never saw open picks its
//! backend from its Maglev table: right as long as the table is the one
//! the connection opened with. Once a backend left the ring (resting or
//! drained: it still serves what it has) or came back, some connections
//! sit on a backend their table entry no longer names, and a takeover
//! would send them elsewhere. So each balancer lists exactly those flows
//! (`/flows` on its metrics endpoint) and every other member writes them
//! into its own flow table marked `ADOPTED`: unused unless the router
//! moves the connection there, first to go when the LRU table is full.
//! Flows the table still explains are never sent: for them Maglev alone
//! is right everywhere.
//!
//! Failure behaviour: a peer that does not answer keeps the flows it
//! last shared (it may have died: that is when they are needed); one that
//! answers drops those it no longer lists (closed, or explained again). A
//! garbage answer is passed over like no answer.

use crate::kernel::dataplane::keys::ip_bytes;
use crate::kernel::dataplane::MaglevTable;
use crate::kernel::maglev;
use anyhow::Result;
use aya::maps::{HashMap, MapData};
use huddle_common::{flow_flags, FlowKey, FlowValue, FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP};
use serde::{Deserialize, Serialize};
use std::{
    collections::{HashMap as StdHashMap, HashSet},
    net::{IpAddr, SocketAddr},
    time::Duration,
};

/// A connection and its backend. A JSON array on the wire (about 60
/// bytes): `[client, client_port, vip, proto, backend]`, as members of
/// every release send it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "WireFlow", into = "WireFlow")]
pub struct SharedFlow {
    pub client: IpAddr,
    pub client_port: u16,
    pub vip: SocketAddr,
    /// IP protocol number.
    pub proto: u8,
    pub backend: SocketAddr,
}

/// `SharedFlow` as the wire carries it.
type WireFlow = (IpAddr, u16, SocketAddr, u8, SocketAddr);

impl From<WireFlow> for SharedFlow {
    fn from((client, client_port, vip, proto, backend): WireFlow) -> Self {
        SharedFlow {
            client,
            client_port,
            vip,
            proto,
            backend,
        }
    }
}

impl From<SharedFlow> for WireFlow {
    fn from(f: SharedFlow) -> Self {
        (f.client, f.client_port, f.vip, f.proto, f.backend)
    }
}

/// What `/flows` answers.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FlowsAnswer {
    pub flows: Vec<SharedFlow>,
    /// More flows than `MAX_SHARED` were unexplained; the rest are not
    /// listed.
    #[serde(default)]
    pub truncated: bool,
}

/// The most flows one balancer lists (about 4 MB of JSON).
pub const MAX_SHARED: usize = 65_536;
/// The most a `/flows` answer may weigh.
const MAX_ANSWER: usize = 8 << 20;

/// The flow of `key` on `value`'s backend if `tables` would send it
/// elsewhere (or has no table for its service): the flows a takeover
/// would break.
#[must_use]
pub fn unexplained(key: &FlowKey, value: &FlowValue, tables: &[MaglevTable]) -> Option<SharedFlow> {
    if value.flags & (flow_flags::CLOSING | flow_flags::ADOPTED) != 0 {
        return None;
    }
    let t = tables.iter().find(|t| t.service == value.service)?;
    if t.entries.is_empty() {
        return None;
    }
    let slot = maglev::slot_of(key, t.entries.len() as u32, t.seed);
    if t.entries[slot] == value.backend {
        return None;
    }
    let backend = *t.backends.get(&value.backend)?;
    let client = addr(key.client, key.family)?;
    Some(SharedFlow {
        client,
        client_port: u16::from_be(key.client_port_be),
        vip: t.vip,
        proto: key.proto,
        backend,
    })
}

fn addr(a: [u8; 16], family: u8) -> Option<IpAddr> {
    matches!(family, FAMILY_V4 | FAMILY_V6)
        .then(|| crate::kernel::dataplane::keys::ip_of(&a, family))
}

/// The flow-table entry this balancer writes for a peer's flow: its own
/// service and backend ids (`tables` gives them by address); `None` when
/// it does not balance that service or know that backend.
#[must_use]
pub fn entry(f: &SharedFlow, tables: &[MaglevTable], now_ns: u64) -> Option<(FlowKey, FlowValue)> {
    let SharedFlow {
        client,
        client_port,
        vip,
        proto,
        backend,
    } = *f;
    if client.is_ipv4() != vip.is_ipv4() || (proto != PROTO_TCP && proto != PROTO_UDP) {
        return None;
    }
    let t = tables.iter().find(|t| t.vip == vip && t.proto == proto)?;
    let id = t
        .backends
        .iter()
        .find_map(|(id, a)| (*a == backend).then_some(*id))?;
    let key = FlowKey {
        client: ip_bytes(client),
        vip: ip_bytes(vip.ip()),
        client_port_be: client_port.to_be(),
        vip_port_be: vip.port().to_be(),
        proto,
        family: if client.is_ipv4() {
            FAMILY_V4
        } else {
            FAMILY_V6
        },
        _pad: [0; 2],
    };
    let value = FlowValue {
        backend: id,
        service: t.service,
        nat_port_be: 0,
        flags: flow_flags::ADOPTED,
        snat: 0,
        synack_seq: 0,
        stamp_ns: now_ns,
        turn_ns: 0,
    };
    Some((key, value))
}

/// Asks member `addr` for the flows it shares.
pub async fn fetch(
    addr: SocketAddr,
    key: &crate::config::key::ClusterKey,
    timeout: Duration,
) -> Result<FlowsAnswer> {
    crate::cluster::peers::get_json(addr, key, ("/flows", "flows"), timeout, MAX_ANSWER).await
}

/// This balancer's flow table, through a handle of its own: scanned for
/// the flows to share and written with the peers' (a task of its own, off
/// the balancer's lock).
pub struct FlowBook {
    flows: HashMap<MapData, FlowKey, FlowValue>,
    /// Per peer: the keys written from its last answer.
    adopted: StdHashMap<SocketAddr, HashSet<FlowKey>>,
}

/// What one peer's answer did to the flow table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Adoption {
    /// Written now.
    pub added: usize,
    /// Held from this peer after the answer.
    pub held: usize,
    /// Its flows this balancer does not balance (unknown service or
    /// backend).
    pub foreign: usize,
    /// Flows listed past `MAX_SHARED`, which no member lists: ignored.
    pub over_cap: usize,
}

impl FlowBook {
    #[must_use]
    pub fn new(flows: HashMap<MapData, FlowKey, FlowValue>) -> Self {
        FlowBook {
            flows,
            adopted: StdHashMap::new(),
        }
    }

    /// The flows `tables` no longer explain, at most `MAX_SHARED`; and
    /// whether there were more.
    #[must_use]
    pub fn scan(&self, tables: &[MaglevTable]) -> (Vec<SharedFlow>, bool) {
        let mut out = Vec::new();
        if tables.is_empty() {
            return (out, false);
        }
        for entry in self.flows.iter() {
            let Ok((k, v)) = entry else { continue };
            if let Some(f) = unexplained(&k, &v, tables) {
                if out.len() == MAX_SHARED {
                    return (out, true);
                }
                out.push(f);
            }
        }
        (out, false)
    }

    /// Writes the flows `peer` shares that this balancer has no entry for,
    /// and removes those it shared before and no longer does (unless a
    /// packet used them meanwhile).
    pub fn adopt(
        &mut self,
        peer: SocketAddr,
        flows: &[SharedFlow],
        tables: &[MaglevTable],
        now_ns: u64,
    ) -> Adoption {
        let mut a = Adoption::default();
        let before = self.adopted.remove(&peer).unwrap_or_default();
        // No member lists more; a peer that does is not believed past it.
        a.over_cap = flows.len().saturating_sub(MAX_SHARED);
        let mut now = HashSet::with_capacity(flows.len().min(MAX_SHARED));
        for f in flows.iter().take(MAX_SHARED) {
            let Some((k, v)) = entry(f, tables, now_ns) else {
                a.foreign += 1;
                continue;
            };
            if before.contains(&k) {
                now.insert(k);
                continue;
            }
            // BPF_NOEXIST: never over a flow this balancer has itself.
            if self.flows.insert(k, v, 1).is_ok() {
                a.added += 1;
                now.insert(k);
            }
        }
        for k in before.difference(&now) {
            if self
                .flows
                .get(k, 0)
                .is_ok_and(|v| v.flags & flow_flags::ADOPTED != 0)
            {
                let _ = self.flows.remove(k);
            }
        }
        a.held = now.len();
        self.adopted.insert(peer, now);
        a
    }
}

/// How often a balancer lists the flows its Maglev tables no longer
/// explain and takes its peers' lists.
pub const EVERY: Duration = Duration::from_secs(1);

/// After a ring change, how often the exchange runs, for `FAST` (the
/// peers list their newly unexplained flows only once their own scan has
/// run: one round would often fetch lists made for the old rings). A
/// connection moved within about two of these of a ring change may still
/// break; at the steady pace that window was two seconds.
pub const QUICK: Duration = Duration::from_millis(200);
pub const FAST: Duration = Duration::from_secs(2);

/// When the exchange is due: every `EVERY`, every `QUICK` for `FAST`
/// after a ring change, and never so often that the scan takes more than
/// a fifth of a core (a large flow table slows the pace). Times are any
/// monotonic clock's.
#[derive(Debug, Default)]
pub struct Pace {
    last: Option<Duration>,
    swaps: u64,
    fast_until: Duration,
    took: Duration,
}

impl Pace {
    /// Whether an exchange is due at `now`, with the rings' swap count
    /// `swaps` (any number that moves when a ring changes); if so, it is
    /// taken as started.
    pub fn due(&mut self, now: Duration, swaps: u64) -> bool {
        if swaps != self.swaps {
            self.swaps = swaps;
            self.fast_until = now + FAST;
        }
        let every = if now < self.fast_until { QUICK } else { EVERY };
        let every = every.max(self.took * 5);
        if self.last.is_some_and(|l| now.saturating_sub(l) < every) {
            return false;
        }
        self.last = Some(now);
        true
    }

    /// The last scan took `took`.
    pub fn scanned(&mut self, took: Duration) {
        self.took = took;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> MaglevTable {
        let addrs: Vec<SocketAddr> = (1..=4)
            .map(|i| format!("10.0.0.{i}:80").parse().unwrap())
            .collect();
        let members: Vec<maglev::Member> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| maglev::Member {
                id: i as u32 + 7,
                addr: *a,
                weight: 1.0,
            })
            .collect();
        MaglevTable {
            service: 3,
            vip: "10.0.100.1:80".parse().unwrap(),
            proto: PROTO_TCP,
            entries: maglev::table(&members, 251),
            backends: members.iter().map(|m| (m.id, m.addr)).collect(),
            seed: 0x5eed,
        }
    }

    fn flow(port: u16, backend: SocketAddr) -> SharedFlow {
        SharedFlow {
            client: "10.9.0.2".parse().unwrap(),
            client_port: port,
            vip: "10.0.100.1:80".parse().unwrap(),
            proto: PROTO_TCP,
            backend,
        }
    }

    #[test]
    fn a_shared_flow_is_the_array_every_release_sends() {
        let f = flow(41000, "10.0.0.12:80".parse().unwrap());
        let j = serde_json::to_string(&f).unwrap();
        assert_eq!(j, r#"["10.9.0.2",41000,"10.0.100.1:80",6,"10.0.0.12:80"]"#);
        assert_eq!(serde_json::from_str::<SharedFlow>(&j).unwrap(), f);
    }

    #[test]
    fn only_flows_the_table_sends_elsewhere_are_shared_and_they_round_trip() {
        let t = vec![table()];
        let (mut explained, mut shared) = (0, 0);
        for port in 1000..1400 {
            for b in t[0].backends.values() {
                let (k, mut v) = entry(&flow(port, *b), &t, 5).unwrap();
                assert_eq!(v.flags, flow_flags::ADOPTED);
                assert_eq!(v.service, 3);
                v.flags = 0;
                let slot = maglev::slot_of(&k, 251, t[0].seed);
                match unexplained(&k, &v, &t) {
                    None => {
                        assert_eq!(t[0].entries[slot], v.backend);
                        explained += 1;
                    }
                    Some(f) => {
                        assert_ne!(t[0].entries[slot], v.backend);
                        assert_eq!(f, flow(port, *b));
                        shared += 1;
                    }
                }
                // Closing and adopted flows are never shared.
                v.flags = flow_flags::CLOSING;
                assert!(unexplained(&k, &v, &t).is_none());
            }
        }
        // One backend in four is the table's for each flow.
        assert_eq!(explained, 400);
        assert_eq!(shared, 1200);
    }

    #[test]
    fn flows_of_services_or_backends_this_balancer_lacks_are_not_written() {
        let t = vec![table()];
        assert!(entry(&flow(1, "10.0.0.9:80".parse().unwrap()), &t, 0).is_none());
        let mut other = flow(1, "10.0.0.1:80".parse().unwrap());
        other.vip = "10.0.100.2:80".parse().unwrap();
        assert!(entry(&other, &t, 0).is_none());
        other.vip = "10.0.100.1:80".parse().unwrap();
        other.proto = 1;
        assert!(entry(&other, &t, 0).is_none());
    }

    #[test]
    fn answers_parse_and_garbage_does_not() {
        let a: FlowsAnswer = serde_json::from_str(
            r#"{"flows":[["10.9.0.2",1000,"10.0.100.1:80",6,"10.0.0.1:80"]]}"#,
        )
        .unwrap();
        assert_eq!(a.flows, vec![flow(1000, "10.0.0.1:80".parse().unwrap())]);
        assert!(!a.truncated);
        assert!(serde_json::from_str::<FlowsAnswer>(r#"{"flows":[["x",1]]}"#).is_err());
    }

    #[test]
    fn the_exchange_runs_each_second_quicker_after_a_ring_change_and_slower_after_a_slow_scan() {
        let ms = Duration::from_millis;
        let mut p = Pace::default();
        // Steady: once a second.
        assert!(p.due(ms(0), 0));
        assert!(!p.due(ms(500), 0));
        assert!(p.due(ms(1000), 0));
        // A ring change: every 200 ms for 2 s, then once a second again.
        assert!(!p.due(ms(1100), 1));
        assert!(p.due(ms(1200), 1));
        assert!(!p.due(ms(1300), 1));
        assert!(p.due(ms(1400), 1));
        assert!(p.due(ms(3000), 1));
        assert!(!p.due(ms(3200), 1), "fast only for 2 s after the change");
        assert!(p.due(ms(4000), 1));
        // A 300 ms scan: at most every 1.5 s, even after a change.
        p.scanned(ms(300));
        assert!(!p.due(ms(5000), 2));
        assert!(p.due(ms(5500), 2));
        assert!(!p.due(ms(6900), 2));
        assert!(p.due(ms(7000), 2));
    }
}
