//! Map names, as the XDP program declares them (the static's identifier).

/// `HashMap<ServiceKey, ServiceValue>`: the IPv4 addresses the
/// program answers for: each VIP:port/proto balanced, and each SNAT
/// address.
pub const SERVICES: &str = "SERVICES";
/// `HashMap<ServiceKey6, ServiceValue>`: the same for IPv6.
pub const SERVICES6: &str = "SERVICES6";
/// `Array<ServiceEntry>`: `SERVICES` as direct-mapped slots, two
/// halves of `SERVICE_INDEX_SLOTS` (`KernelConfig::service_half` names the
/// live one). Lives and dies with `CONFIG`, which says which half.
pub const SERVICE_INDEX: &str = "SERVICE_INDEX";
/// `ProgramArray` of one entry: the IPv6 program (`huddle6`), which
/// the main program hands IPv6 frames to (a tail call: its own
/// verification and its own 512 bytes of stack).
pub const TAILS: &str = "TAILS";
/// `Array<Backend>` indexed by backend id.
pub const BACKENDS: &str = "BACKENDS";
/// `Array<Ring>` of two slots per service (double buffer).
pub const RINGS: &str = "RINGS";
/// `Array<u64>` indexed by service id: ring generation; slot = gen & 1.
pub const RING_GEN: &str = "RING_GEN";
/// `PerCpuArray<u32>` indexed by service id: round-robin cursor.
pub const RR_CURSOR: &str = "RR_CURSOR";
/// `LruHashMap<FlowKey, FlowValue>`: client flow -> backend and NAT port.
pub const FLOWS: &str = "FLOWS";
/// `LruHashMap<FlowKey, FlowValue>`: direct server return flows, apart
/// from `FLOWS` (promoted on proof the balancer cannot check, so a flood
/// of them never evicts a source-NAT flow). Sized as `FLOWS`.
pub const DSR_FLOWS: &str = "DSR_FLOWS";
/// `LruHashMap<FlowKey, FlowValue>`: source-NAT UDP flows, apart from
/// `FLOWS` (promoted on one exchange, which a spoofer can make blind).
/// Sized as `FLOWS`.
pub const UDP_FLOWS: &str = "UDP_FLOWS";
/// `LruHashMap<NatKey, NatValue>`: backend reply tuple -> client flow (TCP).
pub const NAT: &str = "NAT";
/// `LruHashMap<NatKey, NatValue>`: `NAT` for the flows of `UDP_FLOWS`.
pub const UDP_NAT: &str = "UDP_NAT";
/// `Array<KernelConfig>` of one element.
pub const CONFIG: &str = "CONFIG";
/// `PerCpuArray<BackendStats>` indexed by backend id.
pub const BACKEND_STATS: &str = "BACKEND_STATS";
/// `PerCpuArray<ServiceStats>` indexed by service id.
pub const SERVICE_STATS: &str = "SERVICE_STATS";
/// `PerCpuArray<GlobalStats>` of one element.
pub const GLOBAL_STATS: &str = "GLOBAL_STATS";
/// `PerCpuArray<Latency>` indexed by backend id: time-to-first-byte
/// histogram.
pub const LATENCY: &str = "LATENCY";
/// `PerCpuArray<Latency>` indexed by backend id: the time-to-first-byte
/// samples of the backend's heavy source (`HEAVY`); `LATENCY` has the
/// rest.
pub const LATENCY_HEAVY: &str = "LATENCY_HEAVY";
/// `PerCpuArray<HeavySource>` indexed by backend id: the client /24s
/// (/64s) that give most of this CPU's samples of the backend.
pub const HEAVY: &str = "HEAVY";
/// `PerCpuArray<Latency>` indexed by backend id: SYN to SYN-ACK
/// (connect time) histogram.
pub const CONNECT: &str = "CONNECT";
/// `Array<Pulse>` indexed by backend id: since when the backend owes an
/// answer (shared by all CPUs).
pub const PULSE: &str = "PULSE";
/// `Array<HalfOpen>`: TCP flows whose handshake is not complete, one
/// slot per hash of the client tuple. Kept apart so a SYN flood never
/// evicts an established flow.
pub const HALF_OPEN: &str = "HALF_OPEN";
/// `Array<HalfOpenNat>`: the NAT side of half-open flows, one slot per
/// hash of the NAT tuple.
pub const HALF_OPEN_NAT: &str = "HALF_OPEN_NAT";
/// `Array<HalfOpenTags>`: the short tags of `HALF_OPEN`'s slots,
/// `HALF_OPEN_TAGS_PER_LINE` to an element (see `HalfOpenTags`).
pub const HALF_OPEN_TAGS: &str = "HALF_OPEN_TAGS";
/// `Array<HalfOpenTags>`: the short tags of `HALF_OPEN_NAT`'s slots.
pub const HALF_OPEN_NAT_TAGS: &str = "HALF_OPEN_NAT_TAGS";
/// `PerCpuArray<NextHop>` indexed by backend id: the FIB's answer for
/// it, reused while `KernelConfig::hop_generation` is unchanged.
pub const NEXT_HOP: &str = "NEXT_HOP";
/// `PerCpuArray<ClientHop>`, `CLIENT_HOP_SLOTS` slots by address: the
/// FIB's answer toward clients, reused while `KernelConfig::hop_generation`
/// is unchanged. Never pinned (a cache; the control plane never reads
/// it).
pub const CLIENT_HOP: &str = "CLIENT_HOP";
/// `PerCpuArray<NatCursor>` indexed by backend id: where this CPU's
/// walk over its slice of NAT tuples toward the backend stands.
pub const NAT_CURSOR: &str = "NAT_CURSOR";
/// `Array<Tuning>` indexed by service id: the thresholds past which a
/// backend that owes an answer is passed over for new flows.
pub const TUNING: &str = "TUNING";
/// `Array<u64>` indexed by backend id: established UDP flows the
/// control plane removed after their idle timeout (closes the program
/// never saw), written by the control plane only.
pub const SWEPT: &str = "SWEPT";
/// `HashMap<NatKey, TwHint>`: the last run's tuples the backends may
/// still hold in TIME_WAIT, with the client's last timestamp, written
/// by the control plane at a fresh start (see `TwHint`).
pub const TW_HINTS: &str = "TW_HINTS";
/// `Array<u64>` of one element: until when (`bpf_ktime_get_ns`) any
/// of `TW_HINTS` can matter; 0: none loaded.
pub const TW_HINTS_UNTIL: &str = "TW_HINTS_UNTIL";
/// `LruHashMap<NatKey, TwHint>`: tuples whose last connection the
/// backend holds in TIME_WAIT, kept when a new connection on the same
/// client tuple replaced that connection's flow entry (whose timestamp
/// `reclaim` otherwise reads). A client that reuses its ports sooner
/// than the walk comes back to a tuple (wrk: every ~1.2 s at 24,000 new
/// connections a second) left no trace of them. Never pinned (a cache):
/// sized as `FLOWS`.
pub const TW_REUSED: &str = "TW_REUSED";
/// `Array<[u8; NAT_USED_LINE]>`: per backend id and NAT tuple, one
/// byte, nonzero while `NAT` may hold an entry for the tuple, so a new
/// flow asks `NAT` (a cold hash bucket) only then. Laid out as the walk
/// goes (`KernelConfig::nat_used_per_backend`), so a SYN reads the line the
/// one before it read. Never pinned: a load that adopts a running data
/// plane's `NAT` sets every byte (`Dataplane::load`).
pub const NAT_USED: &str = "NAT_USED";

/// Every map the control plane opens, for checks against the object.
/// `Array<u64>` (mmapable) of two Maglev lookup tables per service,
/// `maglev_table_size` backend ids each (16 bits, four to an element;
/// `MAGLEV_EMPTY`: none), entry `ring_slot(service, gen) * size + i`:
/// written by the control plane with the ring, in the same double
/// buffer.
pub const MAGLEV: &str = "MAGLEV";
/// `HashMap<Addr, u8>`: addresses the services name (VIPs, backends) that
/// are not the host's own, each with its `guard_kind` bits. Traffic to
/// them the program does not balance is dropped, never forwarded by the
/// kernel (a routing loop for a VIP, an open path to a backend).
pub const GUARDED: &str = "GUARDED";
/// `Array<GuardFilter>`, one element: which addresses `GUARDED` may
/// hold, a bit per hash (`guard_bit`); written as a superset of it.
pub const GUARD_FILTER: &str = "GUARD_FILTER";
pub const ALL: [&str; 35] = [
    SERVICES,
    SERVICES6,
    SERVICE_INDEX,
    TAILS,
    BACKENDS,
    RINGS,
    RING_GEN,
    RR_CURSOR,
    FLOWS,
    NAT,
    CONFIG,
    BACKEND_STATS,
    SERVICE_STATS,
    GLOBAL_STATS,
    LATENCY,
    LATENCY_HEAVY,
    HEAVY,
    PULSE,
    HALF_OPEN,
    HALF_OPEN_NAT,
    HALF_OPEN_TAGS,
    HALF_OPEN_NAT_TAGS,
    NEXT_HOP,
    NAT_CURSOR,
    CONNECT,
    TUNING,
    SWEPT,
    MAGLEV,
    TW_HINTS,
    TW_HINTS_UNTIL,
    GUARDED,
    GUARD_FILTER,
    DSR_FLOWS,
    UDP_FLOWS,
    UDP_NAT,
];
