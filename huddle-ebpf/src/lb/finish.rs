//! Frames whose TCP or UDP checksum was left to offload (`net::partial`)
//! are finished by a program of their own, `huddle_csum`, reached by a
//! tail call once the path has decided to send them: the sum's loop,
//! inlined into every path that sends, took the main program past the
//! verifier's 1M instructions. The path leaves the job in the scratch map
//! and answers `FINISH_CSUM` (`forward::finished`); the entry programs hand
//! that over.

use crate::{
    lb::forward::out_from,
    lb::maps::{global, TAILS},
    lb::scratch,
    net::partial,
};
use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use huddle_common::{verdict::FINISH_CSUM, TAIL_CSUM};

/// An entry program's last step: a `FINISH_CSUM` answer goes on to the
/// checksum program; if it is not set (never, once loaded), the frame is
/// dropped rather than sent corrupt.
#[inline(always)]
pub fn then(ctx: &XdpContext, verdict: u32) -> u32 {
    if verdict != FINISH_CSUM {
        return verdict;
    }
    // SAFETY: a tail call with this program's own context.
    unsafe {
        let _ = TAILS.tail_call(ctx, TAIL_CSUM);
    }
    global(|s| s.drop_csum += 1);
    xdp_action::XDP_DROP
}

/// The checksum program's body: finishes the job's checksum and sends the
/// frame as the path decided.
#[inline(always)]
pub fn run(ctx: &XdpContext) -> u32 {
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_DROP;
    };
    // SAFETY: this CPU's element, written by the path that handed over.
    let (off, len, proto, ifindex) = unsafe {
        let job = &(*sc).csum;
        (job.l4_off, job.l4_len, job.proto as u8, job.ifindex)
    };
    if !partial::complete(ctx, off, len, proto) {
        global(|s| s.drop_csum += 1);
        return xdp_action::XDP_DROP;
    }
    global(|s| s.csum_finished += 1);
    let ingress = ctx.ingress_ifindex() as u32;
    out_from(ingress, if ifindex == 0 { ingress } else { ifindex })
}
