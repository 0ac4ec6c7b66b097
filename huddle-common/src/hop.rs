//! Next hops cached per CPU: toward backends and toward clients.

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
shared!(NextHop, 32);

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
