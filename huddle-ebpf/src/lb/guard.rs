//! Traffic the program does not balance (another port or protocol, a
//! ping, a fragment, a stray segment) but that is addressed to a VIP or a
//! backend: dropped here. Handed to the kernel, it would be forwarded (the
//! balancer forwards, for the FIB's sake): a ping to a VIP whose router
//! routes it here, and whose default route leads back to that router,
//! crosses the link until its TTL runs out; a client that routes the
//! backends' subnet through the balancer reaches every backend port.
//! `GUARDED` names those addresses, less the host's own (which the kernel
//! delivers, never forwards); the lookup is paid only by traffic that is
//! not balanced.

use crate::{
    lb::maps::{global, GUARDED, GUARD_FILTER},
    net::family::{Family, V4, V6},
};
use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use huddle_common::{
    guard_bit,
    headers::{ETH_LEN, IP_LEN},
    Addr,
};

/// Offset of the IPv4 destination in the header, and of IPv6's.
const DST4_AT: usize = 16;
const DST6_AT: usize = 24;
const IP6_LEN: usize = 40;

/// The verdict for a packet to `dst` that is not balanced: dropped if the
/// services name `dst`, else the kernel's.
#[inline(always)]
pub fn pass<F: Family>(dst: &F::Addr) -> u32 {
    pass_wide(&F::wide(dst))
}

#[inline(always)]
fn pass_wide(dst: &Addr) -> u32 {
    let bit = guard_bit(dst);
    let maybe = GUARD_FILTER
        .get(0)
        .is_some_and(|f| f[(bit >> 6) as usize] & (1 << (bit & 63)) != 0);
    // SAFETY: only the entry's presence is read.
    if maybe && unsafe { GUARDED.get(dst) }.is_some() {
        global(|s| s.drop_guarded += 1);
        return xdp_action::XDP_DROP;
    }
    xdp_action::XDP_PASS
}

/// `pass` for an IPv4 frame the parser set aside (options, a fragment, not
/// TCP or UDP, malformed past its fixed header): by the header's
/// destination, if the frame holds one.
#[inline(always)]
pub fn frame_v4(ctx: &XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + ETH_LEN + IP_LEN > end {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: within the bounds checked above; alignment 1.
    let dst = unsafe { *((data + ETH_LEN + DST4_AT) as *const [u8; 4]) };
    pass::<V4>(&dst)
}

/// `frame_v4` for IPv6.
#[inline(always)]
pub fn frame_v6(ctx: &XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + ETH_LEN + IP6_LEN > end {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: within the bounds checked above; alignment 1.
    let dst = unsafe { *((data + ETH_LEN + DST6_AT) as *const [u8; 16]) };
    pass::<V6>(&dst)
}
