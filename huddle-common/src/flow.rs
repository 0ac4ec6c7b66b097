//! Established flows: the flow table's key and value.

use crate::*;

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
    /// datagram promotes it. An established one (source NAT) whose backend
    /// answered since the promotion: the client's next datagram confirms it.
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
    /// Source-NAT UDP: a second exchange (an answer to the promoting
    /// datagram, then another datagram) since the promotion. Until then the
    /// flow may be a spoofer's, which needs no answer to send a pair, and
    /// its tuple is free again after `UDP_UNCONFIRMED_IDLE_NS` of silence.
    pub const UDP_CONFIRMED: u8 = 64;
    /// Source-NAT TCP: both sides finished with no TIME_WAIT on the
    /// backend (the client's FIN, then the backend's; or a RST either
    /// way), so nothing of the connection is left there. `stamp_ns` is
    /// then its last packet, and its tuple's `NAT_USED` byte says so
    /// (`nat_used`): once silent past `NAT_LINGER_NS` the flow is over,
    /// whatever the flow table still holds of it.
    pub const DONE: u8 = 128;
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
shared!(FlowKey, 40);

/// Value of `FLOWS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowValue {
    pub backend: u32,
    pub service: u32,
    /// The balancer's source port toward the backend (network order). A
    /// DSR flow has none: for TCP the word keeps the client's sequence
    /// record, 64 KiB coarse (`seqwin::coarse`; the program's `window`).
    pub nat_port_be: u16,
    /// `flow_flags` bits.
    pub flags: u8,
    /// Index of the flow's SNAT address in `Config::snat_addrs`.
    pub snat: u8,
    /// Sequence number of the backend's SYN-ACK (half-open flows); in DSR
    /// the client's ACK number during a turn (`ackclock`); for an open
    /// source-NAT flow, the client's sequence number as `seqwin` records
    /// it (written by the client direction only); for a closed one with
    /// `BACKEND_TIME_WAIT`, the client's latest TCP timestamp value (0:
    /// none seen).
    pub synack_seq: u32,
    /// `bpf_ktime_get_ns()` when the flow was created, then when it started
    /// closing; for an established UDP flow, its last datagram either way
    /// (`bpf_ktime_get_coarse_ns()`, for the idle timeout).
    pub stamp_ns: u64,
    /// When the pending SYN or request turn started (see `flow_flags`).
    pub turn_ns: u64,
}
shared!(FlowValue, 32);

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
