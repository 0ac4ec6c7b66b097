//! HuddleCluster's XDP program: balances IPv4 and IPv6 TCP and UDP services over
//! each service's active ring, by source NAT (replies come back here) or
//! direct server return (backends answer clients themselves).
#![no_std]
#![no_main]
// Map keys are passed by reference on purpose: most live in the per-CPU
// scratch map, and passing them by value would copy 40 bytes onto a stack
// of 512 for the whole call chain.
#![allow(clippy::needless_borrows_for_generic_args)]

mod csum;
mod lb;
mod mem;
mod net;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use lb::{balance, finish, guard, icmp, maps};
use net::{
    family::{V4, V6},
    parse::{self, Skip},
};

// The in-band verdicts lie above every XDP action (see `huddle_common::verdict`).
const _: () = assert!(xdp_action::XDP_REDIRECT == huddle_common::verdict::LAST_XDP_ACTION);
const _: () = assert!(
    xdp_action::XDP_DROP == huddle_common::verdict::XDP_DROP
        && xdp_action::XDP_PASS == huddle_common::verdict::XDP_PASS
        && xdp_action::XDP_TX == huddle_common::verdict::XDP_TX
        && xdp_action::XDP_REDIRECT == huddle_common::verdict::XDP_REDIRECT
);

#[xdp]
pub fn huddle(ctx: XdpContext) -> u32 {
    if parse::is_ipv6(&ctx) {
        // The IPv6 program: its own verification and its own stack. If
        // none is set, the frame goes to the kernel.
        // SAFETY: a tail call with this program's own context.
        unsafe {
            let _ = maps::TAILS.tail_call(&ctx, huddle_common::TAIL_V6);
        }
        maps::global(|s| s.pass_not_ipv4 += 1);
        return xdp_action::XDP_PASS;
    }
    match parse::parse(&ctx) {
        Ok(p) => finish::then(&ctx, balance::balance::<V4>(&ctx, &p)),
        Err(Skip::NotTcpUdp) if parse::is_icmp(&ctx) => match icmp::v4::inbound(&ctx) {
            xdp_action::XDP_PASS => guard::frame_v4(&ctx),
            verdict => verdict,
        },
        Err(skip) => {
            if !matches!(skip, Skip::NotIpv4) && guard::frame_v4(&ctx) != xdp_action::XDP_PASS {
                return xdp_action::XDP_DROP;
            }
            maps::global(|s| match skip {
                Skip::NotIpv4 => s.pass_not_ipv4 += 1,
                Skip::IpOptions => s.pass_ip_options += 1,
                Skip::Fragment => s.pass_fragment += 1,
                Skip::Malformed => s.pass_malformed += 1,
                Skip::NotTcpUdp => s.pass_not_service += 1,
                Skip::V6Extension => s.pass_v6_ext += 1,
            });
            xdp_action::XDP_PASS
        }
    }
}

/// IPv6 frames, handed over by `huddle`.
#[xdp]
pub fn huddle6(ctx: XdpContext) -> u32 {
    match parse::parse6(&ctx) {
        Ok(p) => finish::then(&ctx, balance::balance::<V6>(&ctx, &p)),
        Err(Skip::V6Extension) if icmp::v6::is_icmp6(&ctx) => match icmp::v6::inbound(&ctx) {
            xdp_action::XDP_PASS => guard::frame_v6(&ctx),
            verdict => verdict,
        },
        Err(skip) => {
            if guard::frame_v6(&ctx) != xdp_action::XDP_PASS {
                return xdp_action::XDP_DROP;
            }
            maps::global(|s| match skip {
                Skip::V6Extension | Skip::NotTcpUdp => s.pass_v6_ext += 1,
                _ => s.pass_malformed += 1,
            });
            xdp_action::XDP_PASS
        }
    }
}

/// Finishes a checksum left to offload and sends the frame, handed over
/// by either program (`lb::finish`).
#[xdp]
pub fn huddle_csum(ctx: XdpContext) -> u32 {
    finish::run(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
