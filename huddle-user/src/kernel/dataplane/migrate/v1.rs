//! Layout 1: the previous release (`fabdcf1`), which recorded no layout
//! number, and how its maps become this build's.
//!
//! What changed since: `Backend` swapped its `service` (u8 to u32) and
//! `flags` (u32 to u8) fields at the same size; `Ring` lost its member
//! bitmap; `Pulse` gained the evidence fields; `NatValue`'s padding became
//! `backend_seq`; `Config` became `KernelConfig` (plus `maglev_seed`);
//! the counters were renamed, added and dropped; and DSR flows, source-NAT
//! UDP flows and UDP NAT entries moved out of `FLOWS` and `NAT` into
//! tables of their own (`DSR_FLOWS`, `UDP_FLOWS`, `UDP_NAT`).

use super::{counts::Counted, tally::Tally};
use crate::kernel::rawmap::{pod_bytes as bytes, read_pod as from_bytes, RawMap, ANY};
use anyhow::{Context, Result};
use huddle_common::{
    flow_flags, maps, service_mode, short_tag, Backend, BackendStats, FlowKey, FlowValue,
    GlobalStats, HalfOpenNat, HalfOpenTags, KernelConfig, NatCursor, NatKey, NatValue, Pulse, Ring,
    ServiceStats, HALF_OPEN_TAGS_PER_LINE, MAX_SNAT, PROTO_UDP,
};
use std::{
    collections::{HashMap, HashSet},
    path::Path,
};

/// Its number.
pub(super) const LAYOUT: u32 = 1;

/// Its maps (the names it pinned).
pub(super) const MAPS: [&str; 28] = [
    maps::SERVICES,
    maps::SERVICES6,
    maps::SERVICE_INDEX,
    maps::TAILS,
    maps::BACKENDS,
    maps::RINGS,
    maps::RING_GEN,
    maps::RR_CURSOR,
    maps::FLOWS,
    maps::NAT,
    maps::CONFIG,
    maps::BACKEND_STATS,
    maps::SERVICE_STATS,
    maps::GLOBAL_STATS,
    maps::LATENCY,
    maps::PULSE,
    maps::HALF_OPEN,
    maps::HALF_OPEN_NAT,
    maps::HALF_OPEN_TAGS,
    maps::HALF_OPEN_NAT_TAGS,
    maps::NEXT_HOP,
    maps::NAT_CURSOR,
    maps::CONNECT,
    maps::TUNING,
    maps::SWEPT,
    maps::MAGLEV,
    maps::TW_HINTS,
    maps::TW_HINTS_UNTIL,
];

/// Its `Config`: `KernelConfig` without `maglev_seed`.
const CONFIG_SIZE: usize = 16 * MAX_SNAT + 104;
/// Its `Ring`: this build's, then a bitmap of 1,024 members.
const RING_SIZE: usize = size_of::<Ring>() + 8 * 16;
/// Its `Pulse`: `turn_wait_ns` and `syn_wait_ns`.
const PULSE_SIZE: usize = 16;

/// Its counters, in layout order.
const BACKEND_COUNTERS: [&str; 23] = [
    "pkts_to",
    "bytes_to",
    "pkts_from",
    "bytes_from",
    "flows_new",
    "flows_closed",
    "rsts_from",
    "syns",
    "syn_acks",
    "connect_ns",
    "refused",
    "turns",
    "answered",
    "ttfb_ns",
    "reset_turns",
    "abandoned",
    "flows_moved",
    "nat_reuse_early",
    "nat_tw_skipped",
    "retried_refused",
    "retried_time_wait",
    "retried_silent",
    "skipped_owing",
];
const SERVICE_COUNTERS: [&str; 11] = [
    "pkts",
    "bytes",
    "flows_new",
    "pass_no_flow",
    "drop_no_backend",
    "drop_nat_ports",
    "drop_flow_table",
    "half_open",
    "promoted",
    "half_open_lost",
    "taken_over",
];
const GLOBAL_COUNTERS: [&str; 20] = [
    "pass_not_ipv4",
    "pass_not_service",
    "pass_no_nat",
    "pass_ip_options",
    "pass_fragment",
    "pass_malformed",
    "pass_no_neigh",
    "pass_no_route",
    "tx",
    "redirect",
    "ring_retry",
    "ring_stray",
    "encap",
    "drop_no_neigh",
    "drop_not_onlink",
    "drop_encap",
    "pass_v6_ext",
    "icmp_too_big",
    "icmp_translated",
    "encap_fragmented",
];

/// Whether `dir` holds layout 1: its `CONFIG`, `RINGS` and `PULSE`, and
/// none of the tables that came after it.
pub(super) fn matches(dir: &Path) -> Result<bool> {
    let size = |name: &str| -> Result<Option<usize>> {
        let p = dir.join(name);
        if !p.exists() {
            return Ok(None);
        }
        Ok(Some(RawMap::open(&p)?.value_size))
    };
    Ok(size(maps::CONFIG)? == Some(CONFIG_SIZE)
        && size(maps::RINGS)? == Some(RING_SIZE)
        && size(maps::PULSE)? == Some(PULSE_SIZE)
        && !dir.join(maps::UDP_FLOWS).exists())
}

/// Its `CONFIG` as this build's: the hash seed (half-open slots stay
/// findable) and next-hop generation carried; the service index, made
/// afresh, starts at its first half.
pub(super) fn config(old: &Path) -> Result<Option<KernelConfig>> {
    let p = old.join(maps::CONFIG);
    if !p.exists() {
        return Ok(None);
    }
    let m = RawMap::open(&p)?;
    let Some(v) = m.get(&0u32.to_ne_bytes())? else {
        return Ok(None);
    };
    if v.len() != CONFIG_SIZE {
        return Ok(None);
    }
    let mut bytes = [0u8; size_of::<KernelConfig>()];
    bytes[..CONFIG_SIZE].copy_from_slice(&v);
    let mut c: KernelConfig = from_bytes(&bytes);
    c.service_half = 0;
    c.service_mul = [0; 2];
    c.maglev_seed = 0;
    c.layout = 0;
    Ok(Some(c))
}

/// Each CPU's NAT cursors (per-CPU `NatCursor`s) half of their walk
/// (`walk`: ports of a CPU's slice, SNAT addresses) ahead. The old
/// program goes on handing out tuples from its cursors until the swap; a
/// new program starting where they stood at the copy would hand the same
/// tuples out again before the pass after the swap carried their NAT
/// entries (a handshake's, in a half-open slot, the walk never asks
/// about), and two connections would share one tuple. Half a walk ahead,
/// the two stay apart unless the old program hands out half a walk of
/// tuples in its last moments; the tuples skipped rest longer.
fn ahead(v: &[u8], (ports, addrs): (u32, u32)) -> Vec<u8> {
    let mut out = v.to_vec();
    let all = ports * addrs;
    if all == 0 {
        return out;
    }
    for cpu in out.chunks_exact_mut(size_of::<NatCursor>().next_multiple_of(8)) {
        let mut c: NatCursor = from_bytes(cpu);
        let at = (c.addr % addrs) * ports + c.port % ports;
        let to = (at + all / 2) % all;
        (c.addr, c.port) = (to / ports, to % ports);
        cpu[..size_of::<NatCursor>()].copy_from_slice(&bytes(&c));
    }
    out
}

/// The flow and NAT keys a pass wrote (or found written): the next pass
/// writes only the others.
#[derive(Default)]
pub(super) struct Copied {
    flows: Keys,
    nat: Keys,
}

/// A set of keys of one map.
#[derive(Default)]
struct Keys(HashSet<Vec<u8>>);

impl Keys {
    /// Adds `key`; false if it was there.
    fn insert(&mut self, key: &[u8]) -> bool {
        !self.0.contains(key) && self.0.insert(key.to_vec())
    }
}

/// Copies layout 1's maps in `old` into this build's in `new`; `flows`:
/// the flow and NAT tables too, noting their keys there (`None` only for
/// the upgrade test's control); `at_copy` keeps the counters as read.
pub(super) fn copy(
    old: &Path,
    new: &Path,
    flows: Option<&mut Copied>,
    at_copy: &mut Counted,
    tally: &mut Tally,
) -> Result<()> {
    for (name, kind) in [
        (maps::SERVICES, "services"),
        (maps::SERVICES6, "IPv6 services"),
        (maps::RING_GEN, "ring generations"),
        (maps::RR_CURSOR, "round-robin cursors"),
        (maps::LATENCY, "latency histograms"),
        (maps::CONNECT, "connect histograms"),
        (maps::SWEPT, "swept counts"),
        (maps::TW_HINTS, "TIME_WAIT hints"),
        (maps::TW_HINTS_UNTIL, "TIME_WAIT hint expiries"),
    ] {
        same(old, new, name, kind, tally)?;
    }
    let walk = config(old)?.map_or((0, 0), |c| {
        (
            u32::from(c.slice_ports),
            u32::from(c.snat_count.max(c.snat6_count).max(1)),
        )
    });
    translate(old, new, maps::NAT_CURSOR, "NAT cursors", tally, |v| {
        Some(ahead(v, walk))
    })?;
    translate(old, new, maps::BACKENDS, "backends", tally, |v| {
        // addr, port, family, then service (u8) and flags (u32).
        let mut b: Backend = from_bytes(&v[..size_of::<Backend>()]);
        b.flags = v[20];
        b.service = u32::from(v[19]);
        Some(bytes(&b))
    })?;
    translate(old, new, maps::RINGS, "rings", tally, |v| {
        Some(v[..size_of::<Ring>()].to_vec())
    })?;
    translate(old, new, maps::PULSE, "owed answers", tally, |v| {
        let mut p = vec![0u8; size_of::<Pulse>()];
        p[..PULSE_SIZE].copy_from_slice(&v[..PULSE_SIZE]);
        Some(p)
    })?;
    counts(old, new, at_copy, tally)?;
    if let Some(copied) = flows {
        copy_flows(old, new, ANY, tally, copied)?;
    }
    Ok(())
}

/// Flows, NAT entries and handshakes under way, each into its table of
/// this build (`flags`: `ANY`, or `NOEXIST` after the swap, leaving the
/// new program's own), but for the keys in `copied`, to which it adds
/// those it wrote.
pub(super) fn copy_flows(
    old: &Path,
    new: &Path,
    flags: u64,
    tally: &mut Tally,
    copied: &mut Copied,
) -> Result<()> {
    half_open(old, new, tally)?;
    let modes = service_modes(old)?;
    let src = RawMap::open(&old.join(maps::FLOWS))?;
    let to = |name| RawMap::open(&new.join(name));
    let (tcp, dsr, udp) = (to(maps::FLOWS)?, to(maps::DSR_FLOWS)?, to(maps::UDP_FLOWS)?);
    for (key, v) in src.entries()?.iter() {
        if !copied.flows.insert(key) {
            continue;
        }
        if key.len() != size_of::<FlowKey>() || v.len() != size_of::<FlowValue>() {
            tally.drop("flows", 1);
            continue;
        }
        let k: FlowKey = from_bytes(key);
        let mut f: FlowValue = from_bytes(v);
        let mode = modes.get(&f.service).copied().unwrap_or(service_mode::SNAT);
        let (dst, kind) = if mode != service_mode::SNAT {
            (&dsr, "DSR flows")
        } else if k.proto == PROTO_UDP {
            // Held as an established flow by the old build: kept for the
            // service's idle timeout, not the unconfirmed one.
            f.flags |= flow_flags::UDP_CONFIRMED;
            (&udp, "UDP flows")
        } else {
            (&tcp, "TCP flows")
        };
        put(dst, key, &bytes(&f), flags, kind, tally);
    }
    let src = RawMap::open(&old.join(maps::NAT))?;
    let (tcp, udp) = (to(maps::NAT)?, to(maps::UDP_NAT)?);
    for (key, v) in src.entries()?.iter() {
        if !copied.nat.insert(key) {
            continue;
        }
        if key.len() != size_of::<NatKey>() || v.len() != size_of::<NatValue>() {
            tally.drop("NAT entries", 1);
            continue;
        }
        let k: NatKey = from_bytes(key);
        let mut n: NatValue = from_bytes(v);
        // Padding in layout 1: no backend sequence number seen yet.
        n.backend_seq = 0;
        let (dst, kind) = if k.proto == PROTO_UDP {
            (&udp, "UDP NAT entries")
        } else {
            (&tcp, "TCP NAT entries")
        };
        put(dst, key, &bytes(&n), flags, kind, tally);
    }
    Ok(())
}

/// The handshakes under way: each taken slot of `HALF_OPEN` and
/// `HALF_OPEN_NAT` into the same slot of the new table where that one is
/// empty, its short tag set to match. Made twice: at the copy, and after
/// the swap for the SYNs the old program took in between (without it the
/// client's ACK, or the backend's SYN-ACK, of such a handshake finds
/// nothing in the new program and the connection stalls). Slots hash with
/// the old seed, which `CONFIG` carries; a table of another size is not
/// carried (its slots would be elsewhere).
fn half_open(old: &Path, new: &Path, tally: &mut Tally) -> Result<()> {
    let tables = [
        (maps::HALF_OPEN, maps::HALF_OPEN_TAGS, "half-open slots"),
        (
            maps::HALF_OPEN_NAT,
            maps::HALF_OPEN_NAT_TAGS,
            "half-open NAT slots",
        ),
    ];
    for (slots, tags, kind) in tables {
        let (Some((src, dst)), Some((src_tags, dst_tags))) =
            (pair(old, new, slots)?, pair(old, new, tags)?)
        else {
            continue;
        };
        // Which slots are taken, from the short tags both builds keep
        // equal to the slots' (a 256 KiB read, not 8 MiB of slots).
        let lanes = |m: &RawMap| -> Result<Vec<u32>> {
            Ok(m.entries()?
                .iter()
                .flat_map(|(_, v)| from_bytes::<HalfOpenTags>(v).tags)
                .collect())
        };
        let old_lanes = lanes(&src_tags)?;
        if src.max_entries != dst.max_entries || src.value_len != dst.value_len {
            tally.drop(kind, old_lanes.iter().filter(|t| **t != 0).count() as u64);
            continue;
        }
        let new_lanes = lanes(&dst_tags)?;
        let taken = |v: &[u8]| v.len() >= 8 && v[..8].iter().any(|b| *b != 0);
        for (i, _) in old_lanes
            .iter()
            .zip(&new_lanes)
            .enumerate()
            .filter(|(i, (o, n))| **o != 0 && **n == 0 && (*i as u32) < src.max_entries)
        {
            let i = i as u32;
            let key = i.to_ne_bytes();
            let Some(mut v) = src.get(&key)?.filter(|v| taken(v)) else {
                continue;
            };
            if dst.get(&key)?.is_some_and(|d| taken(&d)) {
                continue;
            }
            if slots == maps::HALF_OPEN_NAT {
                // Padding in layout 1: no backend sequence number seen yet.
                let mut h: HalfOpenNat = from_bytes(&v);
                h.nat.backend_seq = 0;
                v = bytes(&h);
            }
            let tag = u64::from_ne_bytes(v[..8].try_into()?);
            put(&dst, &key, &v, ANY, kind, tally);
            // The line read again just before it is written: the new
            // program may have set another lane of it meanwhile.
            let line = (i / HALF_OPEN_TAGS_PER_LINE).to_ne_bytes();
            let mut t: HalfOpenTags = dst_tags.get(&line)?.map_or(
                HalfOpenTags {
                    tags: [0; HALF_OPEN_TAGS_PER_LINE as usize],
                },
                |b| from_bytes(&b),
            );
            t.tags[(i % HALF_OPEN_TAGS_PER_LINE) as usize] = short_tag(tag);
            dst_tags.put(&line, &bytes(&t), ANY)?;
        }
    }
    Ok(())
}

/// Each service id's mode, from layout 1's `SERVICES` and `SERVICES6`
/// (a SNAT address's entry, mode 0, never hides a VIP's).
fn service_modes(old: &Path) -> Result<HashMap<u32, u32>> {
    let mut modes = HashMap::new();
    for name in [maps::SERVICES, maps::SERVICES6] {
        let p = old.join(name);
        if !p.exists() {
            continue;
        }
        let m = RawMap::open(&p)?;
        for (_, v) in m.entries()?.iter().filter(|(_, v)| v.len() == 8) {
            let id = u32::from_ne_bytes(v[..4].try_into()?);
            let mode = u32::from_ne_bytes(v[4..8].try_into()?);
            let e = modes.entry(id).or_insert(mode);
            *e = (*e).max(mode);
        }
    }
    Ok(modes)
}

fn put(dst: &RawMap, key: &[u8], value: &[u8], flags: u64, kind: &'static str, tally: &mut Tally) {
    match dst.put(key, value, flags) {
        Ok(true) => tally.carry(kind, 1),
        Ok(false) => {}
        Err(_) => tally.drop(kind, 1),
    }
}

/// A map laid out alike in both builds: copied element by element (an
/// array's zero elements left, as the new map has them).
fn same(old: &Path, new: &Path, name: &str, kind: &'static str, tally: &mut Tally) -> Result<()> {
    let Some((src, dst)) = pair(old, new, name)? else {
        return Ok(());
    };
    if src.key_size != dst.key_size || src.value_len != dst.value_len {
        tally.drop(kind, src.entries()?.len() as u64);
        return Ok(());
    }
    each(&src, &dst, kind, tally, |v| Some(v.to_vec()))
}

/// A map whose values `f` turns into this build's (per-CPU values whole).
fn translate(
    old: &Path,
    new: &Path,
    name: &str,
    kind: &'static str,
    tally: &mut Tally,
    f: impl Fn(&[u8]) -> Option<Vec<u8>>,
) -> Result<()> {
    let Some((src, dst)) = pair(old, new, name)? else {
        return Ok(());
    };
    each(&src, &dst, kind, tally, f)
}

/// The counters: copied (`at` empty, which then keeps what it read), or
/// grown by what the old ones counted since `at` was read (after the
/// swap: the old program counted on until then).
pub(super) fn counts(old: &Path, new: &Path, at: &mut Counted, tally: &mut Tally) -> Result<()> {
    let both = |name| pair(old, new, name);
    if let Some((src, dst)) = both(maps::BACKEND_STATS)? {
        let names = &BACKEND_COUNTERS;
        at.carry::<BackendStats>(maps::BACKEND_STATS, (&src, &dst), names, tally)?;
    }
    if let Some((src, dst)) = both(maps::SERVICE_STATS)? {
        let names = &SERVICE_COUNTERS;
        at.carry::<ServiceStats>(maps::SERVICE_STATS, (&src, &dst), names, tally)?;
    }
    if let Some((src, dst)) = both(maps::GLOBAL_STATS)? {
        let names = &GLOBAL_COUNTERS;
        at.carry::<GlobalStats>(maps::GLOBAL_STATS, (&src, &dst), names, tally)?;
    }
    Ok(())
}

/// Both maps named `name`; `None` if the old build had none.
fn pair(old: &Path, new: &Path, name: &str) -> Result<Option<(RawMap, RawMap)>> {
    let p = old.join(name);
    if !p.exists() || !new.join(name).exists() {
        return Ok(None);
    }
    Ok(Some((
        RawMap::open(&p)?,
        RawMap::open(&new.join(name)).with_context(|| format!("the new {name}"))?,
    )))
}

/// Every element of `src` turned by `f` into `dst`; an array's zero
/// elements skipped, and those past `dst`'s end counted as not carried.
fn each(
    src: &RawMap,
    dst: &RawMap,
    kind: &'static str,
    tally: &mut Tally,
    f: impl Fn(&[u8]) -> Option<Vec<u8>>,
) -> Result<()> {
    for (key, v) in src.entries()?.iter() {
        if src.array && v.iter().all(|b| *b == 0) {
            continue;
        }
        if src.array && u32::from_ne_bytes(key[..4].try_into()?) >= dst.max_entries {
            tally.drop(kind, 1);
            continue;
        }
        match f(v).filter(|n| n.len() == dst.value_len) {
            Some(n) => put(dst, key, &n, ANY, kind, tally),
            None => tally.drop(kind, 1),
        }
    }
    Ok(())
}
