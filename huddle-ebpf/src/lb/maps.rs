//! The program's maps. Names are the statics' identifiers and must match
//! `huddle_common::maps` (a user-space test checks the built object).

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, ProgramArray},
};
use huddle_common::{
    maglev_elements, Addr, Backend, BackendStats, ClientHop, FlowKey, FlowValue, GlobalStats,
    GuardFilter, HalfOpen, HalfOpenNat, HalfOpenTags, KernelConfig, Latency, NatCursor, NatKey,
    NatValue, NextHop, Pulse, Ring, ServiceBucket, ServiceKey, ServiceKey6, ServiceStats,
    ServiceValue, Tuning, TwHint, CLIENT_HOP_SLOTS, DEFAULT_FLOW_TABLE_SIZE,
    DEFAULT_HALF_OPEN_SIZE, DEFAULT_MAGLEV_SIZE, HALF_OPEN_TAGS_PER_LINE, MAGLEV_MAP_FLAGS,
    MAX_BACKENDS, MAX_GUARDED, MAX_SERVICES, MAX_SNAT, MAX_TW_HINTS, NAT_USED_LINE,
    SERVICE_INDEX_SLOTS, TAIL_SLOTS,
};

/// VIP:port/proto -> service id, and SNAT address -> its index. Written
/// only by the control plane; every packet is looked up here first. Room
/// for both: with `MAX_SERVICES` only, the 64th service found it full.
#[map]
pub static SERVICES: HashMap<ServiceKey, ServiceValue> =
    HashMap::with_max_entries(MAX_SERVICES + MAX_SNAT as u32, 0);

/// `SERVICES` again, as two halves of direct-mapped slots (one live, the
/// other rewritten by the control plane, `KernelConfig::service_half`): an
/// array lookup and one compare, about 6 ns a packet less than the hash,
/// and a miss is as cheap (traffic that is not ours).
#[map]
pub static SERVICE_INDEX: Array<ServiceBucket> =
    Array::with_max_entries(2 * SERVICE_INDEX_SLOTS, 0);

/// IPv6 VIP:port/proto -> service id, and IPv6 SNAT address -> its index.
#[map]
pub static SERVICES6: HashMap<ServiceKey6, ServiceValue> =
    HashMap::with_max_entries(MAX_SERVICES + MAX_SNAT as u32, 0);

/// `TAIL_V6`: the IPv6 program, which the main one hands IPv6 frames to;
/// `TAIL_CSUM`: the checksum finisher (`net::partial`).
#[map]
pub static TAILS: ProgramArray = ProgramArray::with_max_entries(TAIL_SLOTS, 0);

/// Two Maglev tables per service (`huddle_common::maps::MAGLEV`); size
/// set by the control plane.
#[map]
pub static MAGLEV: Array<u64> =
    Array::with_max_entries(maglev_elements(DEFAULT_MAGLEV_SIZE, 2), MAGLEV_MAP_FLAGS);

/// Backend id -> address and port.
#[map]
pub static BACKENDS: Array<Backend> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Two ring slots per service; `RING_GEN` says which one is live.
#[map]
pub static RINGS: Array<Ring> = Array::with_max_entries(MAX_SERVICES * 2, 0);

/// Service id -> ring generation (the live slot is `generation & 1`).
#[map]
pub static RING_GEN: Array<u64> = Array::with_max_entries(MAX_SERVICES, 0);

/// Service id -> this CPU's round-robin position (no shared cache line).
#[map]
pub static RR_CURSOR: PerCpuArray<u32> = PerCpuArray::with_max_entries(MAX_SERVICES, 0);

/// Client flow -> backend and NAT port. Size set by the control plane.
#[map]
pub static FLOWS: LruHashMap<FlowKey, FlowValue> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// Direct server return flows (client flow -> backend), a table of their
/// own: the balancer never sees a DSR flow's answers, so it is promoted
/// on proof it cannot check (any ACK, or any segment with Maglev), and a
/// flood of spoofed ones must not evict a verified source-NAT flow from
/// `FLOWS`. Size set by the control plane (that of `FLOWS`).
#[map]
pub static DSR_FLOWS: LruHashMap<FlowKey, FlowValue> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// Source-NAT UDP flows, a table of their own: a UDP flow is promoted on
/// one exchange (a datagram, the backend's answer, a second datagram),
/// which a client that spoofs its address can make without ever seeing
/// the answer, so a flood of them must not evict a TCP flow from `FLOWS`.
/// Size set by the control plane (that of `FLOWS`).
#[map]
pub static UDP_FLOWS: LruHashMap<FlowKey, FlowValue> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// Backend reply tuple -> client flow, for TCP. Same size as `FLOWS`.
#[map]
pub static NAT: LruHashMap<NatKey, NatValue> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// `NAT` for UDP flows (those of `UDP_FLOWS`), for the same reason.
#[map]
pub static UDP_NAT: LruHashMap<NatKey, NatValue> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// TCP flows between SYN and the client's ACK of the SYN-ACK, one slot per
/// hash of the client tuple. A flood of SYNs only ever takes slots here.
/// Size (a power of two) set by the control plane.
#[map]
pub static HALF_OPEN: Array<HalfOpen> = Array::with_max_entries(DEFAULT_HALF_OPEN_SIZE, 0);

/// The NAT side of half-open flows, one slot per hash of the NAT tuple.
/// Same size as `HALF_OPEN`.
#[map]
pub static HALF_OPEN_NAT: Array<HalfOpenNat> = Array::with_max_entries(DEFAULT_HALF_OPEN_SIZE, 0);

/// `HALF_OPEN`'s short tags, 16 to an element: what a SYN reads first.
#[map]
pub static HALF_OPEN_TAGS: Array<HalfOpenTags> =
    Array::with_max_entries(DEFAULT_HALF_OPEN_SIZE / HALF_OPEN_TAGS_PER_LINE, 0);

/// `HALF_OPEN_NAT`'s short tags, as `HALF_OPEN_TAGS`.
#[map]
pub static HALF_OPEN_NAT_TAGS: Array<HalfOpenTags> =
    Array::with_max_entries(DEFAULT_HALF_OPEN_SIZE / HALF_OPEN_TAGS_PER_LINE, 0);

/// Backend id -> this CPU's cached next hop toward it.
#[map]
pub static NEXT_HOP: PerCpuArray<NextHop> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Client address (`client_hop_slot`) -> this CPU's cached next hop
/// toward it.
#[map]
pub static CLIENT_HOP: PerCpuArray<ClientHop> = PerCpuArray::with_max_entries(CLIENT_HOP_SLOTS, 0);

/// Backend id -> this CPU's position in its NAT tuple slice.
#[map]
pub static NAT_CURSOR: PerCpuArray<NatCursor> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Service id -> how long a backend may owe an answer before new flows
/// pass it over (written by the control plane every tick).
#[map]
pub static TUNING: Array<Tuning> = Array::with_max_entries(MAX_SERVICES, 0);

/// Backend id -> established UDP flows the control plane removed for being
/// idle. Only the control plane touches it; the program only declares it,
/// so it is pinned and outlives a daemon with the other counters.
#[map]
pub static SWEPT: Array<u64> = Array::with_max_entries(MAX_BACKENDS, 0);

/// The last run's tuples in TIME_WAIT (`huddle_common::maps::TW_HINTS`),
/// written by the control plane at a fresh start.
#[map]
pub static TW_HINTS: HashMap<NatKey, TwHint> = HashMap::with_max_entries(MAX_TW_HINTS, 0);

/// Tuples in a backend's TIME_WAIT whose flow entry a new connection on
/// the client tuple replaced (`huddle_common::maps::TW_REUSED`). Size set
/// by the control plane (that of `FLOWS`).
#[map]
pub static TW_REUSED: LruHashMap<NatKey, TwHint> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// Until when any of `TW_HINTS` matters (0: none).
#[map]
pub static TW_HINTS_UNTIL: Array<u64> = Array::with_max_entries(1, 0);

/// Which NAT tuples `NAT` may hold (`huddle_common::maps::NAT_USED`);
/// sized by the control plane.
#[map]
pub static NAT_USED: Array<[u8; NAT_USED_LINE]> = Array::with_max_entries(1, 0);

/// Addresses the services name, not the host's own (`lb::guard`).
#[map]
pub static GUARDED: HashMap<Addr, u8> = HashMap::with_max_entries(MAX_GUARDED, 0);

/// Which addresses `GUARDED` may hold, a bit per hash.
#[map]
pub static GUARD_FILTER: Array<GuardFilter> = Array::with_max_entries(1, 0);

/// Data plane settings (SNAT addresses, NAT port range and slices).
#[map]
pub static CONFIG: Array<KernelConfig> = Array::with_max_entries(1, 0);

#[map]
pub static BACKEND_STATS: PerCpuArray<BackendStats> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static SERVICE_STATS: PerCpuArray<ServiceStats> =
    PerCpuArray::with_max_entries(MAX_SERVICES, 0);

#[map]
pub static GLOBAL_STATS: PerCpuArray<GlobalStats> = PerCpuArray::with_max_entries(1, 0);

/// Backend id -> this CPU's time-to-first-byte histogram.
#[map]
pub static LATENCY: PerCpuArray<Latency> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Backend id -> this CPU's time-to-first-byte histogram of the samples
/// of the backend's heavy source (`HEAVY`); `LATENCY` has the others.
#[map]
pub static LATENCY_HEAVY: PerCpuArray<Latency> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Backend id -> the source that gave most of this CPU's recent samples
/// of it (`lb::latency::sources`).
#[map]
pub static HEAVY: PerCpuArray<huddle_common::HeavySource> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Backend id -> this CPU's connect-time (SYN to SYN-ACK) histogram.
#[map]
pub static CONNECT: PerCpuArray<Latency> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Backend id -> since when it owes an answer. Shared by all CPUs: it must
/// see a request on one CPU and the answer on another.
#[map]
pub static PULSE: Array<Pulse> = Array::with_max_entries(MAX_BACKENDS, 0);

/// This CPU's kernel log gate (`loglimit`). Not pinned.
#[map]
pub static LOG_GATE: PerCpuArray<huddle_common::LogGate> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's ICMP gate (`icmp::gate`). Not pinned.
#[map]
pub static ICMP_GATE: PerCpuArray<huddle_common::IcmpGate> = PerCpuArray::with_max_entries(1, 0);

/// Runs `f` on this CPU's counters of entry `index`, if it exists.
#[inline(always)]
pub fn bump<T>(map: &PerCpuArray<T>, index: u32, f: impl FnOnce(&mut T)) {
    if let Some(p) = map.get_ptr_mut(index) {
        // SAFETY: a per-CPU array element is only touched by this CPU, and
        // the program is not re-entered on one CPU while it runs.
        f(unsafe { &mut *p });
    }
}

#[inline(always)]
pub fn global(f: impl FnOnce(&mut GlobalStats)) {
    bump(&GLOBAL_STATS, 0, f);
}
