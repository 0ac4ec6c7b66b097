//! Sending a rewritten packet: next hop from the kernel's FIB, then XDP_TX
//! or a redirect; anything the FIB cannot settle goes to the kernel.
//!
//! Toward a backend the FIB's answer is cached per CPU until the control
//! plane bumps `Config::hop_generation` (every second): a FIB lookup costs
//! more than the rest of the established-flow path, a backend's next hop
//! rarely changes, and comparing a generation costs no clock read.

use crate::{
    maps::{global, put, NEXT_HOP},
    parse::Packet,
};
use aya_ebpf::{
    bindings::{bpf_fib_lookup, xdp_action, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS},
    helpers::generated::{bpf_fib_lookup as fib_lookup, bpf_redirect},
    programs::XdpContext,
};
use core::mem::{size_of, zeroed};

const AF_INET: u8 = 2;

/// Forwards the already rewritten packet `p` toward its new destination;
/// `generation` is the control plane's current next-hop generation.
///
/// When the neighbour is not resolved the packet goes up to the kernel,
/// which resolves it and forwards (the control plane enables forwarding
/// and `accept_local` on the interface for this); it is never dropped here.
#[inline(always)]
pub fn send(ctx: &XdpContext, p: &Packet, backend: Option<u32>, generation: u64) -> u32 {
    let ingress = ctx.ingress_ifindex() as u32;
    let cache = backend.and_then(|id| NEXT_HOP.get_ptr_mut(id));
    // Stored plus one, so a never-filled entry (0) never matches.
    let current = generation.wrapping_add(1);
    if let Some(c) = cache {
        // SAFETY: this CPU's element; the Ethernet header was
        // bounds-checked by `parse`.
        unsafe {
            let hop = &*c;
            if hop.generation == current && hop.ingress == ingress {
                put(&mut (*p.eth).dst_addr, &hop.dmac);
                put(&mut (*p.eth).src_addr, &hop.smac);
                return out(ingress, hop.ifindex);
            }
        }
    }
    // SAFETY: an all-zero bpf_fib_lookup is a valid request skeleton.
    let mut params: bpf_fib_lookup = unsafe { zeroed() };
    params.family = AF_INET;
    params.l4_protocol = p.proto;
    params.__bindgen_anon_1.tot_len = p.tot_len;
    params.ifindex = ctx.ingress_ifindex() as u32;
    // SAFETY: the IP header was bounds-checked by `parse`.
    unsafe {
        params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes((*p.ip).src_addr);
        params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes((*p.ip).dst_addr);
    }
    // SAFETY: `params` is a valid, correctly sized request for the helper.
    let rc = unsafe {
        fib_lookup(
            ctx.ctx.cast(),
            &mut params,
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    match rc as u32 {
        BPF_FIB_LKUP_RET_SUCCESS => {
            // SAFETY: the Ethernet header was bounds-checked by `parse`;
            // the cache element is this CPU's.
            unsafe {
                put(&mut (*p.eth).dst_addr, &params.dmac);
                put(&mut (*p.eth).src_addr, &params.smac);
                if let Some(c) = cache {
                    (*c).smac = params.smac;
                    (*c).dmac = params.dmac;
                    (*c).ifindex = params.ifindex;
                    (*c).ingress = ingress;
                    (*c).generation = current;
                }
            }
            out(ingress, params.ifindex)
        }
        BPF_FIB_LKUP_RET_NO_NEIGH => {
            global(|s| s.pass_no_neigh += 1);
            xdp_action::XDP_PASS
        }
        _ => {
            global(|s| s.pass_no_route += 1);
            xdp_action::XDP_PASS
        }
    }
}

/// XDP_TX when the next hop is out of the interface the packet came in on,
/// else a redirect.
#[inline(always)]
fn out(ingress: u32, ifindex: u32) -> u32 {
    if ifindex == ingress {
        global(|s| s.tx += 1);
        xdp_action::XDP_TX
    } else {
        global(|s| s.redirect += 1);
        // SAFETY: plain helper call.
        unsafe { bpf_redirect(ifindex, 0) as u32 }
    }
}
