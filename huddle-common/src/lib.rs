//! Types shared by the XDP program and the control plane.
//!
//! Every map name, size and on-map layout lives here, once. All types are
//! `#[repr(C)]`, `Copy`, made of fixed-width integers with explicit padding
//! (no `bool`, enum or `Option`), so the kernel and user space agree byte for
//! byte. Sizes are asserted at compile time.
//!
//! Addresses are always 16 bytes with a family tag, so IPv6 services fit
//! later without a new layout; an IPv4 address sits in the first 4 bytes in
//! network order and the other 12 are zero.
#![no_std]

pub mod latency;
pub mod stats;

pub use latency::{latency_bucket, Latency, Pulse, LATENCY_BUCKETS};
pub use stats::{BackendStats, Counters, GlobalStats, ServiceStats};

/// Map names, as the XDP program declares them (the static's identifier).
pub mod maps {
    /// `HashMap<ServiceKey, ServiceValue>`: which VIP:port/proto is balanced.
    pub const SERVICES: &str = "SERVICES";
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
    /// `Array<Pulse>` indexed by backend id: since when the backend owes an
    /// answer (shared by all CPUs).
    pub const PULSE: &str = "PULSE";
    /// `LruHashMap<FlowKey, FlowValue>`: TCP flows whose handshake is not
    /// complete. Kept apart so a SYN flood never evicts an established flow.
    pub const HALF_OPEN: &str = "HALF_OPEN";
    /// `LruHashMap<NatKey, NatValue>`: NAT entries of half-open flows.
    pub const HALF_OPEN_NAT: &str = "HALF_OPEN_NAT";
    /// `PerCpuArray<NextHop>` indexed by backend id: the FIB's answer for
    /// it, reused for `NEXT_HOP_TTL_NS`.
    pub const NEXT_HOP: &str = "NEXT_HOP";

    /// Every map the control plane opens, for checks against the object.
    pub const ALL: [&str; 16] = [
        SERVICES,
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
        NEXT_HOP,
    ];
}

/// Name of the XDP program in the object.
pub const PROGRAM_NAME: &str = "huddle";

/// Services (VIP:port/proto) one balancer can serve.
pub const MAX_SERVICES: u32 = 64;
/// Backends over all services; a backend id indexes `BACKENDS`.
pub const MAX_BACKENDS: u32 = 1024;
/// Entries one ring can hold.
pub const RING_CAPACITY: usize = 256;
/// Flow table entries unless configured otherwise.
pub const DEFAULT_FLOW_TABLE_SIZE: u32 = 131_072;
/// Half-open table entries unless configured otherwise.
pub const DEFAULT_HALF_OPEN_SIZE: u32 = 65_536;
/// A closing flow keeps its NAT port this long, so its last segments
/// (final ACKs, retransmitted FINs) are still translated to it.
pub const NAT_LINGER_NS: u64 = 2_000_000_000;
/// Tries to find a free NAT port before a new flow is refused.
pub const NAT_PORT_TRIES: u32 = 8;
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
    /// its sequence number, which the client's ACK must acknowledge.
    pub const SYNACK_SEEN: u8 = 8;
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
#[inline(always)]
#[must_use]
pub const fn addr_v4(octets: [u8; 4]) -> Addr {
    let mut a = [0u8; 16];
    a[0] = octets[0];
    a[1] = octets[1];
    a[2] = octets[2];
    a[3] = octets[3];
    a
}

/// Key of `SERVICES`: a VIP, its port (network order) and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceKey {
    pub addr: Addr,
    pub port_be: u16,
    pub proto: u8,
    pub family: u8,
}

/// Value of `SERVICES`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceValue {
    /// Index into `RING_GEN`, `RR_CURSOR` and `SERVICE_STATS`.
    pub id: u32,
    pub flags: u32,
}

/// A backend, indexed by its id in `BACKENDS`.
#[repr(C)]
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
#[repr(C)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowValue {
    pub backend: u32,
    pub service: u32,
    /// The balancer's source port toward the backend (network order).
    pub nat_port_be: u16,
    /// `flow_flags` bits.
    pub flags: u8,
    pub _pad: u8,
    /// Sequence number of the backend's SYN-ACK (half-open flows).
    pub synack_seq: u32,
    /// `bpf_ktime_get_ns()` when the flow was created, then when it started
    /// closing.
    pub stamp_ns: u64,
    /// When the pending SYN or request turn started (see `flow_flags`).
    pub turn_ns: u64,
}

/// Key of `NAT`: a reply as the backend sends it.
#[repr(C)]
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
#[repr(C)]
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
    /// Source address of translated packets toward backends.
    pub snat_addr: Addr,
    pub family: u8,
    pub _pad: u8,
    /// Inclusive NAT port range, host order.
    pub nat_port_min: u16,
    pub nat_port_max: u16,
    pub _pad2: u16,
    pub flags: u32,
}

/// How long a cached next hop of a backend is used before the FIB is asked
/// again (a neighbour's new MAC is picked up within this).
pub const NEXT_HOP_TTL_NS: u64 = 1_000_000_000;

/// A backend's next hop as the FIB gave it, per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NextHop {
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
    /// Interface to send on, and the ingress interface the answer is for.
    pub ifindex: u32,
    pub ingress: u32,
    pub _pad: u32,
    /// When the FIB answered; 0: never.
    pub stamp_ns: u64,
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

/// Bytes of the generator's frame template (Ethernet, IPv4, TCP, some
/// payload).
pub const GEN_FRAME: usize = 64;

macro_rules! assert_size {
    ($t:ty, $n:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $n);
    };
}

assert_size!(ServiceKey, 20);
assert_size!(ServiceValue, 8);
assert_size!(Backend, 24);
assert_size!(Ring, 8 + 4 * RING_CAPACITY + 8 * MEMBER_WORDS);
assert_size!(FlowKey, 40);
assert_size!(FlowValue, 32);
assert_size!(Latency, 8 * LATENCY_BUCKETS);
assert_size!(Pulse, 16);
assert_size!(GenConfig, 16);
assert_size!(NextHop, 32);
assert_size!(NatKey, 40);
assert_size!(NatValue, 48);
assert_size!(Config, 28);

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all are repr(C) structs of integers and byte arrays with
    // explicit padding fields, so every bit pattern is valid.
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceValue {}
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
    unsafe impl aya::Pod for Latency {}
    unsafe impl aya::Pod for Pulse {}
    unsafe impl aya::Pod for GenConfig {}
    unsafe impl aya::Pod for NextHop {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_slots_alternate_per_generation() {
        assert_eq!(ring_slot(0, 0), 0);
        assert_eq!(ring_slot(0, 1), 1);
        assert_eq!(ring_slot(0, 2), 0);
        assert_eq!(ring_slot(5, 7), 11);
        assert!(ring_slot(MAX_SERVICES - 1, 1) < MAX_SERVICES * 2);
    }

    #[test]
    fn v4_address_sits_in_first_bytes() {
        let a = addr_v4([10, 1, 2, 3]);
        assert_eq!(&a[..4], &[10, 1, 2, 3]);
        assert!(a[4..].iter().all(|b| *b == 0));
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
