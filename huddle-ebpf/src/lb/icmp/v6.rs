//! ICMPv6 the balancer answers or translates, as `icmp` does for IPv4: a
//! packet too big once wrapped in IPv6-in-IPv6 gets "packet too big" back
//! from the VIP (IPv6 routers never fragment, so every such packet does),
//! and an ICMPv6 error about a source-NATed flow goes to its client,
//! translated.

use crate::lb::scratch;
use crate::{
    csum::{apply, words},
    lb::forward::{out_or_pass, route},
    lb::halfopen,
    lb::icmp::v4::{bounce, quoted_transport},
    lb::maps::{global, CONFIG},
    lb::snat::rewrite::diff128,
    lb::tables::nat_table,
    mem::put,
    net::family::V6,
};
use aya_ebpf::{
    bindings::xdp_action,
    helpers::generated::{bpf_csum_diff, bpf_xdp_adjust_head, bpf_xdp_adjust_tail},
    programs::XdpContext,
};
use huddle_common::headers::{ETH_LEN, ICMP_LEN, IP6_LEN};
use huddle_common::{FlowKey, KernelConfig, NatKey, FAMILY_V6, PROTO_TCP, PROTO_UDP};

pub const PROTO_ICMP6: u8 = 58;
const DEST_UNREACH: u8 = 1;
const PACKET_TOO_BIG: u8 = 2;
const PARAM_PROBLEM: u8 = 4;
/// What "packet too big" quotes: as much of the packet as keeps the
/// answer within the minimum IPv6 MTU of 1,280 bytes (RFC 4443 2.4). A
/// packet too big for a link (at least 1,280) once 40 bytes are put in
/// front is longer than this.
const QUOTE: usize = 1280 - IP6_LEN - ICMP_LEN;
/// `bpf_csum_diff` sums at most 512 bytes a call.
const CHUNK: usize = 512;
/// The smallest MTU an IPv6 link has; a smaller figure is never sent.
const MIN_MTU: u32 = 1280;

/// Turns the client's packet in the frame (Ethernet, IPv6) into an ICMPv6
/// "packet too big" naming the MTU `dsr::encap6` left in the scratch map,
/// from the packet's destination to its source, sent back the way it came
/// (the scratch map's `macs`: the frame's Ethernet addresses as it
/// arrived, destination then source).
#[inline(never)]
pub fn too_big(ctx: &XdpContext) -> u32 {
    if !super::gate::may_send() {
        return xdp_action::XDP_DROP;
    }
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_DROP;
    };
    // SAFETY: this CPU's element, used by this run only.
    let (macs, mtu) = unsafe { (&(*sc).macs, (*sc).mtu) };
    // SAFETY: plain helper calls; pointers are derived afresh after them.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx.cast(), -((IP6_LEN + ICMP_LEN) as i32)) } != 0 {
        return xdp_action::XDP_DROP;
    }
    let want = (ETH_LEN + IP6_LEN + ICMP_LEN + QUOTE) as i32;
    let have = (ctx.data_end() - ctx.data()) as i32;
    if have < want {
        // A link under the IPv6 minimum: nothing sensible to say.
        global(|s| s.drop_encap += 1);
        return xdp_action::XDP_DROP;
    }
    if have > want && unsafe { bpf_xdp_adjust_tail(ctx.ctx.cast(), want - have) } != 0 {
        return xdp_action::XDP_DROP;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + ETH_LEN + IP6_LEN + ICMP_LEN + QUOTE > end {
        return xdp_action::XDP_DROP;
    }
    let ip = (data + ETH_LEN) as *mut u8;
    let icmp = (data + ETH_LEN + IP6_LEN) as *mut u8;
    let quote = (data + ETH_LEN + IP6_LEN + ICMP_LEN) as *mut u8;
    let m = mtu.max(MIN_MTU).to_be_bytes();
    let len = ((ICMP_LEN + QUOTE) as u16).to_be_bytes();
    let icmph: [u8; ICMP_LEN] = [PACKET_TOO_BIG, 0, 0, 0, m[0], m[1], m[2], m[3]];
    // SAFETY: every range below lies in the bounds checked above; the
    // quote's addresses are copied into the new header, 48 bytes before.
    unsafe {
        bounce(data, macs, [0x86, 0xdd]);
        put(
            ip.cast::<[u8; 8]>(),
            &[0x60, 0, 0, 0, len[0], len[1], PROTO_ICMP6, 64],
        );
        // From the VIP (the quote's destination) to the client.
        put(
            ip.add(8).cast::<[u8; 16]>(),
            &*quote.add(24).cast::<[u8; 16]>(),
        );
        put(
            ip.add(24).cast::<[u8; 16]>(),
            &*quote.add(8).cast::<[u8; 16]>(),
        );
        put(icmp.cast::<[u8; ICMP_LEN]>(), &icmph);
        // Pseudo header (addresses, length, next header), the ICMPv6
        // header, then the quote.
        let mut sum = words(&*ip.add(8).cast::<[u8; 32]>())
            + u64::from(u16::from_ne_bytes(len))
            + u64::from(u16::from_ne_bytes([0, PROTO_ICMP6]))
            + words(&icmph);
        let mut off = 0;
        while off < QUOTE {
            let n = if QUOTE - off < CHUNK {
                QUOTE - off
            } else {
                CHUNK
            };
            let part = bpf_csum_diff(core::ptr::null_mut(), 0, quote.add(off).cast(), n as u32, 0);
            if part < 0 {
                return xdp_action::XDP_DROP;
            }
            sum += part as u64 & 0xffff_ffff;
            off += CHUNK;
        }
        icmp.add(2)
            .cast::<u16>()
            .write_unaligned(apply(0xffff, sum));
    }
    global(|s| s.icmp_too_big += 1);
    xdp_action::XDP_TX
}

/// Whether the frame, parsed as IPv6 whose next header is not TCP or UDP,
/// is ICMPv6.
#[inline(always)]
pub fn is_icmp6(ctx: &XdpContext) -> bool {
    let (data, end) = (ctx.data(), ctx.data_end());
    // SAFETY: bounds-checked first.
    data + ETH_LEN + IP6_LEN <= end
        && unsafe { *((data + ETH_LEN + 6) as *const u8) } == PROTO_ICMP6
}

/// The flow whose NAT entry (in the NAT table or a half-open slot) is
/// `nkey`, in place: IPv6 flows are too big to copy onto this stack.
#[inline(always)]
fn flow_of(cfg: &KernelConfig, nkey: &NatKey) -> Option<(*const FlowKey, Option<u32>)> {
    match nat_table(nkey.proto).get_ptr(nkey) {
        // SAFETY: map value pointers, valid for this run.
        Some(n) => Some((unsafe { core::ptr::addr_of!((*n).flow) }, None)),
        None => {
            let f = halfopen::find_nat(cfg, nkey)
                .map(|n| unsafe { core::ptr::addr_of!((*n).nat.flow) })?;
            // The SYN is the client's, in its own half-open slot.
            // SAFETY: as above.
            let isn = halfopen::find(cfg, unsafe { &*f }).map(|h| unsafe { (*h).syn.isn });
            Some((f, Some(isn.unwrap_or(0))))
        }
    }
}

/// An ICMPv6 packet to this host: an error about a source-NATed flow goes
/// to its client, translated; anything else to the kernel.
#[inline(never)]
pub fn inbound(ctx: &XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    // Outer IPv6, ICMPv6 header, the quoted IPv6 header and 8 bytes of
    // its L4 (ports, and UDP's checksum).
    if data + ETH_LEN + IP6_LEN + ICMP_LEN + IP6_LEN + 8 > end {
        return xdp_action::XDP_PASS;
    }
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    let Some(cfg) = CONFIG.get(0) else {
        return xdp_action::XDP_PASS;
    };
    let ip = (data + ETH_LEN) as *mut u8;
    // SAFETY: all reads and writes below lie in the bounds checked above
    // (the quoted TCP checksum is checked on its own); `sc` is this CPU's
    // element, used by this run only.
    unsafe {
        let sc = &mut *sc;
        let icmp = ip.add(IP6_LEN);
        let q = icmp.add(ICMP_LEN);
        let kind = *icmp;
        let proto = *q.add(6);
        if !(DEST_UNREACH..=PARAM_PROBLEM).contains(&kind)
            || *q >> 4 != 6
            || (proto != PROTO_TCP && proto != PROTO_UDP)
        {
            return xdp_action::XDP_PASS;
        }
        let snat = &*ip.add(24).cast::<[u8; 16]>();
        // The quoted packet is one the balancer sent: from the SNAT
        // address and a NAT port to a backend.
        if !V6::is_snat(snat) || *q.add(8).cast::<[u8; 16]>() != *snat {
            return xdp_action::XDP_PASS;
        }
        let l4 = q.add(IP6_LEN);
        sc.nkey = NatKey::new(
            *snat,
            *q.add(24).cast::<[u8; 16]>(),
            l4.add(2).cast::<u16>().read_unaligned(),
            l4.cast::<u16>().read_unaligned(),
            proto,
            FAMILY_V6,
        );
        let Some((flow, isn)) = flow_of(cfg, &sc.nkey) else {
            global(|s| s.pass_no_nat += 1);
            return xdp_action::XDP_PASS;
        };
        let seq = u32::from_be_bytes(*(l4.add(4) as *const [u8; 4]));
        let from_backend = *ip.add(8).cast::<[u8; 16]>() == sc.nkey.backend;
        if !super::plausible(&*flow, isn, proto, seq, from_backend) {
            global(|s| s.icmp_unproven += 1);
            return xdp_action::XDP_DROP;
        }
        if !super::gate::may_send() {
            return xdp_action::XDP_DROP;
        }
        let (client, vip) = (&(*flow).client, &(*flow).vip);
        // The quoted packet as the client sent it: client -> VIP.
        let addrs = diff128(&sc.nkey.local, client) + diff128(&sc.nkey.backend, vip);
        put(q.add(8).cast::<[u8; 16]>(), client);
        put(q.add(24).cast::<[u8; 16]>(), vip);
        let mut icmp_diff = addrs + quoted_transport(ctx, l4, proto, &*flow, addrs);
        // The outer header, which the ICMPv6 checksum covers: to the
        // client; from the VIP if the backend itself complains (the client
        // never heard of it), else from the router that did.
        let from_backend = *ip.add(8).cast::<[u8; 16]>() == sc.nkey.backend;
        icmp_diff += diff128(&sc.nkey.local, client);
        if from_backend {
            icmp_diff += diff128(&sc.nkey.backend, vip);
            put(ip.add(8).cast::<[u8; 16]>(), vip);
        }
        put(ip.add(24).cast::<[u8; 16]>(), client);
        let icmp_check = icmp.add(2).cast::<u16>();
        icmp_check.write_unaligned(apply(icmp_check.read_unaligned(), icmp_diff));
        let len = u16::from_be_bytes(*ip.add(4).cast::<[u8; 2]>()) + IP6_LEN as u16;
        global(|s| s.icmp_translated += 1);
        let next = route::<V6>(
            ctx,
            data as *mut _,
            &*ip.add(8).cast::<[u8; 16]>(),
            client,
            PROTO_ICMP6,
            len,
            None,
            cfg.hop_generation,
            false,
        );
        out_or_pass(ctx, next)
    }
}
