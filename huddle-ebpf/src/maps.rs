//! The program's maps. Names are the statics' identifiers and must match
//! `huddle_common::maps` (a user-space test checks the built object).

use aya_ebpf::{
    bindings::BPF_F_NO_COMMON_LRU,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use huddle_common::{
    Backend, BackendStats, Config, FlowKey, FlowValue, GlobalStats, Latency, NatKey, NatValue,
    NextHop, Pulse, Ring, ServiceKey, ServiceStats, ServiceValue, DEFAULT_FLOW_TABLE_SIZE,
    DEFAULT_HALF_OPEN_SIZE, MAX_BACKENDS, MAX_SERVICES,
};

/// VIP:port/proto -> service id. Written only by the control plane.
#[map]
pub static SERVICES: HashMap<ServiceKey, ServiceValue> = HashMap::with_max_entries(MAX_SERVICES, 0);

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

/// Backend reply tuple -> client flow. Same size as `FLOWS`.
#[map]
pub static NAT: LruHashMap<NatKey, NatValue> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// TCP flows between SYN and the client's ACK of the SYN-ACK. A flood of
/// SYNs only ever evicts entries here. Size set by the control plane.
/// Every new flow inserts here: per-CPU LRU lists keep those inserts off a
/// shared lock (the table itself is shared, so any CPU finds any entry).
#[map]
pub static HALF_OPEN: LruHashMap<FlowKey, FlowValue> =
    LruHashMap::with_max_entries(DEFAULT_HALF_OPEN_SIZE, BPF_F_NO_COMMON_LRU);

/// NAT entries of half-open flows. Same size as `HALF_OPEN`.
#[map]
pub static HALF_OPEN_NAT: LruHashMap<NatKey, NatValue> =
    LruHashMap::with_max_entries(DEFAULT_HALF_OPEN_SIZE, BPF_F_NO_COMMON_LRU);

/// Backend id -> this CPU's cached next hop toward it.
#[map]
pub static NEXT_HOP: PerCpuArray<NextHop> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Data plane settings (SNAT address, NAT port range).
#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

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

/// Backend id -> since when it owes an answer. Shared by all CPUs: it must
/// see a request on one CPU and the answer on another.
#[map]
pub static PULSE: Array<Pulse> = Array::with_max_entries(MAX_BACKENDS, 0);

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
