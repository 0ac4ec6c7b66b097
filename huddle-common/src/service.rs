//! Services: the keys the packet's destination is looked up by, the
//! direct-mapped IPv4 index, and what a service is.

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
shared!(ServiceKey, 8);

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

/// Bits of a `SERVICE_INDEX` bucket number: each of its two halves has
/// `SERVICE_INDEX_SLOTS` buckets of `SERVICE_BUCKET` entries. 4,096
/// services and 16 SNAT addresses fill a quarter of an entry a bucket on
/// average, so a multiplier that overfills none is found in a few tries;
/// one entry a slot (2,048 of them) held no more than about 80 keys.
pub const SERVICE_INDEX_BITS: u32 = 14;

pub const SERVICE_INDEX_SLOTS: u32 = 1 << SERVICE_INDEX_BITS;

/// Entries of a `SERVICE_INDEX` bucket: one cache line.
pub const SERVICE_BUCKET: usize = 4;

/// An element of `SERVICE_INDEX`: one `SERVICES` entry, in the slot its
/// key's word hashes to. An empty slot holds an all-zero key, which no
/// packet's key equals (its protocol is never 0; a SNAT key's kind is 1).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceEntry {
    pub key: ServiceKey,
    pub value: ServiceValue,
}
shared!(ServiceEntry, 16);

/// An element of `SERVICE_INDEX`: the entries whose keys hash to it.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceBucket {
    pub entries: [ServiceEntry; SERVICE_BUCKET],
}
shared!(ServiceBucket, 64);

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
shared!(ServiceKey6, 24);

/// `ServiceKey::kind` of a balanced VIP:port/proto.
pub const SERVICE_KIND_VIP: u8 = 0;

/// `ServiceKey::kind` of a SNAT address (replies from backends come to it).
pub const SERVICE_KIND_SNAT: u8 = 1;

/// What an address in `GUARDED` is to the services (bits).
pub mod guard_kind {
    /// A VIP.
    pub const VIP: u8 = 1;
    /// A backend.
    pub const BACKEND: u8 = 2;
}

/// Entries `GUARDED` can hold: one address per service and per backend.
pub const MAX_GUARDED: u32 = crate::MAX_SERVICES + crate::MAX_BACKENDS;

/// Bits of a `guard_bit`: 2^20 (128 KiB) keeps the filter's false hits
/// near 1 in 16 at 69,632 addresses (4,096 VIPs, 65,536 backends). With
/// 2^16, the 8,000 addresses of `huddle bench --services 4096` set the
/// bench's non-VIP address's bit, and every such packet paid the hash
/// lookup: 14.1 -> 26.6 ns net; at 2^20, 15.6.
pub const GUARD_BITS: u32 = 20;

/// `GUARD_FILTER`'s one element: bit `guard_bit(a)` set for each address
/// `a` in `GUARDED`. Traffic to any other address (nearly all that is not
/// balanced: the host's own) then skips the hash lookup, about 30 ns.
pub type GuardFilter = [u64; 1 << (GUARD_BITS - 6)];

/// The bit of `GuardFilter` for a 16-byte address.
#[inline(always)]
#[must_use]
pub const fn guard_bit(a: &crate::Addr) -> u32 {
    let lo = u64::from_le_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
    let hi = u64::from_le_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]);
    ((lo ^ hi.rotate_left(31)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - GUARD_BITS)) as u32
}

/// Value of `SERVICES`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// A VIP: index into `RING_GEN`, `RR_CURSOR` and `SERVICE_STATS`. A
    /// SNAT address: its index in `Config::snat_addrs`.
    pub id: u32,
    /// A VIP: its `service_mode` (a SNAT address: 0).
    pub mode: u32,
}
shared!(ServiceValue, 8);

/// How a VIP's packets reach their backend (`ServiceValue::mode`).
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
