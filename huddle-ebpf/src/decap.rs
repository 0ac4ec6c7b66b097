//! The backend agent's decap (`huddle agent --decap`): unwraps the
//! balancer's IP-in-IP packets on the backend's interface and hands the
//! inner packet, the client's own, to the stack, with no tunnel device or
//! kernel module. Only packets to one of this host's addresses are
//! unwrapped; everything else passes untouched.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action,
    helpers::generated::bpf_xdp_adjust_head,
    macros::{map, xdp},
    maps::{HashMap, PerCpuArray},
    programs::XdpContext,
};
use huddle_common::{addr_v4, decap::MAX_LOCAL, Addr, DecapStats};

const ETH_LEN: usize = 14;
const IP_LEN: usize = 20;
const ETH_P_IP: [u8; 2] = [0x08, 0x00];
const PROTO_IPIP: u8 = 4;

/// This host's addresses (written by the agent).
#[map]
static DECAP_LOCAL: HashMap<Addr, u32> = HashMap::with_max_entries(MAX_LOCAL, 0);

#[map]
static DECAP_STATS: PerCpuArray<DecapStats> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn count(f: impl FnOnce(&mut DecapStats)) {
    if let Some(s) = DECAP_STATS.get_ptr_mut(0) {
        // SAFETY: this CPU's element; the program is not re-entered on it.
        f(unsafe { &mut *s });
    }
}

#[xdp]
pub fn decap(ctx: XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    // Ethernet, outer IPv4 and the inner IPv4 header's fixed part.
    if data + ETH_LEN + IP_LEN + IP_LEN > end {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: the 54 bytes read below were bounds-checked just above.
    let (ethertype, outer, inner_vihl) = unsafe {
        (
            *((data + 12) as *const [u8; 2]),
            *((data + ETH_LEN) as *const [u8; IP_LEN]),
            *((data + ETH_LEN + IP_LEN) as *const u8),
        )
    };
    if ethertype != ETH_P_IP || outer[9] != PROTO_IPIP {
        return xdp_action::XDP_PASS;
    }
    // Outer options, fragments (the stack reassembles those) or an inner
    // packet that is not IPv4: left to the kernel as they are.
    let frag = u16::from_be_bytes([outer[6], outer[7]]) & 0x3fff;
    if outer[0] != 0x45 || frag != 0 || inner_vihl >> 4 != 4 {
        count(|s| s.pass_malformed += 1);
        return xdp_action::XDP_PASS;
    }
    let dst = addr_v4([outer[16], outer[17], outer[18], outer[19]]);
    // SAFETY: only tested for presence.
    if unsafe { DECAP_LOCAL.get(dst) }.is_none() {
        count(|s| s.pass_not_local += 1);
        return xdp_action::XDP_PASS;
    }
    // SAFETY: both 14-byte ranges were bounds-checked above and lie 20
    // bytes apart, so they do not overlap; the Ethernet header moves up
    // over the outer IP header, then the frame starts there.
    unsafe {
        core::ptr::copy_nonoverlapping(
            data as *const [u8; ETH_LEN],
            (data + IP_LEN) as *mut [u8; ETH_LEN],
            1,
        );
        if bpf_xdp_adjust_head(ctx.ctx.cast(), IP_LEN as i32) != 0 {
            return xdp_action::XDP_DROP;
        }
    }
    count(|s| s.decapped += 1);
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
