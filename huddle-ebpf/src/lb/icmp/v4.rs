//! ICMP the balancer answers or translates, so path MTU discovery works
//! through it. A packet that no longer fits once wrapped for IP-in-IP, with
//! DF set, gets "fragmentation needed" back from the VIP, naming the MTU
//! that leaves room for the outer header (as a router would). An ICMP
//! error from a backend, or a router on its path, about a source-NATed
//! flow is translated back to the flow's client instead of reaching the
//! balancer's own stack, which knows no such connection.

use crate::{
    csum::{apply, diff16, diff32, words},
    lb::forward::{out_or_pass, route},
    lb::halfopen,
    lb::maps::{global, CONFIG, SERVICES},
    lb::tables::nat_table,
    mem::put,
    net::family::V4,
};
use aya_ebpf::{
    bindings::xdp_action,
    helpers::generated::{bpf_xdp_adjust_head, bpf_xdp_adjust_tail},
    programs::XdpContext,
};
use huddle_common::headers::{ETH_LEN, ICMP_LEN, IP_LEN};
use huddle_common::{
    addr_v4, FlowKey, KernelConfig, NatKey, ServiceKey, FAMILY_V4, PROTO_TCP, PROTO_UDP,
    SERVICE_KIND_SNAT,
};

/// What an ICMP error quotes of the packet it is about: its IP header and
/// the first 8 bytes after it (RFC 792).
const QUOTE: usize = IP_LEN + 8;
const PROTO_ICMP: u8 = 1;
const DEST_UNREACH: u8 = 3;
const FRAG_NEEDED: u8 = 4;
const TIME_EXCEEDED: u8 = 11;

/// Turns the client's packet in the frame (Ethernet, a 20-byte IPv4
/// header) into an ICMP "fragmentation needed" with next-hop MTU `mtu`,
/// from the packet's destination to its source, and sends it back the way
/// it came: `macs` are the frame's Ethernet addresses as it arrived
/// (destination, source), swapped.
#[inline(never)]
pub fn too_big(ctx: &XdpContext, mtu: u16, macs: &[u8; 12]) -> u32 {
    if !super::gate::may_send() {
        return xdp_action::XDP_DROP;
    }
    // Room in front for the new IP and ICMP headers; the quote is what
    // follows of the original packet, cut after its first 8 L4 bytes.
    // SAFETY: plain helper calls; pointers are derived afresh after them.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx.cast(), -((IP_LEN + ICMP_LEN) as i32)) } != 0 {
        return xdp_action::XDP_DROP;
    }
    let want = (ETH_LEN + IP_LEN + ICMP_LEN + QUOTE) as i32;
    let have = (ctx.data_end() - ctx.data()) as i32;
    if have > want && unsafe { bpf_xdp_adjust_tail(ctx.ctx.cast(), want - have) } != 0 {
        return xdp_action::XDP_DROP;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + ETH_LEN + IP_LEN + ICMP_LEN + QUOTE > end {
        return xdp_action::XDP_DROP;
    }
    let quote = (data + ETH_LEN + IP_LEN + ICMP_LEN) as *const [u8; QUOTE];
    // SAFETY: every range below lies in the bounds checked just above.
    unsafe {
        let q = &*quote;
        let (client, vip) = ([q[12], q[13], q[14], q[15]], [q[16], q[17], q[18], q[19]]);
        // Back to whoever sent it: its source MAC becomes the destination.
        bounce(data, macs, [0x08, 0x00]);
        let len = ((IP_LEN + ICMP_LEN + QUOTE) as u16).to_be_bytes();
        let iph: [u8; IP_LEN] = [
            0x45, 0, len[0], len[1], 0, 0, 0, 0, 64, PROTO_ICMP, 0, 0, vip[0], vip[1], vip[2],
            vip[3], client[0], client[1], client[2], client[3],
        ];
        let ip = (data + ETH_LEN) as *mut u8;
        put(ip.cast::<[u8; IP_LEN]>(), &iph);
        ip.add(10)
            .cast::<u16>()
            .write_unaligned(apply(0xffff, words(&iph)));
        let m = mtu.to_be_bytes();
        let icmph: [u8; ICMP_LEN] = [DEST_UNREACH, FRAG_NEEDED, 0, 0, 0, 0, m[0], m[1]];
        let icmp = ip.add(IP_LEN);
        put(icmp.cast::<[u8; ICMP_LEN]>(), &icmph);
        let sum = words(&icmph) + words(q);
        icmp.add(2)
            .cast::<u16>()
            .write_unaligned(apply(0xffff, sum));
    }
    global(|s| s.icmp_too_big += 1);
    xdp_action::XDP_TX
}

/// An ICMP packet (IPv4, 20-byte header) to this host: an error about a
/// source-NATed flow goes to its client, translated; anything else to the
/// kernel.
#[inline(never)]
pub fn inbound(ctx: &XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    // Outer IP, ICMP header, quoted IP header and 8 bytes of its L4.
    if data + ETH_LEN + IP_LEN + ICMP_LEN + QUOTE > end {
        return xdp_action::XDP_PASS;
    }
    let ip = (data + ETH_LEN) as *mut u8;
    // SAFETY: all reads and writes below lie in the bounds checked above
    // (the quoted L4 checksum of TCP is checked on its own).
    unsafe {
        let icmp = ip.add(IP_LEN);
        let q = icmp.add(ICMP_LEN);
        let kind = *icmp;
        if (kind != DEST_UNREACH && kind != TIME_EXCEEDED)
            || *ip != 0x45
            || *q != 0x45
            || (*q.add(9) != PROTO_TCP && *q.add(9) != PROTO_UDP)
        {
            return xdp_action::XDP_PASS;
        }
        let proto = *q.add(9);
        let snat = *(ip.add(16) as *const [u8; 4]);
        let key = ServiceKey {
            addr: snat,
            port_be: 0,
            proto: 0,
            kind: SERVICE_KIND_SNAT,
        };
        if SERVICES.get(&key).is_none() {
            return xdp_action::XDP_PASS;
        }
        // The quoted packet is one the balancer sent: from the SNAT
        // address and a NAT port to a backend.
        let q_src = *(q.add(12) as *const [u8; 4]);
        let q_dst = *(q.add(16) as *const [u8; 4]);
        let l4 = q.add(IP_LEN);
        let q_sport = l4.cast::<u16>().read_unaligned();
        let q_dport = l4.add(2).cast::<u16>().read_unaligned();
        if q_src != snat {
            return xdp_action::XDP_PASS;
        }
        let Some(cfg) = CONFIG.get(0) else {
            return xdp_action::XDP_PASS;
        };
        let nkey = NatKey::new(
            addr_v4(snat),
            addr_v4(q_dst),
            q_dport,
            q_sport,
            proto,
            FAMILY_V4,
        );
        let Some((flow, isn)) = flow_of(cfg, &nkey) else {
            global(|s| s.pass_no_nat += 1);
            return xdp_action::XDP_PASS;
        };
        let seq = u32::from_be_bytes(*(l4.add(4) as *const [u8; 4]));
        let from = *(ip.add(12) as *const [u8; 4]);
        if !super::plausible(&flow, isn, proto, seq, from == q_dst) {
            global(|s| s.icmp_unproven += 1);
            return xdp_action::XDP_DROP;
        }
        if !super::gate::may_send() {
            return xdp_action::XDP_DROP;
        }
        let client = [
            flow.client[0],
            flow.client[1],
            flow.client[2],
            flow.client[3],
        ];
        let vip = [flow.vip[0], flow.vip[1], flow.vip[2], flow.vip[3]];
        translate_quote(ctx, icmp, q, proto, &flow, (client, vip));
        let from = translate_outer(ip, q_dst, (client, vip));
        let tot_len = u16::from_be_bytes(*(ip.add(2) as *const [u8; 2]));
        global(|s| s.icmp_translated += 1);
        let next = route::<V4>(
            ctx,
            data as *mut _,
            &from,
            &client,
            PROTO_ICMP,
            tot_len,
            None,
            cfg.hop_generation,
            false,
        );
        out_or_pass(ctx, next)
    }
}

/// The flow whose NAT entry (in the NAT table or a half-open slot) is
/// `nkey`, and for a half-open one the client's initial sequence number.
#[inline(always)]
fn flow_of(cfg: &KernelConfig, nkey: &NatKey) -> Option<(FlowKey, Option<u32>)> {
    // SAFETY: map value pointers, copied out at once.
    match unsafe { nat_table(nkey.proto).get(nkey) } {
        Some(n) => Some((n.flow, None)),
        None => {
            let flow = halfopen::find_nat(cfg, nkey).map(|n| unsafe { (*n).nat.flow })?;
            // The SYN is the client's, in its own half-open slot.
            let isn = halfopen::find(cfg, &flow).map(|h| unsafe { (*h).syn.isn });
            Some((flow, Some(isn.unwrap_or(0))))
        }
    }
}

/// Rewrites the quoted packet at `q` as the client sent it (client ->
/// VIP), its checksums and the ICMP checksum with it.
///
/// # Safety
/// `icmp`, `q` and the quoted IP header and 8 bytes of its L4 lie inside
/// the packet.
#[inline(always)]
unsafe fn translate_quote(
    ctx: &XdpContext,
    icmp: *mut u8,
    q: *mut u8,
    proto: u8,
    flow: &FlowKey,
    (client, vip): ([u8; 4], [u8; 4]),
) {
    // SAFETY: the caller vouches for the bounds.
    unsafe {
        let n32 = u32::from_ne_bytes;
        let q_src = *(q.add(12) as *const [u8; 4]);
        let q_dst = *(q.add(16) as *const [u8; 4]);
        let addrs = diff32(n32(q_src), n32(client)) + diff32(n32(q_dst), n32(vip));
        put(q.add(12) as *mut [u8; 4], &client);
        put(q.add(16) as *mut [u8; 4], &vip);
        let q_check = q.add(10).cast::<u16>();
        let old_q_check = q_check.read_unaligned();
        let new_q_check = apply(old_q_check, addrs);
        q_check.write_unaligned(new_q_check);
        let icmp_diff = addrs
            + diff16(old_q_check, new_q_check)
            + quoted_transport(ctx, q.add(IP_LEN), proto, flow, addrs);
        let icmp_check = icmp.add(2).cast::<u16>();
        icmp_check.write_unaligned(apply(icmp_check.read_unaligned(), icmp_diff));
    }
}

/// Rewrites the outer header to the client: from the VIP if the backend
/// (`q_dst`) itself complains (the client never heard of it), else from
/// the router that did. Returns the new source.
///
/// # Safety
/// The 20-byte IP header at `ip` lies inside the packet.
#[inline(always)]
unsafe fn translate_outer(
    ip: *mut u8,
    q_dst: [u8; 4],
    (client, vip): ([u8; 4], [u8; 4]),
) -> [u8; 4] {
    // SAFETY: the caller vouches for the bounds.
    unsafe {
        let n32 = u32::from_ne_bytes;
        let o_src = *(ip.add(12) as *const [u8; 4]);
        let snat = *(ip.add(16) as *const [u8; 4]);
        let from = if o_src == q_dst { vip } else { o_src };
        let outer = diff32(n32(o_src), n32(from)) + diff32(n32(snat), n32(client));
        put(ip.add(12) as *mut [u8; 4], &from);
        put(ip.add(16) as *mut [u8; 4], &client);
        let o_check = ip.add(10).cast::<u16>();
        o_check.write_unaligned(apply(o_check.read_unaligned(), outer));
        from
    }
}

/// Gives the quoted transport header at `l4` (at least its 8 first bytes
/// in the packet) the client's ports of `flow` and updates its checksum,
/// when quoted (UDP's always is), by those and `addrs` (the quoted
/// addresses' change). Returns the change to add to the ICMP checksum
/// beyond `addrs`.
///
/// # Safety
/// `l4` must point into the packet with 8 bytes after it in bounds.
#[inline(always)]
pub unsafe fn quoted_transport(
    ctx: &XdpContext,
    l4: *mut u8,
    proto: u8,
    flow: &FlowKey,
    addrs: u64,
) -> u64 {
    // SAFETY: the caller's bounds; the checksum's own are checked.
    unsafe {
        let q_sport = l4.cast::<u16>().read_unaligned();
        let q_dport = l4.add(2).cast::<u16>().read_unaligned();
        let ports = diff16(q_sport, flow.client_port_be) + diff16(q_dport, flow.vip_port_be);
        l4.cast::<u16>().write_unaligned(flow.client_port_be);
        l4.add(2).cast::<u16>().write_unaligned(flow.vip_port_be);
        let mut diff = ports;
        let l4_check = if proto == PROTO_UDP {
            l4.add(6)
        } else {
            l4.add(16)
        };
        if (l4_check as usize) + 2 <= ctx.data_end() {
            let c = l4_check.cast::<u16>();
            let old = c.read_unaligned();
            if !(proto == PROTO_UDP && old == 0) {
                let new = apply(old, addrs + ports);
                c.write_unaligned(new);
                diff += diff16(old, new);
            }
        }
        diff
    }
}

/// Addresses an answer back to where the frame at `data` came from:
/// `macs` are its Ethernet addresses as it arrived (destination, source),
/// swapped; `ethertype` the answer's.
///
/// # Safety
/// `data` must be the frame's start, 14 bytes in bounds.
#[inline(always)]
pub unsafe fn bounce(data: usize, macs: &[u8; 12], ethertype: [u8; 2]) {
    // `put` is safe to call; the caller vouches for the 14 bytes.
    put(
        data as *mut [u8; 6],
        &[macs[6], macs[7], macs[8], macs[9], macs[10], macs[11]],
    );
    put(
        (data + 6) as *mut [u8; 6],
        &[macs[0], macs[1], macs[2], macs[3], macs[4], macs[5]],
    );
    put((data + 12) as *mut [u8; 2], &ethertype);
}
