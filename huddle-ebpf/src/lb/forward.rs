//! Sending a rewritten packet: next hop from the kernel's FIB, then XDP_TX
//! or a redirect; anything the FIB cannot settle goes to the kernel.
//!
//! The FIB's answer is cached per CPU until the control plane bumps
//! `KernelConfig::hop_generation` (every second): toward a backend by its id,
//! toward a client in a small direct-mapped cache by address. A FIB lookup
//! costs more than the rest of the established-flow path, a next hop
//! rarely changes, and comparing a generation costs no clock read.

use crate::{
    lb::maps::{global, CLIENT_HOP, NEXT_HOP},
    lb::scratch,
    mem::put,
    net::family::Family,
    net::parse::Packet,
    net::partial,
};
use aya_ebpf::{
    bindings::{
        bpf_fib_lookup, xdp_action, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH,
        BPF_FIB_LKUP_RET_SUCCESS,
    },
    helpers::generated::{bpf_fib_lookup as fib_lookup, bpf_redirect},
    programs::XdpContext,
};
use core::mem::{size_of, zeroed};
use huddle_common::{
    addr_words, client_hop_slot, config_flags,
    verdict::{FINISH_CSUM, MTU_ANY, ROUTED},
    KernelConfig, NextHop,
};
use network_types::eth::EthHdr;

/// Forwards the already rewritten packet `p` toward its new destination:
/// backend `backend`, or a client (`None`); `partial`: its checksum was
/// left to offload (as the rewrite found).
///
/// When the neighbour is not resolved the packet goes up to the kernel,
/// which resolves it and forwards (the control plane enables forwarding
/// and `accept_local` on the interface for this); it is never dropped here.
#[inline(always)]
pub fn send<F: Family>(
    ctx: &XdpContext,
    p: &Packet<F>,
    backend: Option<u32>,
    cfg: &KernelConfig,
    partial: bool,
) -> u32 {
    let generation = cfg.hop_generation;
    // SAFETY: `parse` checked the header's bounds.
    let (src, dst) = unsafe { F::addrs(p.ip) };
    let cache = match backend {
        Some(id) => NEXT_HOP.get_ptr_mut(id),
        None => client_hop::<F>(dst),
    };
    // Read once for the whole path: LLVM otherwise may keep the field's
    // address in a register, which the verifier refuses for a context.
    let ingress = ctx.ingress_ifindex() as u32;
    // SAFETY: `parse` checked the Ethernet header's bounds.
    let arrived_to = unsafe { (*p.eth).dst_addr };
    match route_via::<F>(
        ctx, ingress, p.eth, src, dst, p.proto, p.tot_len, cache, generation, false,
    ) {
        // A reply bigger than the path toward its client takes (a frame
        // GRO coalesced, which generic mode sees whole): the kernel's (a
        // FIB lookup with its length would have said so), addressed to
        // this host again. With the next hop's MAC left on it, the kernel
        // took it for another host's and dropped it unseen (no
        // IpForwDatagrams): 100 KB took 6.8 s through generic mode.
        Ok((_, mtu)) if backend.is_none() && p.tot_len > mtu => {
            // SAFETY: as above.
            unsafe { put(&mut (*p.eth).dst_addr, &arrived_to) };
            unsettled(BPF_FIB_LKUP_RET_FRAG_NEEDED);
            xdp_action::XDP_PASS
        }
        Ok((ifindex, _)) => finished(
            cfg,
            p,
            partial,
            partial::l4_offset(ctx, p),
            ingress,
            ifindex,
        ),
        Err(rc) => {
            unsettled(rc);
            xdp_action::XDP_PASS
        }
    }
}

/// This CPU's cache slot for the next hop toward client `dst`, emptied
/// first if it held another client's.
#[inline(always)]
fn client_hop<F: Family>(dst: &F::Addr) -> Option<*mut NextHop> {
    let addr = addr_words(&F::wide(dst));
    let c = CLIENT_HOP.get_ptr_mut(client_hop_slot(addr))?;
    // SAFETY: this CPU's element, used by this run only.
    unsafe {
        if (*c).addr != addr {
            (*c).addr = addr;
            (*c).hop.generation = 0;
        }
        Some(core::ptr::addr_of_mut!((*c).hop))
    }
}

/// Sets the MAC addresses of the frame whose Ethernet header is `eth` for
/// a packet from `src` to `dst` (network order) and returns the interface
/// to leave by and the path's MTU: the next hop cached for `backend` while
/// current, else the FIB's (cached again; without a backend the MTU is
/// not asked and given as `MTU_ANY`). `onlink`: the destination must be a
/// neighbour, not behind a gateway. The error is the FIB's answer when it
/// gave no next hop (`BPF_FIB_LKUP_RET_*`), or `ROUTED`; the frame is
/// unchanged.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn route<F: Family>(
    ctx: &XdpContext,
    eth: *mut EthHdr,
    src: &F::Addr,
    dst: &F::Addr,
    proto: u8,
    tot_len: u16,
    backend: Option<u32>,
    generation: u64,
    onlink: bool,
) -> Result<(u32, u16), u32> {
    let cache = backend.and_then(|id| NEXT_HOP.get_ptr_mut(id));
    let ingress = ctx.ingress_ifindex() as u32;
    route_via::<F>(
        ctx, ingress, eth, src, dst, proto, tot_len, cache, generation, onlink,
    )
}

/// `route` for a packet that came in on `ingress`, with the cache entry
/// to use (`None`: ask the FIB with the packet's length, cache nothing).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn route_via<F: Family>(
    ctx: &XdpContext,
    ingress: u32,
    eth: *mut EthHdr,
    src: &F::Addr,
    dst: &F::Addr,
    proto: u8,
    tot_len: u16,
    cache: Option<*mut NextHop>,
    generation: u64,
    onlink: bool,
) -> Result<(u32, u16), u32> {
    // Stored plus one, so a never-filled entry (0) never matches.
    let current = generation.wrapping_add(1);
    if let Some(c) = cache {
        // SAFETY: this CPU's element; the caller checked `eth`'s bounds.
        unsafe {
            let hop = &*c;
            if hop.generation == current && hop.ingress == ingress {
                if onlink && hop.routed != 0 {
                    return Err(ROUTED);
                }
                put(&mut (*eth).dst_addr, &hop.dmac);
                put(&mut (*eth).src_addr, &hop.smac);
                return Ok((hop.ifindex, hop.mtu));
            }
        }
    }
    // SAFETY: an all-zero bpf_fib_lookup is a valid request skeleton.
    let mut params: bpf_fib_lookup = unsafe { zeroed() };
    // A cached hop serves packets of any size, its MTU apart (below):
    // asked without a length, the FIB checks none.
    let len = if cache.is_some() { 0 } else { tot_len };
    let rc = ask::<F>(ctx, ingress, &mut params, (src, dst), proto, len);
    if rc as u32 != BPF_FIB_LKUP_RET_SUCCESS {
        return Err(rc as u32);
    }
    // The FIB leaves the next hop's address where the destination was:
    // another address there means a gateway.
    // SAFETY: a union field the helper filled.
    let routed = !F::fib_dst_is(&params, dst);
    let ifindex = params.ifindex;
    // SAFETY: the caller checked `eth`'s bounds.
    unsafe {
        if onlink && routed {
            return Err(ROUTED);
        }
        put(&mut (*eth).dst_addr, &params.dmac);
        put(&mut (*eth).src_addr, &params.smac);
    }
    let Some(c) = cache else {
        return Ok((ifindex, MTU_ANY));
    };
    // SAFETY: this CPU's element.
    unsafe {
        (*c).smac = params.smac;
        (*c).dmac = params.dmac;
        (*c).ifindex = ifindex;
        (*c).ingress = ingress;
        (*c).routed = u8::from(routed);
    }
    // The path MTU, for what grows on the way (IP-in-IP): the FIB gives it
    // for a packet too big for it. Asked only when the cache is filled, in
    // the same request (no second one on the stack).
    let rc = ask::<F>(ctx, ingress, &mut params, (src, dst), proto, u16::MAX);
    let mtu = if rc as u32 == BPF_FIB_LKUP_RET_FRAG_NEEDED {
        // SAFETY: the union field the helper filled for this answer.
        unsafe { params.__bindgen_anon_1.mtu_result }
    } else {
        MTU_ANY
    };
    // SAFETY: this CPU's element; the generation last, so the entry is
    // used only once whole.
    unsafe {
        (*c).mtu = mtu;
        (*c).generation = current;
    }
    Ok((ifindex, mtu))
}

/// Asks the FIB for the next hop of a packet of `tot_len` bytes from
/// `addrs.0` to `addrs.1` coming in on `ingress`; `params` holds the
/// answer. Returns the FIB's verdict (`BPF_FIB_LKUP_RET_*`).
#[inline(always)]
fn ask<F: Family>(
    ctx: &XdpContext,
    ingress: u32,
    params: &mut bpf_fib_lookup,
    addrs: (&F::Addr, &F::Addr),
    proto: u8,
    tot_len: u16,
) -> i64 {
    params.family = F::FAMILY;
    params.l4_protocol = proto;
    params.__bindgen_anon_1.tot_len = tot_len;
    params.ifindex = ingress;
    F::fib_addrs(params, addrs.0, addrs.1);
    // SAFETY: `params` is a valid, correctly sized request for the helper.
    unsafe {
        fib_lookup(
            ctx.ctx.cast(),
            params,
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    }
}

/// Counts a packet `route` found no next hop for, which goes to the kernel.
#[inline(always)]
pub fn unsettled(rc: u32) {
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        global(|s| s.pass_no_neigh += 1);
    } else {
        global(|s| s.pass_no_route += 1);
    }
}

/// Out toward the next hop `route` found, or to the kernel (counted by
/// why) when it found none: the kernel resolves the neighbour or routes.
#[inline(always)]
pub fn out_or_pass(ctx: &XdpContext, next: Result<(u32, u16), u32>) -> u32 {
    match next {
        Ok((ifindex, _)) => out(ctx, ifindex),
        Err(rc) => {
            unsettled(rc);
            xdp_action::XDP_PASS
        }
    }
}

/// `out_or_pass` for the client's packet `p` (its L4 header now `l4_off`
/// bytes into the frame, its checksum `partial`ly summed or not), the
/// checksum finished first if the frame goes out.
#[inline(always)]
pub fn out_or_pass_of<F: Family>(
    ctx: &XdpContext,
    cfg: &KernelConfig,
    p: &Packet<F>,
    partial: bool,
    l4_off: u32,
    next: Result<(u32, u16), u32>,
) -> u32 {
    match next {
        Ok((ifindex, _)) => finished(
            cfg,
            p,
            partial,
            l4_off,
            ctx.ingress_ifindex() as u32,
            ifindex,
        ),
        Err(_) => out_or_pass(ctx, next),
    }
}

/// XDP_TX when the next hop is out of the interface the packet came in on,
/// else a redirect.
#[inline(always)]
pub fn out(ctx: &XdpContext, ifindex: u32) -> u32 {
    out_from(ctx.ingress_ifindex() as u32, ifindex)
}

/// `out_from` for the packet `p` (its L4 header `l4_off` bytes into the
/// frame): if its checksum was left to offload (`partial`) and the frames
/// are not skbs that keep that state (`SKB_MODE`), the checksum program
/// finishes it and sends the frame instead (`lb::finish`).
#[inline(always)]
pub fn finished<F: Family>(
    cfg: &KernelConfig,
    p: &Packet<F>,
    partial: bool,
    l4_off: u32,
    ingress: u32,
    ifindex: u32,
) -> u32 {
    if !partial || cfg.flags & config_flags::SKB_MODE != 0 {
        return out_from(ingress, ifindex);
    }
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_DROP;
    };
    // SAFETY: this CPU's element, used by this run only.
    unsafe {
        let job = &mut (*sc).csum;
        job.l4_off = l4_off;
        job.l4_len = u32::from(partial::l4_len(p));
        job.proto = u32::from(p.proto);
        job.ifindex = if ifindex == ingress { 0 } else { ifindex };
    }
    FINISH_CSUM
}

/// `out` for a packet that came in on `ingress`.
#[inline(always)]
pub fn out_from(ingress: u32, ifindex: u32) -> u32 {
    if ifindex == ingress {
        global(|s| s.tx += 1);
        xdp_action::XDP_TX
    } else {
        global(|s| s.redirect += 1);
        // SAFETY: plain helper call.
        unsafe { bpf_redirect(ifindex, 0) as u32 }
    }
}
