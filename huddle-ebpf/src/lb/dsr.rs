//! Direct server return: the client's packet reaches its backend as the
//! client sent it, and the backend answers the client itself. L2 mode
//! changes only the destination MAC (the backend is on this segment and
//! has the VIP on a local interface); IP-in-IP mode puts the packet inside
//! an outer IPv4 header to the backend, whose decap (`huddle agent
//! --decap`, or a kernel ipip device) hands the inner packet to its stack.
//! No NAT entry, no reply path: a new flow costs a pick and a flow entry.

use crate::lb::scratch;
use crate::{
    csum,
    lb::forward::{finished, out_or_pass_of, route},
    lb::icmp,
    lb::maps::global,
    mem::put,
    net::family::{Family, V4, V6},
    net::parse::Packet,
    net::partial,
};
use aya_ebpf::{
    bindings::xdp_action, helpers::generated::bpf_xdp_adjust_head, programs::XdpContext,
};
use huddle_common::headers::{ETH_LEN, IP6_LEN, IP_LEN};
use huddle_common::{
    verdict::{ROUTED, TOO_BIG},
    Backend, KernelConfig,
};

/// IP protocol number of IPv4-in-IPv4.
pub const PROTO_IPIP: u8 = 4;
/// The largest inner packet an outer IPv4 header can still carry.
const MAX_INNER: u16 = u16::MAX - IP_LEN as u16;

/// L2: the frame goes to the backend's MAC address, the packet untouched.
#[inline(always)]
pub fn l2<F: Family>(
    ctx: &XdpContext,
    p: &Packet<F>,
    cfg: &KernelConfig,
    id: u32,
    backend: &Backend,
) -> u32 {
    let dst = F::narrow(&backend.addr);
    let gen = cfg.hop_generation;
    match route::<F>(
        ctx,
        p.eth,
        p.src(),
        dst,
        p.proto,
        p.tot_len,
        Some(id),
        gen,
        true,
    ) {
        Ok((ifindex, _)) => {
            let (ingress, partial) = (ctx.ingress_ifindex() as u32, partial::left_to_offload(p));
            finished(
                cfg,
                p,
                partial,
                partial::l4_offset(ctx, p),
                ingress,
                ifindex,
            )
        }
        // Not on this segment: no MAC of ours reaches it, and the kernel
        // would route the packet by its VIP.
        Err(ROUTED) => {
            global(|s| s.drop_not_onlink += 1);
            xdp_action::XDP_DROP
        }
        // The control plane resolves its backends' neighbours; the client
        // resends.
        Err(_) => {
            global(|s| s.drop_no_neigh += 1);
            xdp_action::XDP_DROP
        }
    }
}

/// IP-in-IP: the outer header's source comes from the configured prefix,
/// its per-flow bits from the client's address and port; DF, TOS and the
/// IP id are the inner packet's, TTL 64.
#[inline(always)]
pub fn encap(ctx: &XdpContext, p: &Packet, cfg: &KernelConfig, id: u32, dst: [u8; 4]) -> u32 {
    if p.tot_len > MAX_INNER {
        global(|s| s.drop_encap += 1);
        return xdp_action::XDP_DROP;
    }
    let outer_len = p.tot_len + IP_LEN as u16;
    let src = outer_source(p, cfg);
    // SAFETY: the IP header was bounds-checked by `parse`.
    let (tos, ip_id, df) = unsafe { ((*p.ip).tos, (*p.ip).id, (*p.ip).frags[0] & 0x40) };
    // Where the frame came from, for an ICMP answer: `route` overwrites it.
    // SAFETY: the Ethernet header was bounds-checked by `parse`.
    let macs: [u8; 12] = unsafe { *p.eth.cast::<[u8; 12]>() };
    // Asked while `p`'s pointers hold: the inner segment moves back by
    // the outer header.
    let partial = partial::left_to_offload(p);
    let l4_off = partial::l4_offset(ctx, p) + IP_LEN as u32;
    // Asked before the packet changes (`p`'s pointers die with it): the
    // next hop's addresses go into the client's Ethernet header, which
    // then moves to the front.
    let next = route::<V4>(
        ctx,
        p.eth,
        &src,
        &dst,
        PROTO_IPIP,
        outer_len,
        Some(id),
        cfg.hop_generation,
        false,
    );
    let too_big = matches!(next, Ok((_, mtu)) if outer_len > mtu);
    if let (true, Ok((_, mtu))) = (too_big && df != 0, next) {
        // It would not fit: the client learns the size that does.
        return icmp::v4::too_big(ctx, mtu.saturating_sub(IP_LEN as u16), &macs);
    }
    // SAFETY: plain helper call; every pointer is derived afresh below.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx.cast(), -(IP_LEN as i32)) } != 0 {
        global(|s| s.drop_encap += 1);
        return xdp_action::XDP_DROP;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + IP_LEN + ETH_LEN + IP_LEN > end {
        return xdp_action::XDP_DROP;
    }
    let outer = (data + ETH_LEN) as *mut u8;
    let len = outer_len.to_be_bytes();
    let id_b = ip_id;
    let iph: [u8; IP_LEN] = [
        0x45, tos, len[0], len[1], id_b[0], id_b[1], df, 0, 64, PROTO_IPIP, 0, 0, src[0], src[1],
        src[2], src[3], dst[0], dst[1], dst[2], dst[3],
    ];
    // SAFETY: the new Ethernet header, the outer IP header and the old
    // Ethernet header (the 14 bytes after the new start plus 20) were
    // checked to lie inside the packet just above; the old and new
    // Ethernet headers do not overlap (20 bytes apart).
    unsafe {
        // The client's header, with the next hop's addresses if there is
        // one (else still this host's: the kernel takes the packet).
        core::ptr::copy_nonoverlapping(
            (data + IP_LEN) as *const [u8; ETH_LEN],
            data as *mut [u8; ETH_LEN],
            1,
        );
        put(outer.cast::<[u8; IP_LEN]>(), &iph);
        outer
            .add(10)
            .cast::<u16>()
            .write_unaligned(csum::apply(0xffff, csum::words(&iph)));
    }
    global(|s| s.encap += 1);
    if too_big {
        // May be fragmented: the kernel does that, as addressed to it.
        // Bounds checked above.
        put(data as *mut [u8; 12], &macs);
        global(|s| s.encap_fragmented += 1);
        return xdp_action::XDP_PASS;
    }
    // Without a next hop, the kernel resolves the neighbour and forwards
    // the outer packet.
    out_or_pass_of(ctx, cfg, p, partial, l4_off, next)
}

/// IPv6 next header of an IPv6 packet inside another.
pub const PROTO_IPV6: u8 = 41;

/// IPv6 in IPv6: the client's packet inside an outer header from
/// `KernelConfig::encap6_src` to the backend, hop limit 64, the inner traffic
/// class, a flow label from the client's address and port (so a backend's
/// NIC spreads flows over its queues).
#[inline(always)]
pub fn encap6(
    ctx: &XdpContext,
    p: &Packet<V6>,
    cfg: &KernelConfig,
    id: u32,
    backend: &Backend,
) -> u32 {
    if usize::from(p.tot_len) + IP6_LEN > usize::from(u16::MAX) {
        global(|s| s.drop_encap += 1);
        return xdp_action::XDP_DROP;
    }
    let payload = p.tot_len.to_be_bytes();
    let (tc, label) = class_and_label(p);
    // Where the frame came from, for an ICMPv6 answer (`route`
    // overwrites it): kept in the scratch map, off the call chain's stack.
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's element; `parse6` checked the Ethernet header.
    unsafe { put(&mut (*sc).macs, &*p.eth.cast::<[u8; 12]>()) };
    let outer_len = p.tot_len + IP6_LEN as u16;
    let partial = partial::left_to_offload(p);
    let l4_off = partial::l4_offset(ctx, p) + IP6_LEN as u32;
    let next = route::<V6>(
        ctx,
        p.eth,
        &cfg.encap6_src,
        &backend.addr,
        PROTO_IPV6,
        outer_len,
        Some(id),
        cfg.hop_generation,
        false,
    );
    if let Ok((_, mtu)) = next {
        if outer_len > mtu {
            // IPv6 is never fragmented on the way: the client learns the
            // size that fits (answered by the caller, whose stack has room).
            // SAFETY: as above.
            unsafe { (*sc).mtu = u32::from(mtu).saturating_sub(IP6_LEN as u32) };
            return TOO_BIG;
        }
    }
    // SAFETY: plain helper call; every pointer is derived afresh below.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx.cast(), -(IP6_LEN as i32)) } != 0 {
        global(|s| s.drop_encap += 1);
        return xdp_action::XDP_DROP;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + IP6_LEN + ETH_LEN > end {
        return xdp_action::XDP_DROP;
    }
    let outer = (data + ETH_LEN) as *mut u8;
    // SAFETY: the 54 bytes below were bounds-checked just above; the old
    // Ethernet header (40 bytes on) is copied to the front first, then
    // the outer header overwrites what is left of it.
    unsafe {
        core::ptr::copy_nonoverlapping(
            (data + IP6_LEN) as *const [u8; ETH_LEN],
            data as *mut [u8; ETH_LEN],
            1,
        );
        let head: [u8; 8] = [
            0x60 | (tc >> 4),
            (tc << 4) | (label[1] & 0x0f),
            label[2],
            label[3],
            payload[0],
            payload[1],
            PROTO_IPV6,
            64,
        ];
        put(outer.cast::<[u8; 8]>(), &head);
        put(outer.add(8).cast::<[u8; 16]>(), &cfg.encap6_src);
        put(outer.add(24).cast::<[u8; 16]>(), &backend.addr);
    }
    global(|s| s.encap += 1);
    out_or_pass_of(ctx, cfg, p, partial, l4_off, next)
}

/// The outer IPv4 source of a client's flow: the configured prefix, its
/// per-flow bits (`encap_vary`) from the client's address and port, so a
/// backend's NIC spreads the flows over its queues.
#[inline(always)]
fn outer_source(p: &Packet, cfg: &KernelConfig) -> [u8; 4] {
    let vary = cfg.encap_vary;
    let base = u32::from_ne_bytes([
        cfg.encap_src[0],
        cfg.encap_src[1],
        cfg.encap_src[2],
        cfg.encap_src[3],
    ]);
    let mut h = (u32::from_ne_bytes(*p.src()) ^ u32::from(u16::from_ne_bytes(p.sport)))
        .wrapping_mul(0x9e37_79b1);
    h ^= h >> 16;
    ((base & !vary) | (h & vary)).to_ne_bytes()
}

/// The outer IPv6 header's traffic class (the inner one) and flow label
/// (from the client's address and port).
#[inline(always)]
fn class_and_label(p: &Packet<V6>) -> (u8, [u8; 4]) {
    // SAFETY: `parse6` checked the IP header; word 3 of 4 of the source.
    let (vcf, low) = unsafe {
        (
            (*p.ip).vcf,
            u32::from_ne_bytes([
                (*p.ip).src_addr[12],
                (*p.ip).src_addr[13],
                (*p.ip).src_addr[14],
                (*p.ip).src_addr[15],
            ]),
        )
    };
    let mut h = (low ^ u32::from(u16::from_ne_bytes(p.sport))).wrapping_mul(0x9e37_79b1);
    h ^= h >> 16;
    // Traffic class: bits 4..12 of the first word.
    (
        (vcf[0] << 4) | (vcf[1] >> 4),
        (h & 0x000f_ffff).to_be_bytes(),
    )
}

/// How a `dsr-ipip` packet is wrapped, per family.
pub trait Encap: Family {
    /// Sends a client packet of a `dsr-ipip` flow to its backend inside
    /// an outer header of this family.
    fn encap(
        ctx: &XdpContext,
        p: &Packet<Self>,
        cfg: &KernelConfig,
        id: u32,
        backend: &Backend,
    ) -> u32;
    /// Answers a packet `encap` found too big (`verdict::TOO_BIG`).
    fn too_big(ctx: &XdpContext) -> u32;
}

impl Encap for V4 {
    #[inline(always)]
    fn encap(
        ctx: &XdpContext,
        p: &Packet<V4>,
        cfg: &KernelConfig,
        id: u32,
        backend: &Backend,
    ) -> u32 {
        encap(ctx, p, cfg, id, *V4::narrow(&backend.addr))
    }

    /// Never asked: IPv4's answer fits under `encap`.
    #[inline(always)]
    fn too_big(_ctx: &XdpContext) -> u32 {
        aya_ebpf::bindings::xdp_action::XDP_DROP
    }
}

impl Encap for V6 {
    #[inline(always)]
    fn encap(
        ctx: &XdpContext,
        p: &Packet<V6>,
        cfg: &KernelConfig,
        id: u32,
        backend: &Backend,
    ) -> u32 {
        encap6(ctx, p, cfg, id, backend)
    }

    #[inline(always)]
    fn too_big(ctx: &XdpContext) -> u32 {
        icmp::v6::too_big(ctx)
    }
}
