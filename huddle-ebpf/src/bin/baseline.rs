//! Baselines timed next to the balancer by `huddle bench`: the floor of an
//! XDP program that does nothing, and a minimal forwarder that parses
//! Ethernet/IPv4/TCP, swaps MACs and sends the frame back out. No maps, so
//! `ip link set ... xdp obj` can load it too (the test harness does).
#![no_std]
#![no_main]

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use core::mem::size_of;
use network_types::{eth::EthHdr, ip::Ipv4Hdr, tcp::TcpHdr};

#[xdp]
pub fn pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[xdp]
pub fn swap_tx(ctx: XdpContext) -> u32 {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + size_of::<EthHdr>() + size_of::<Ipv4Hdr>() + size_of::<TcpHdr>() > end {
        return xdp_action::XDP_PASS;
    }
    let eth = start as *mut EthHdr;
    // SAFETY: bounds checked above.
    unsafe {
        if u16::from_be((*eth).ether_type) != 0x0800 {
            return xdp_action::XDP_PASS;
        }
        let ip = (start + EthHdr::LEN) as *const Ipv4Hdr;
        if (*ip).proto != 6 {
            return xdp_action::XDP_PASS;
        }
        core::mem::swap(&mut (*eth).dst_addr, &mut (*eth).src_addr);
    }
    xdp_action::XDP_TX
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
