//! Types shared by the XDP program and the control plane.
//!
//! Every map name, size and on-map layout lives here, once. All types are
//! `#[repr(C)]`, `Copy`, made of fixed-width integers with explicit padding
//! (no `bool`, enum or `Option`), so the kernel and user space agree byte for
//! byte. Sizes are asserted at compile time. Keys and values the packet path
//! builds on its stack are 8-byte aligned: the BPF backend then fills and
//! copies them with word stores instead of calls to byte-wise memset and
//! memmove.
//!
//! Addresses in flow and NAT keys are always 16 bytes with a family tag;
//! an IPv4 address sits in the first 4 bytes in network order and the
//! other 12 are zero.
#![no_std]

pub mod latency;
pub mod stats;

pub use latency::{latency_bucket, Latency, Pulse, LATENCY_BUCKETS};
pub use stats::{BackendStats, Counters, DecapStats, GlobalStats, ServiceStats};

/// Map names, as the XDP program declares them (the static's identifier).
pub mod maps {
    /// `HashMap<ServiceKey, ServiceValue>`: the IPv4 addresses the
    /// program answers for: each VIP:port/proto balanced, and each SNAT
    /// address.
    pub const SERVICES: &str = "SERVICES";
    /// `HashMap<ServiceKey6, ServiceValue>`: the same for IPv6.
    pub const SERVICES6: &str = "SERVICES6";
    /// `Array<ServiceEntry>`: `SERVICES` as direct-mapped slots, two
    /// halves of `SERVICE_INDEX_SLOTS` (`Config::service_half` names the
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
    /// `LruHashMap<NatKey, NatValue>`: backend reply tuple -> client flow.
    pub const NAT: &str = "NAT";
    /// `Array<Config>` of one element.
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
    /// it, reused while `Config::hop_generation` is unchanged.
    pub const NEXT_HOP: &str = "NEXT_HOP";
    /// `PerCpuArray<ClientHop>`, `CLIENT_HOP_SLOTS` slots by address: the
    /// FIB's answer toward clients, reused while `Config::hop_generation`
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
    /// `Array<[u8; NAT_USED_LINE]>`: per backend id and NAT tuple, one
    /// byte, nonzero while `NAT` may hold an entry for the tuple, so a new
    /// flow asks `NAT` (a cold hash bucket) only then. Laid out as the walk
    /// goes (`Config::nat_used_per_backend`), so a SYN reads the line the
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
    pub const ALL: [&str; 28] = [
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
    ];
}

/// Name of the XDP program in the object.
pub const PROGRAM_NAME: &str = "huddle";
/// Name of the IPv6 program the main one tail-calls.
pub const PROGRAM6_NAME: &str = "huddle6";

/// The backend agent's decap object (`decap`): its program and maps.
pub mod decap {
    /// The XDP program.
    pub const PROGRAM: &str = "decap";
    /// `HashMap<Addr, u32>`: this host's addresses; only IP-in-IP packets
    /// to one of them are unwrapped.
    pub const LOCAL: &str = "DECAP_LOCAL";
    /// `PerCpuArray<DecapStats>` of one element.
    pub const STATS: &str = "DECAP_STATS";
    /// Addresses `LOCAL` holds at most.
    pub const MAX_LOCAL: u32 = 256;
    /// The TC program on egress that sees each request's first answer
    /// byte leave.
    pub const TTFB_PROGRAM: &str = "ttfb_out";
    /// `HashMap<Addr, u32>`: the VIPs this backend serves by DSR, each
    /// with its index in `TTFB`.
    pub const VIPS: &str = "AGENT_VIPS";
    /// `LruHashMap<TurnKey, u64>`: when each connection's pending request
    /// arrived (`bpf_ktime_get_ns`).
    pub const TURNS: &str = "AGENT_TURNS";
    /// `PerCpuArray<AgentTtfb>` indexed by VIP index.
    pub const TTFB: &str = "AGENT_TTFB";
    /// VIPs one agent times.
    pub const MAX_VIPS: u32 = 16;
    /// Connections with a pending request it tracks at once.
    pub const MAX_TURNS: u32 = 65_536;
}

/// Key of the agent's `AGENT_TURNS`: a connection to a VIP as the client
/// sends it (addresses and ports in network order).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TurnKey {
    pub client: Addr,
    pub vip: Addr,
    pub client_port_be: u16,
    pub vip_port_be: u16,
    pub _pad: u32,
}

/// The agent's time to first byte of one VIP, per CPU: the histogram, the
/// summed time and the count of its samples.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgentTtfb {
    pub sum_ns: u64,
    pub count: u64,
    pub hist: Latency,
}

/// Services (VIP:port/proto) one balancer can serve.
pub const MAX_SERVICES: u32 = 64;
/// Backends over all services; a backend id indexes `BACKENDS`.
pub const MAX_BACKENDS: u32 = 1024;
const _: () = assert!(MAX_BACKENDS < MAGLEV_EMPTY as u32);

/// Entries one ring can hold.
pub const RING_CAPACITY: usize = 256;
/// Flow table entries unless configured otherwise.
pub const DEFAULT_FLOW_TABLE_SIZE: u32 = 131_072;
/// Half-open table slots unless configured otherwise (a power of two).
pub const DEFAULT_HALF_OPEN_SIZE: u32 = 65_536;
/// Entries of a Maglev table unless configured otherwise (a prime; the
/// paper's and Katran's).
pub const DEFAULT_MAGLEV_SIZE: u32 = 65_537;
/// Seed of the 5-tuple hash a Maglev table is indexed by: fixed, so every
/// balancer sends the same new flow to the same backend.
pub const MAGLEV_SEED: u64 = 0x6d61_676c_6576_0001;
/// The MAGLEV map's flags: BPF_F_MMAPABLE, so the control plane writes a
/// table of 65,537 entries as memory, not one syscall each.
pub const MAGLEV_MAP_FLAGS: u32 = 1 << 10;
/// A Maglev entry no backend holds.
pub const MAGLEV_EMPTY: u16 = u16::MAX;
/// Whether `n` is prime (trial division; table sizes are small): a Maglev
/// table's size must be.
#[must_use]
pub const fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}
/// Elements of the MAGLEV map for tables of `size` entries: two per
/// service, four entries to an element (an array's elements take 8 bytes
/// whatever their value's size: 16-bit ids, four to one, keep the map at
/// a quarter of what one id per element would take).
#[must_use]
pub const fn maglev_elements(size: u32) -> u32 {
    (size * MAX_SERVICES * 2).div_ceil(4)
}
/// A closing flow keeps its NAT port this long, so its last segments
/// (final ACKs, retransmitted FINs) are still translated to it.
pub const NAT_LINGER_NS: u64 = 2_000_000_000;
/// Backends a client's SYN is sent to after the first one refused it or
/// left it unanswered (so at most 1 + this many backends per connection).
pub const MAX_SYN_RETRIES: u8 = 2;
/// NAT tuples a client's SYN is sent from after the first one toward a
/// backend that answered it with an ACK of an older connection (its
/// TIME_WAIT). Without TCP timestamps that is a coin toss per tuple past
/// the capacity, so five tuples leave one SYN in 32 to the client's own
/// resend.
pub const MAX_TUPLE_RETRIES: u8 = 4;
/// Bytes of TCP options a half-open slot keeps of the client's SYN (the
/// most a TCP header carries).
pub const SYN_OPTS: usize = 40;
/// Tries to find a free NAT port before a new flow is refused.
pub const NAT_PORT_TRIES: u32 = 8;
/// How long a backend keeps a closed connection's 4-tuple in TIME_WAIT
/// (Linux: 60 s). A NAT tuple handed out again sooner may meet it.
pub const TIME_WAIT_NS: u64 = 60_000_000_000;
/// SNAT addresses one balancer can use (a power of two: the program masks
/// indexes with it).
pub const MAX_SNAT: usize = 16;
const _: () = assert!(MAX_SNAT.is_power_of_two());
/// CPUs whose NAT port slices the program tells apart; a CPU id at or
/// above the configured count shares the slice of its id modulo it.
pub const MAX_NAT_SLICES: u16 = 1024;
/// Ring slot of `service` for generation `generation` (double buffer).
#[inline(always)]
#[must_use]
pub const fn ring_slot(service: u32, generation: u64) -> u32 {
    service * 2 + (generation & 1) as u32
}

/// Address families, as in `AF_INET`/`AF_INET6`.
pub const FAMILY_V4: u8 = 2;
pub const FAMILY_V6: u8 = 10;

/// IP protocol numbers we balance.
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// `FlowValue::flags` bits.
pub mod flow_flags {
    /// A FIN or RST was seen: the flow is counted closed; a new SYN on the
    /// same tuple starts a new flow.
    pub const CLOSING: u8 = 1;
    /// A SYN went to the backend and no SYN-ACK or RST came back yet;
    /// `FlowValue::turn_ns` is when.
    pub const SYN_WAIT: u8 = 2;
    /// The client sent data and the backend has not answered with data yet;
    /// `FlowValue::turn_ns` is when the turn started.
    pub const TURN_WAIT: u8 = 4;
    /// A half-open flow whose SYN-ACK went by: `FlowValue::synack_seq` is
    /// its sequence number, which the client's ACK must acknowledge. A
    /// half-open UDP flow whose backend answered: the client's next
    /// datagram promotes it.
    pub const SYNACK_SEEN: u8 = 8;
    /// Written by the control plane from a peer balancer's list of flows
    /// its Maglev table no longer explains (see `huddle_user::handoff`):
    /// the router may move the connection here, and it must keep its
    /// backend. The first packet that uses it clears the flag and counts
    /// it taken over; a half-open connection on the same tuple wins over it.
    pub const ADOPTED: u8 = 16;
    /// Source NAT: the backend sent its FIN first, so it holds the tuple
    /// in TIME_WAIT for 60 s after the close; `FlowValue::synack_seq`
    /// then keeps the client's latest TCP timestamp, which that TIME_WAIT
    /// holds too (see `nat::allocate` in the XDP program).
    pub const BACKEND_TIME_WAIT: u8 = 32;
}

/// `Backend::flags` bits.
pub mod backend_flags {
    /// The backend is dead and the operator asked for its flows to move:
    /// a packet of an existing flow to it is balanced afresh.
    pub const MOVE_FLOWS: u32 = 1;
}

/// A 16-byte address; IPv4 in the first four bytes, network order.
pub type Addr = [u8; 16];

/// The 16-byte form of an IPv4 address given in network byte order.
///
/// Made as one 128-bit value: built byte by byte, the zero tail became a
/// call to the BPF object's `memset`, a loop of byte stores (two per flow
/// key, about 6 ns of an established packet's path).
#[inline(always)]
#[must_use]
pub const fn addr_v4(octets: [u8; 4]) -> Addr {
    (u32::from_le_bytes(octets) as u128).to_le_bytes()
}

/// A 16-byte address as two little-endian words, for comparing and
/// hashing it without a byte loop.
#[inline(always)]
#[must_use]
pub const fn addr_words(a: &Addr) -> [u64; 2] {
    [
        u64::from_le_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]),
        u64::from_le_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]),
    ]
}

/// Key of `SERVICES`: an IPv4 address the program answers for. For a VIP
/// the port (network order) and protocol of the service; for a SNAT
/// address port and protocol are 0 and `kind` is `SERVICE_KIND_SNAT`.
/// Every packet is looked up here first (8 bytes hash fast), so traffic
/// that is not ours costs one small lookup.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceKey {
    pub addr: [u8; 4],
    pub port_be: u16,
    pub proto: u8,
    pub kind: u8,
}

impl ServiceKey {
    /// The key as one word, for `SERVICE_INDEX`'s hash and compare.
    #[inline(always)]
    #[must_use]
    pub const fn word(&self) -> u64 {
        // Composed, not transmuted: read back whole from the stack, the
        // fields' narrow stores stalled the load (store forwarding).
        u32::from_le_bytes(self.addr) as u64
            | (self.port_be as u64) << 32
            | (self.proto as u64) << 48
            | (self.kind as u64) << 56
    }
}

/// Bits of a `SERVICE_INDEX` slot number: each of its two halves has
/// `SERVICE_INDEX_SLOTS` slots.
pub const SERVICE_INDEX_BITS: u32 = 11;
pub const SERVICE_INDEX_SLOTS: u32 = 1 << SERVICE_INDEX_BITS;

/// An element of `SERVICE_INDEX`: one `SERVICES` entry, in the slot its
/// key's word hashes to. An empty slot holds an all-zero key, which no
/// packet's key equals (its protocol is never 0; a SNAT key's kind is 1).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceEntry {
    pub key: ServiceKey,
    pub value: ServiceValue,
}

/// The slot, within its half, of a key whose word is `word`, under the
/// half's multiplier `mul` (odd): a multiply-shift hash, which the control
/// plane picks so that no two services share a slot.
#[inline(always)]
#[must_use]
pub const fn service_slot(word: u64, mul: u64) -> u32 {
    (word.wrapping_mul(mul) >> (64 - SERVICE_INDEX_BITS)) as u32
}

/// Key of `SERVICES6`: an IPv6 address the program answers for, as
/// `ServiceKey`.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceKey6 {
    pub addr: [u8; 16],
    pub port_be: u16,
    pub proto: u8,
    pub kind: u8,
    pub _pad: u32,
}

/// `ServiceKey::kind` of a balanced VIP:port/proto.
pub const SERVICE_KIND_VIP: u8 = 0;
/// `ServiceKey::kind` of a SNAT address (replies from backends come to it).
pub const SERVICE_KIND_SNAT: u8 = 1;

/// Value of `SERVICES`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// A VIP: index into `RING_GEN`, `RR_CURSOR` and `SERVICE_STATS`. A
    /// SNAT address: its index in `Config::snat_addrs`.
    pub id: u32,
    /// A VIP: its `service_mode`.
    pub flags: u32,
}

/// How a VIP's packets reach their backend (`ServiceValue::flags`).
pub mod service_mode {
    /// Source NAT: addresses and ports rewritten both ways; replies come
    /// back through the balancer.
    pub const SNAT: u32 = 0;
    /// Direct server return on one L2 segment: only the destination MAC
    /// changes; the backend has the VIP on a local interface and answers
    /// the client itself.
    pub const DSR_L2: u32 = 1;
    /// Direct server return by IP-in-IP: the packet, unchanged, inside an
    /// outer header to the backend, whose decap hands it to its stack.
    pub const DSR_IPIP: u32 = 2;
}

/// A backend, indexed by its id in `BACKENDS`.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    pub addr: Addr,
    pub port_be: u16,
    /// 0 for an unused slot.
    pub family: u8,
    /// The service the backend belongs to: lets a restarted control plane
    /// find each backend's id again (ids must not change under live flows).
    pub service: u8,
    pub flags: u32,
}

/// Words of a ring's membership bitmap (one bit per backend id).
pub const MEMBER_WORDS: usize = MAX_BACKENDS as usize / 64;

/// One service's active ring: backend ids, taken round robin, and the same
/// set as a bitmap, so the program can check in O(1) that what it picked
/// belongs to the ring it read (a torn read would not).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Ring {
    pub len: u32,
    pub _pad: u32,
    pub backends: [u32; RING_CAPACITY],
    pub members: [u64; MEMBER_WORDS],
}

impl Ring {
    pub const EMPTY: Ring = Ring {
        len: 0,
        _pad: 0,
        backends: [0; RING_CAPACITY],
        members: [0; MEMBER_WORDS],
    };

    /// Whether backend `id` is in the bitmap.
    #[inline(always)]
    #[must_use]
    pub fn has(&self, id: u32) -> bool {
        let w = (id / 64) as usize;
        w < MEMBER_WORDS && (self.members[w] >> (id % 64)) & 1 == 1
    }
}

/// Key of `FLOWS`: the client's side of a flow.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub client: Addr,
    pub vip: Addr,
    pub client_port_be: u16,
    pub vip_port_be: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}

/// Value of `FLOWS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowValue {
    pub backend: u32,
    pub service: u32,
    /// The balancer's source port toward the backend (network order).
    pub nat_port_be: u16,
    /// `flow_flags` bits.
    pub flags: u8,
    /// Index of the flow's SNAT address in `Config::snat_addrs`.
    pub snat: u8,
    /// Sequence number of the backend's SYN-ACK (half-open flows); in DSR
    /// the client's ACK number during a turn (`ackclock`); for a closed
    /// source-NAT flow with `BACKEND_TIME_WAIT`, the client's latest TCP
    /// timestamp value (0: none seen).
    pub synack_seq: u32,
    /// `bpf_ktime_get_ns()` when the flow was created, then when it started
    /// closing; for an established UDP flow, its last datagram either way
    /// (`bpf_ktime_get_coarse_ns()`, for the idle timeout).
    pub stamp_ns: u64,
    /// When the pending SYN or request turn started (see `flow_flags`).
    pub turn_ns: u64,
}

/// Value of `TW_HINTS`: a tuple whose last connection the backend closed
/// first, in the run before a fresh start: the client's last timestamp
/// and when the flow closed. A fresh data plane has no flows to ask, so
/// without these it would hand such a tuple to a SYN the backend's
/// TIME_WAIT refuses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TwHint {
    pub tsval: u32,
    pub _pad: u32,
    pub closed_ns: u64,
}

/// Most `TW_HINTS` entries.
pub const MAX_TW_HINTS: u32 = 65_536;

/// Key of `NAT`: a reply as the backend sends it.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NatKey {
    pub backend: Addr,
    /// The balancer's SNAT address.
    pub local: Addr,
    pub backend_port_be: u16,
    pub nat_port_be: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}

/// Value of `NAT`: the client flow a reply belongs to.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NatValue {
    pub flow: FlowKey,
    pub backend: u32,
    pub _pad: u32,
}

/// Data plane settings, one element in `CONFIG`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Source addresses of translated packets toward backends (the pool
    /// NAT tuples are drawn from): `snat_count` IPv4 ones, then
    /// `snat6_count` IPv6 ones.
    pub snat_addrs: [Addr; MAX_SNAT],
    pub snat_count: u16,
    pub family: u8,
    /// Which half of `SERVICE_INDEX` is live (1 or 2); 0: none, every
    /// packet asks `SERVICES` itself.
    pub service_half: u8,
    /// Inclusive NAT port range, host order.
    pub nat_port_min: u16,
    pub nat_port_max: u16,
    /// Ports in each CPU's slice of the range, and how many slices (one
    /// per possible CPU): CPU c walks `nat_port_min + c * slice_ports ..`
    /// and no two CPUs ever hand out the same tuple.
    pub slice_ports: u16,
    pub slices: u16,
    pub snat6_count: u16,
    pub _pad2: u16,
    /// Bumped by the control plane every second: a cached next hop from
    /// an older generation is asked of the FIB again (no clock read per
    /// packet).
    pub hop_generation: u64,
    /// Slots of the half-open tables minus one (their size is a power of
    /// two).
    pub half_open_mask: u32,
    /// Bits of `encap_src` (as it lies in memory) that each flow sets from
    /// its client address and port: the outer source of IP-in-IP packets
    /// varies per flow, so a backend's NIC spreads flows over its queues.
    pub encap_vary: u32,
    /// Secret seed of the half-open tables' hash, so nobody outside can
    /// aim SYNs at one slot. Kept across restarts (the slots stay valid).
    pub hash_seed: u64,
    /// A client's SYN retransmitted this long after the first one, with no
    /// SYN-ACK or RST from the backend in between, goes to another backend
    /// (0: never).
    pub syn_timeout_ns: u64,
    /// Outer source address of IP-in-IP packets (IPv4: the first 4 bytes),
    /// before the per-flow bits of `encap_vary`.
    pub encap_src: Addr,
    /// Outer source address of IPv6-in-IPv6 packets (the flow label, not
    /// the address, varies per flow).
    pub encap6_src: Addr,
    /// Tuples per backend id in `NAT_USED` (`nat_used_per_backend`); 0:
    /// no such filter, every new flow looks its tuple up in `NAT`.
    pub nat_used_per_backend: u32,
    pub _pad3: u32,
    /// Each `SERVICE_INDEX` half's hash multiplier: written before the
    /// half goes live and never while it is, so a packet that read
    /// `service_half` finds the multiplier that placed that half.
    pub service_mul: [u64; 2],
}

/// Bytes of `NAT_USED` per element: one cache line of tuples.
pub const NAT_USED_LINE: usize = 64;
/// The most memory `NAT_USED` may take; past it the filter is off.
pub const MAX_NAT_USED_BYTES: u64 = 64 << 20;
/// Backend ids `NAT_USED` covers: the top ones, `MAX_BACKENDS -
/// NAT_USED_BACKENDS..`, which the control plane hands out first; new
/// flows toward the others look their tuple up in `NAT`.
pub const NAT_USED_BACKENDS: u32 = 256;

/// Tuples per backend id that `NAT_USED` covers: every (SNAT address,
/// port) a walk of `slices` slices of `slice_ports` ports over
/// `snat_total` addresses hands out; 0 (no filter) when
/// `NAT_USED_BACKENDS` times that would take more than
/// `MAX_NAT_USED_BYTES`.
#[must_use]
pub fn nat_used_per_backend(slice_ports: u16, slices: u16, snat_total: u16) -> u32 {
    let per = u64::from(slice_ports) * u64::from(slices) * u64::from(snat_total);
    if per * u64::from(NAT_USED_BACKENDS) > MAX_NAT_USED_BYTES {
        0
    } else {
        per as u32
    }
}

/// Elements of `NAT_USED` for `per_backend` tuples per backend id (at
/// least one: a map cannot be empty).
#[must_use]
pub fn nat_used_lines(per_backend: u32) -> u32 {
    let bytes = u64::from(per_backend) * u64::from(NAT_USED_BACKENDS);
    (bytes.div_ceil(NAT_USED_LINE as u64) as u32).max(1)
}

impl Config {
    /// Splits the inclusive range `min..=max` into one slice per CPU.
    /// Returns `(slice_ports, slices)`; a range smaller than the CPU count
    /// gets as many one-port slices as it has ports.
    #[must_use]
    pub fn slices_for(min: u16, max: u16, cpus: u16) -> (u16, u16) {
        let span = u32::from(max.saturating_sub(min)) + 1;
        let slices = u32::from(cpus.clamp(1, MAX_NAT_SLICES)).min(span);
        ((span / slices) as u16, slices as u16)
    }
}

/// A half-open flow, client side: slot `hash(key) & half_open_mask` of
/// `HALF_OPEN`. A direct-mapped table instead of an LRU hash: a SYN costs
/// one slot write (no lock, no LRU lists to rotate, one cache line or two)
/// and a newer SYN hashing to a taken slot takes it, much as an LRU evicts
/// its oldest entry under a flood.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfOpen {
    /// `slot_tag(hash of key)`; 0: empty (never used, or promoted).
    pub tag: u64,
    pub key: FlowKey,
    pub flow: FlowValue,
    pub syn: SynCopy,
}

/// What the balancer keeps of a client's SYN so that it can send it again
/// itself, to another backend, when the first refuses it (RST): the client
/// then never sees the refusal.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynCopy {
    /// The client's initial sequence number (host order).
    pub isn: u32,
    /// The SYN's window field, as sent (network order).
    pub window_be: u16,
    /// Bytes of `opts` in use: a multiple of 4, at most `SYN_OPTS`.
    pub opt_len: u8,
    /// Low four bits: backends tried after the first one (at most
    /// `MAX_SYN_RETRIES`); high four: NAT tuples tried after one a
    /// TIME_WAIT refused, toward the current backend (at most
    /// `MAX_TUPLE_RETRIES`). One byte: the struct has no other to spare.
    pub retries: u8,
    /// The SYN's TCP options (MSS, window scale, SACK, timestamps), so the
    /// connection keeps them on the next backend.
    pub opts: [u8; SYN_OPTS],
}

impl SynCopy {
    /// Backends tried after the first one.
    #[inline(always)]
    #[must_use]
    pub fn backends_tried(&self) -> u8 {
        self.retries & 0x0f
    }

    /// NAT tuples tried after a refused one, toward the current backend.
    #[inline(always)]
    #[must_use]
    pub fn tuples_tried(&self) -> u8 {
        self.retries >> 4
    }

    /// Counts one more NAT tuple tried toward the current backend.
    #[inline(always)]
    pub fn tried_tuple(&mut self) {
        self.retries += 0x10;
    }

    /// Counts one more backend tried; its tuples count afresh.
    #[inline(always)]
    pub fn tried_backend(&mut self) {
        self.retries = self.backends_tried() + 1;
    }
}

/// Per service, written by the control plane every tick from the ring's
/// own answer times: a backend that has owed an answer for longer than
/// these is passed over for new flows (0: never), before the control plane
/// has even judged it hung.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tuning {
    /// Oldest unanswered request turn (`Pulse::turn_wait_ns`).
    pub turn_skip_ns: u64,
    /// Oldest unanswered SYN (`Pulse::syn_wait_ns`).
    pub syn_skip_ns: u64,
    /// 1: of the ring's next two entries a new flow takes the one that
    /// has owed an answer for less time (least outstanding work, measured
    /// in time); 0: plain round robin.
    pub two_choices: u32,
    /// Nonzero: new flows take the service's Maglev table of this many
    /// entries (`MAGLEV`), indexed by a hash of the 5-tuple every balancer
    /// computes alike; 0: the ring's round robin.
    pub maglev_size: u32,
}

/// The NAT side of a half-open flow, so the backend's SYN-ACK finds its
/// client: slot `NatKey::half_open_slot` of `HALF_OPEN_NAT`.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfOpenNat {
    /// `slot_tag` of the key's hash without its NAT port; 0: empty.
    pub tag: u64,
    pub key: NatKey,
    pub nat: NatValue,
}

/// The short tags of a half-open table's slots (`HALF_OPEN_TAGS` for
/// `HALF_OPEN`, `HALF_OPEN_NAT_TAGS` for `HALF_OPEN_NAT`): slot `i` is
/// lane `i % 16` of element `i / 16`. A SYN must know whether its slots
/// hold its own tuple (a retransmission) or another handshake (one it
/// takes over); read from the slots (8 and 6 MiB for 65,536), that was a
/// cache miss on almost every SYN. These tags take a quarter MiB each,
/// which stays in cache. Only a matching short tag sends a SYN on to the
/// client slot itself; the slots are only written.
///
/// Kept equal to the slots' tags wherever a slot's tag is set or cleared;
/// a lane of 0 where the slot is taken only costs a retransmitted SYN its
/// first backend (a data plane adopted from a build without this map).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfOpenTags {
    pub tags: [u32; HALF_OPEN_TAGS_PER_LINE as usize],
}

/// Short tags to an element of `HALF_OPEN_TAGS`: one cache line.
pub const HALF_OPEN_TAGS_PER_LINE: u32 = 16;

/// Elements of `HALF_OPEN_TAGS` for `slots` half-open slots (a power of
/// two; at least one element).
#[must_use]
pub fn half_open_tag_lines(slots: u32) -> u32 {
    (slots / HALF_OPEN_TAGS_PER_LINE).max(1)
}

/// The short tag of a slot holding a key of hash `h`: never 0, and taken
/// from the bits the slot index does not use.
#[inline(always)]
#[must_use]
pub const fn short_tag(h: u64) -> u32 {
    ((h >> 32) as u32) | 1
}

/// The tag a slot holding a key of hash `h` carries: never 0.
#[inline(always)]
#[must_use]
pub const fn slot_tag(h: u64) -> u64 {
    h | 1
}

/// Hash of five 64-bit words with a secret seed (multiply-xorshift, as in
/// splitmix64): cheap in BPF, and without the seed nobody can predict
/// which slot a tuple takes.
#[inline(always)]
#[must_use]
pub fn hash_words(w: &[u64; 5], seed: u64) -> u64 {
    hash_words_masked(w, u64::MAX, seed)
}

/// `hash_words` with the fifth word ANDed with `last`.
#[inline(always)]
#[must_use]
fn hash_words_masked(w: &[u64; 5], last: u64, seed: u64) -> u64 {
    let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut i = 0;
    while i < 5 {
        let word = if i == 4 { w[i] & last } else { w[i] };
        h = (h ^ word).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 31;
        i += 1;
    }
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 29)
}

/// The bits of `NatKey`'s fifth 64-bit word (bytes 32..40, little-endian)
/// that hold `nat_port_be`.
const NAT_PORT_BITS: u64 = 0xffff_0000;
const _: () = assert!(core::mem::offset_of!(NatKey, nat_port_be) == 34);
const _: () = assert!(cfg!(target_endian = "little"));

/// The last word of a `FlowKey` or `NatKey` (two ports, protocol,
/// family, zero padding), built in a register.
#[inline(always)]
#[must_use]
const fn key_tail(port_a_be: u16, port_b_be: u16, proto: u8, family: u8) -> u64 {
    port_a_be as u64 | (port_b_be as u64) << 16 | (proto as u64) << 32 | (family as u64) << 40
}

/// A 40-byte key from its five words.
///
/// Keys are made this way, not field by field, because the kernel hashes
/// and compares a key in 4- and 8-byte loads: a load that spans two of
/// the fields' narrow stores cannot be forwarded from the store buffer,
/// and stalls until both stores retire (three such stalls per lookup
/// cost an established packet about 20 ns).
#[inline(always)]
const fn key_from_words<K: Copy>(w: [u64; 5]) -> K {
    const { assert!(size_of::<K>() == 40) };
    // SAFETY: only instantiated for FlowKey and NatKey, 40 bytes of
    // integers and byte arrays, for which any bit pattern is valid.
    unsafe { core::mem::transmute_copy::<[u64; 5], K>(&w) }
}

impl FlowKey {
    /// The key of a flow from `client`:`client_port_be` to
    /// `vip`:`vip_port_be`.
    #[inline(always)]
    #[must_use]
    pub const fn new(
        client: &Addr,
        vip: &Addr,
        client_port_be: u16,
        vip_port_be: u16,
        proto: u8,
        family: u8,
    ) -> FlowKey {
        let [c0, c1] = addr_words(client);
        let [v0, v1] = addr_words(vip);
        key_from_words([
            c0,
            c1,
            v0,
            v1,
            key_tail(client_port_be, vip_port_be, proto, family),
        ])
    }

    /// Hash for the half-open table.
    #[inline(always)]
    #[must_use]
    pub fn hash(&self, seed: u64) -> u64 {
        // SAFETY: 40 bytes of integers and byte arrays, 8-byte aligned:
        // every bit pattern is a valid [u64; 5].
        let w: &[u64; 5] = unsafe { &*(self as *const FlowKey).cast() };
        hash_words(w, seed)
    }
}

impl NatKey {
    /// The key of a reply from `backend`:`backend_port_be` to SNAT address
    /// `local`, port `nat_port_be`.
    #[inline(always)]
    #[must_use]
    pub fn new(
        local: Addr,
        backend: Addr,
        backend_port_be: u16,
        nat_port_be: u16,
        proto: u8,
        family: u8,
    ) -> NatKey {
        let [b0, b1] = addr_words(&backend);
        let [l0, l1] = addr_words(&local);
        key_from_words([
            b0,
            b1,
            l0,
            l1,
            key_tail(backend_port_be, nat_port_be, proto, family),
        ])
    }

    /// Where this tuple's half-open flow sits in the half-open NAT table
    /// of `mask` + 1 slots (before the mask), and the tag it carries
    /// there: a hash of every field but the NAT port, plus the port's
    /// offset from `port_min`. The NAT walk hands out consecutive ports
    /// toward a backend, so consecutive SYNs write neighbouring slots, a
    /// cache line already fetched or fetched ahead by the prefetcher,
    /// rather than a cold one anywhere in the table. Ports a whole table
    /// apart share a slot: the lap (the offset's bits above the mask) is
    /// in the tag, so their tags, short ones too, differ.
    #[inline(always)]
    #[must_use]
    pub fn half_open_slot(&self, seed: u64, port_min: u16, mask: u32) -> (u32, u64) {
        // SAFETY: as for `FlowKey::hash`.
        let w: &[u64; 5] = unsafe { &*(self as *const NatKey).cast() };
        let base = hash_words_masked(w, !NAT_PORT_BITS, seed);
        let offset = u32::from(u16::from_be(self.nat_port_be).wrapping_sub(port_min));
        let lap = u64::from(offset & !mask).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        ((base as u32).wrapping_add(offset), slot_tag(base ^ lap))
    }
}

/// Per backend, per CPU: the next NAT tuple this CPU hands out toward the
/// backend, walking its slice (ports x SNAT addresses) in order, so a
/// tuple comes back only after every other one of the slice was used:
/// the oldest first, never a random recent one still in TIME_WAIT.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatCursor {
    /// Next port, as an offset into this CPU's slice.
    pub port: u32,
    /// Index of the SNAT address that port goes with; the walk takes
    /// every port of one address, then of the next.
    pub addr: u32,
    /// When the current round over all tuples started.
    pub round_ns: u64,
    /// 1: the last round took less than `TIME_WAIT_NS`, so tuples handed
    /// out now may meet a TIME_WAIT on the backend (counted).
    pub early: u32,
    pub _pad: u32,
}

/// A backend's next hop as the FIB gave it, per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NextHop {
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
    /// Interface to send on, and the ingress interface the answer is for.
    pub ifindex: u32,
    pub ingress: u32,
    /// The path's MTU toward the backend, as the FIB gives it.
    pub mtu: u16,
    /// 1: the FIB reached the backend through a gateway (not on the
    /// balancer's own segment, so L2 DSR cannot reach it).
    pub routed: u8,
    pub _pad: u8,
    /// `Config::hop_generation` when the FIB answered, plus one (0: never).
    pub generation: u64,
}

/// A client's next hop as the FIB gave it, per CPU, in a direct-mapped
/// cache (`CLIENT_HOP_SLOTS` slots by address): replies go back to few
/// clients at a time (keep-alive connections, one NAT in front of many),
/// and a FIB lookup per reply cost more than the rest of its path.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientHop {
    /// The client address the hop is for (`addr_words`): compared and
    /// stored as two words, not sixteen bytes.
    pub addr: [u64; 2],
    pub hop: NextHop,
}

/// Slots of the per-CPU client next-hop cache (a power of two).
pub const CLIENT_HOP_SLOTS: u32 = 1024;
const _: () = assert!(CLIENT_HOP_SLOTS.is_power_of_two());

/// The slot of `addr` (as `addr_words` gives it) in the client next-hop
/// cache.
#[inline(always)]
#[must_use]
pub fn client_hop_slot(addr: [u64; 2]) -> u32 {
    let x = addr[0] ^ addr[1];
    let h = ((x as u32) ^ ((x >> 32) as u32)).wrapping_mul(0x9e37_79b1);
    (h >> 16) & (CLIENT_HOP_SLOTS - 1)
}
/// Settings of the packet generator in the baseline object (`gen`):
/// where to redirect frames, and over how many client ports to spread them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenConfig {
    pub ifindex: u32,
    pub flows: u32,
    /// First client port, host order.
    pub base_port: u16,
    pub _pad: u16,
    pub _pad2: u32,
}

/// Value of the packet generator's `GEN_NAT` table (key: the frame's
/// addresses and ports as two words): a bare NAT forwarder's whole state
/// for a flow, its rewrite worked out beforehand.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenNat {
    /// New source and destination addresses, as they lie in the header.
    pub addrs: [u8; 8],
    /// New source and destination ports, as they lie in the header.
    pub ports: [u8; 4],
    /// One's-complement changes of the IP and the TCP checksum.
    pub ip_diff: u32,
    pub l4_diff: u32,
    /// Destination and source MAC.
    pub macs: [u8; 12],
}

/// Bytes of the generator's frame template (Ethernet, IPv4, TCP, some
/// payload).
pub const GEN_FRAME: usize = 64;

macro_rules! assert_size {
    ($t:ty, $n:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $n);
    };
}

assert_size!(ServiceKey, 8);
assert_size!(ServiceKey6, 24);
assert_size!(ServiceValue, 8);
assert_size!(Backend, 24);
assert_size!(Ring, 8 + 4 * RING_CAPACITY + 8 * MEMBER_WORDS);
assert_size!(FlowKey, 40);
assert_size!(FlowValue, 32);
assert_size!(Latency, 8 * LATENCY_BUCKETS);
assert_size!(Pulse, 16);
assert_size!(GenConfig, 16);
assert_size!(GenNat, 32);
assert_size!(NextHop, 32);
assert_size!(NatKey, 40);
assert_size!(NatValue, 48);
assert_size!(Config, 16 * MAX_SNAT + 104);
assert_size!(ServiceEntry, 16);
assert_size!(HalfOpen, 128);
assert_size!(SynCopy, 48);
assert_size!(Tuning, 24);
assert_size!(HalfOpenNat, 96);
assert_size!(HalfOpenTags, 64);
assert_size!(NatCursor, 24);
assert_size!(TurnKey, 40);
assert_size!(AgentTtfb, 16 + 8 * LATENCY_BUCKETS);

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all are repr(C) structs of integers and byte arrays with
    // explicit padding fields, so every bit pattern is valid.
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceKey6 {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for ServiceEntry {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for Ring {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for FlowValue {}
    unsafe impl aya::Pod for NatKey {}
    unsafe impl aya::Pod for NatValue {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for BackendStats {}
    unsafe impl aya::Pod for ServiceStats {}
    unsafe impl aya::Pod for GlobalStats {}
    unsafe impl aya::Pod for DecapStats {}
    unsafe impl aya::Pod for TurnKey {}
    unsafe impl aya::Pod for AgentTtfb {}
    unsafe impl aya::Pod for Latency {}
    unsafe impl aya::Pod for Pulse {}
    unsafe impl aya::Pod for GenConfig {}
    unsafe impl aya::Pod for GenNat {}
    unsafe impl aya::Pod for NextHop {}
    unsafe impl aya::Pod for NatCursor {}
    unsafe impl aya::Pod for TwHint {}
    unsafe impl aya::Pod for HalfOpen {}
    unsafe impl aya::Pod for HalfOpenNat {}
    unsafe impl aya::Pod for HalfOpenTags {}
    unsafe impl aya::Pod for Tuning {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_nat_ports_toward_a_backend_take_consecutive_half_open_slots() {
        let key = |backend: u8, port: u16| NatKey {
            backend: [backend; 16],
            local: [7; 16],
            backend_port_be: 8080u16.to_be(),
            nat_port_be: port.to_be(),
            proto: PROTO_TCP,
            family: FAMILY_V4,
            _pad: [0; 2],
        };
        let mask = 1023;
        let (first, tag) = key(1, 20000).half_open_slot(42, 20000, mask);
        for off in 1..300u16 {
            let (slot, t) = key(1, 20000 + off).half_open_slot(42, 20000, mask);
            assert_eq!(slot, first.wrapping_add(u32::from(off)));
            assert_eq!(t, tag);
        }
        let (other, other_tag) = key(2, 20000).half_open_slot(42, 20000, mask);
        assert_ne!(
            (other, other_tag),
            (first, tag),
            "another backend, another run"
        );
        assert_ne!(
            key(1, 20000).half_open_slot(43, 20000, mask).0,
            first,
            "seeded"
        );
        assert_eq!(tag & 1, 1, "a tag is never 0");
        // Laps later: the same slot, told apart by the tag, short tag too.
        for lap in 1..6u16 {
            let (slot, t) = key(1, 20000 + lap * 1024).half_open_slot(42, 20000, mask);
            assert_eq!(slot & mask, first & mask);
            assert_ne!(short_tag(t), short_tag(tag), "lap {lap}");
        }
    }

    #[test]
    fn the_nat_used_filter_is_sized_by_the_walk_and_off_past_its_cap() {
        // Default range 20000-32767 on 2 CPUs, one SNAT address.
        let per = nat_used_per_backend(6384, 2, 1);
        assert_eq!(per, 12_768);
        assert_eq!(
            u64::from(nat_used_lines(per)) * NAT_USED_LINE as u64,
            12_768 * u64::from(NAT_USED_BACKENDS)
        );
        // The whole 1024-65535 range with 2 addresses: 33 MB, on.
        assert_ne!(nat_used_per_backend(32_256, 2, 2), 0);
        // With 16 addresses it would take 264 MB: off, one line left.
        assert_eq!(nat_used_per_backend(32_256, 2, 16), 0);
        assert_eq!(nat_used_lines(0), 1);
    }

    #[test]
    fn ring_slots_alternate_per_generation() {
        assert_eq!(ring_slot(0, 0), 0);
        assert_eq!(ring_slot(0, 1), 1);
        assert_eq!(ring_slot(0, 2), 0);
        assert_eq!(ring_slot(5, 7), 11);
        assert!(ring_slot(MAX_SERVICES - 1, 1) < MAX_SERVICES * 2);
    }

    #[test]
    fn keys_built_from_words_equal_keys_built_from_fields() {
        let (a, b) = (
            core::array::from_fn(|i| i as u8 + 1),
            core::array::from_fn(|i| 0xf0 - i as u8),
        );
        let flow = FlowKey {
            client: a,
            vip: b,
            client_port_be: 0x1234,
            vip_port_be: 0xabcd,
            proto: PROTO_TCP,
            family: FAMILY_V6,
            _pad: [0; 2],
        };
        assert_eq!(
            FlowKey::new(&a, &b, 0x1234, 0xabcd, PROTO_TCP, FAMILY_V6),
            flow
        );
        let nat = NatKey {
            backend: b,
            local: a,
            backend_port_be: 0x8899,
            nat_port_be: 0x4455,
            proto: 17,
            family: FAMILY_V4,
            _pad: [0; 2],
        };
        assert_eq!(NatKey::new(a, b, 0x8899, 0x4455, 17, FAMILY_V4), nat);
        let service = ServiceKey {
            addr: [10, 0, 0, 1],
            port_be: 80u16.to_be(),
            proto: PROTO_TCP,
            kind: SERVICE_KIND_SNAT,
        };
        // SAFETY: 8 bytes of integers and byte arrays.
        let raw = unsafe { core::mem::transmute::<ServiceKey, u64>(service) };
        assert_eq!(service.word(), raw);
    }

    #[test]
    fn v4_address_sits_in_first_bytes() {
        let a = addr_v4([10, 1, 2, 3]);
        assert_eq!(&a[..4], &[10, 1, 2, 3]);
        assert!(a[4..].iter().all(|b| *b == 0));
    }

    #[test]
    fn nat_slices_cover_the_range_without_overlap() {
        assert_eq!(Config::slices_for(20000, 32767, 2), (6384, 2));
        assert_eq!(Config::slices_for(20000, 20999, 3), (333, 3));
        // Fewer ports than CPUs: one port each, as many slices as ports.
        assert_eq!(Config::slices_for(100, 101, 8), (1, 2));
        assert_eq!(Config::slices_for(1024, 65535, 0), (64512, 1));
        let (ports, n) = Config::slices_for(1024, 65535, 4096);
        assert!(u32::from(ports) * u32::from(n) <= 64512);
    }

    #[test]
    fn map_names_are_unique() {
        for (i, a) in maps::ALL.iter().enumerate() {
            for b in &maps::ALL[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
