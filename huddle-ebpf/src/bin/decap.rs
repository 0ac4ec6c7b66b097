//! The backend agent's programs (`huddle agent --decap`). On ingress (XDP)
//! it unwraps the balancer's IP-in-IP packets and hands the inner packet,
//! the client's own, to the stack, with no tunnel device or kernel module
//! (only packets to one of this host's addresses, from a balancer's outer
//! source and to a VIP inside; other IP-in-IP to this host is dropped,
//! everything else passes untouched), and notes when a request to a DSR VIP arrives; on egress
//! (TC) it sees the answer's first byte leave: the backend's exact time
//! to first byte, per VIP (IPv4 or IPv6), which the balancer cannot see
//! in DSR.
#![no_std]
#![no_main]
// Map keys by reference on purpose: a 40-byte key passed by value is
// copied onto the 512-byte stack.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    bindings::{xdp_action, BPF_EXIST, BPF_F_NO_PREALLOC, BPF_NOEXIST, TC_ACT_OK},
    helpers::{bpf_ktime_get_ns, generated::bpf_xdp_adjust_head},
    macros::{classifier, map, xdp},
    maps::{lpm_trie::Key, HashMap, LpmTrie, LruHashMap, PerCpuArray},
    programs::{TcContext, XdpContext},
};
use huddle_common::headers::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, IP6_LEN, IP_LEN};
use huddle_common::{
    addr_v4,
    decap::{MAX_ALLOW, MAX_LOCAL, MAX_TURNS, MAX_VIPS},
    latency_bucket, Addr, AgentTtfb, DecapStats, TurnKey, LATENCY_BUCKETS,
};

const PROTO_IPIP: u8 = 4;
const PROTO_IPV6: u8 = 41;

/// This host's addresses (written by the agent).
#[map]
static DECAP_LOCAL: HashMap<Addr, u32> = HashMap::with_max_entries(MAX_LOCAL, 0);

/// Outer sources whose packets are unwrapped (written by the agent).
#[map]
static DECAP_ALLOW4: LpmTrie<[u8; 4], u32> =
    LpmTrie::with_max_entries(MAX_ALLOW, BPF_F_NO_PREALLOC);
#[map]
static DECAP_ALLOW6: LpmTrie<[u8; 16], u32> =
    LpmTrie::with_max_entries(MAX_ALLOW, BPF_F_NO_PREALLOC);

/// Inner destinations a wrapped packet may have (written by the agent).
#[map]
static DECAP_INNER: HashMap<Addr, u32> = HashMap::with_max_entries(MAX_LOCAL, 0);

#[map]
static DECAP_STATS: PerCpuArray<DecapStats> = PerCpuArray::with_max_entries(1, 0);

/// VIP -> its index in `AGENT_TTFB` (written by the agent).
#[map]
static AGENT_VIPS: HashMap<Addr, u32> = HashMap::with_max_entries(MAX_VIPS, 0);

/// Connection -> when its pending request arrived.
#[map]
static AGENT_TURNS: LruHashMap<TurnKey, u64> = LruHashMap::with_max_entries(MAX_TURNS, 0);

/// VIP index -> this CPU's time-to-first-byte samples.
#[map]
static AGENT_TTFB: PerCpuArray<AgentTtfb> = PerCpuArray::with_max_entries(MAX_VIPS, 0);

const PROTO_TCP: u8 = 6;
/// TCP flag: the last segment of a write.
const TCP_PSH: u8 = 0x08;

#[inline(always)]
fn count(f: impl FnOnce(&mut DecapStats)) {
    if let Some(s) = DECAP_STATS.get_ptr_mut(0) {
        // SAFETY: this CPU's element; the program is not re-entered on it.
        f(unsafe { &mut *s });
    }
}

#[xdp]
pub fn decap(ctx: XdpContext) -> u32 {
    let verdict = unwrap(&ctx);
    if verdict == xdp_action::XDP_PASS {
        arrived(&ctx);
    }
    verdict
}

/// A TCP segment with request data to a VIP (the frame as the stack will
/// see it): the connection's pending request starts now, or, if one is
/// pending and the segment ends a client write (PSH), its wait restarts.
#[inline(always)]
fn arrived(ctx: &XdpContext) {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + ETH_LEN > end {
        return;
    }
    // SAFETY: bounds-checked just above.
    let ethertype = unsafe { *((data + 12) as *const [u8; 2]) };
    let key = if ethertype == ETH_P_IPV6 {
        if data + ETH_LEN + IP6_LEN + 20 > end {
            return;
        }
        // SAFETY: the 74 bytes read were bounds-checked just above.
        let (ip, tcp) = unsafe {
            (
                &*((data + ETH_LEN) as *const [u8; IP6_LEN]),
                &*((data + ETH_LEN + IP6_LEN) as *const [u8; 20]),
            )
        };
        (request_key6(ip, tcp, false), tcp[13] & TCP_PSH != 0)
    } else {
        if data + ETH_LEN + IP_LEN + 20 > end {
            return;
        }
        // SAFETY: the 54 bytes read were bounds-checked just above.
        let (ip, tcp) = unsafe {
            (
                &*((data + ETH_LEN) as *const [u8; IP_LEN]),
                &*((data + ETH_LEN + IP_LEN) as *const [u8; 20]),
            )
        };
        (
            request_key(ethertype, ip, tcp, false),
            tcp[13] & TCP_PSH != 0,
        )
    };
    let (Some(key), psh) = key else {
        return;
    };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if AGENT_TURNS
        .insert(&key, now, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        count(|s| s.turns += 1);
    } else if psh {
        // The end of a client write in a pending request: its wait
        // restarts, so the backend is timed from the request's last
        // write, not the client's upload (as the balancer does).
        let _ = AGENT_TURNS.insert(&key, now, u64::from(BPF_EXIST));
    }
}

/// The connection key of a TCP segment carrying data (IPv4, 20-byte
/// header) to a VIP (`outbound`: from a VIP, keyed as its client sends).
#[inline(always)]
fn request_key(
    ethertype: [u8; 2],
    ip: &[u8; IP_LEN],
    tcp: &[u8; 20],
    outbound: bool,
) -> Option<TurnKey> {
    if ethertype != ETH_P_IP || ip[0] != 0x45 || ip[9] != PROTO_TCP {
        return None;
    }
    let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let doff = usize::from(tcp[12] >> 4) * 4;
    if tot <= IP_LEN + doff {
        return None;
    }
    turn_key(
        addr_v4([ip[12], ip[13], ip[14], ip[15]]),
        addr_v4([ip[16], ip[17], ip[18], ip[19]]),
        tcp,
        outbound,
    )
}

/// The same for IPv6 without extension headers.
#[inline(always)]
fn request_key6(ip: &[u8; IP6_LEN], tcp: &[u8; 20], outbound: bool) -> Option<TurnKey> {
    if ip[0] >> 4 != 6 || ip[6] != PROTO_TCP {
        return None;
    }
    let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    if payload <= usize::from(tcp[12] >> 4) * 4 {
        return None;
    }
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&ip[8..24]);
    dst.copy_from_slice(&ip[24..40]);
    turn_key(src, dst, tcp, outbound)
}

/// The key of a segment from `src` to `dst`, if the VIP side is timed.
#[inline(always)]
fn turn_key(src: Addr, dst: Addr, tcp: &[u8; 20], outbound: bool) -> Option<TurnKey> {
    let (sport, dport) = (
        u16::from_ne_bytes([tcp[0], tcp[1]]),
        u16::from_ne_bytes([tcp[2], tcp[3]]),
    );
    let (client, vip, client_port_be, vip_port_be) = if outbound {
        (dst, src, dport, sport)
    } else {
        (src, dst, sport, dport)
    };
    // SAFETY: only tested for presence.
    unsafe { AGENT_VIPS.get(&vip) }?;
    Some(TurnKey {
        client,
        vip,
        client_port_be,
        vip_port_be,
        _pad: 0,
    })
}

/// Egress: the first answer byte of a pending request leaves: one sample
/// for its VIP.
#[classifier]
pub fn ttfb_out(ctx: TcContext) -> i32 {
    answered(&ctx);
    TC_ACT_OK
}

#[inline(always)]
fn answered(ctx: &TcContext) {
    let Ok(ethertype) = ctx.load::<[u8; 2]>(12) else {
        return;
    };
    let key = if ethertype == ETH_P_IPV6 {
        let (Ok(ip), Ok(tcp)) = (
            ctx.load::<[u8; IP6_LEN]>(ETH_LEN),
            ctx.load::<[u8; 20]>(ETH_LEN + IP6_LEN),
        ) else {
            return;
        };
        request_key6(&ip, &tcp, true)
    } else {
        let (Ok(ip), Ok(tcp)) = (
            ctx.load::<[u8; IP_LEN]>(ETH_LEN),
            ctx.load::<[u8; 20]>(ETH_LEN + IP_LEN),
        ) else {
            return;
        };
        request_key(ethertype, &ip, &tcp, true)
    };
    let Some(key) = key else {
        return;
    };
    // SAFETY: copied out at once.
    let Some(start) = (unsafe { AGENT_TURNS.get(&key) }).copied() else {
        return;
    };
    let _ = AGENT_TURNS.remove(&key);
    // SAFETY: as above.
    let Some(idx) = (unsafe { AGENT_VIPS.get(&key.vip) }).copied() else {
        return;
    };
    // SAFETY: plain helper call.
    let waited = unsafe { bpf_ktime_get_ns() }.wrapping_sub(start);
    let b = latency_bucket(waited);
    if let Some(t) = AGENT_TTFB.get_ptr_mut(idx) {
        // SAFETY: this CPU's element.
        unsafe {
            (*t).sum_ns += waited;
            (*t).count += 1;
            if b < LATENCY_BUCKETS {
                (*t).hist.buckets[b] += 1;
            }
        }
    }
    count(|s| s.answered += 1);
}

/// Unwraps an IPv6-in-IPv6 packet to this host; the verdict.
#[inline(always)]
fn unwrap6(ctx: &XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    // Ethernet and both IPv6 headers.
    if data + ETH_LEN + IP6_LEN + IP6_LEN > end {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: bounds-checked just above.
    let (outer, inner) = unsafe {
        (
            &*((data + ETH_LEN) as *const [u8; IP6_LEN]),
            &*((data + ETH_LEN + IP6_LEN) as *const [u8; IP6_LEN]),
        )
    };
    if outer[6] != PROTO_IPV6 {
        return xdp_action::XDP_PASS;
    }
    if outer[0] >> 4 != 6 || inner[0] >> 4 != 6 {
        count(|s| s.pass_malformed += 1);
        return xdp_action::XDP_PASS;
    }
    let mut dst = [0u8; 16];
    dst.copy_from_slice(&outer[24..40]);
    let mut src = [0u8; 16];
    src.copy_from_slice(&outer[8..24]);
    let mut to = [0u8; 16];
    to.copy_from_slice(&inner[24..40]);
    if !local(&dst) {
        return xdp_action::XDP_PASS;
    }
    if DECAP_ALLOW6.get(&Key::new(128, src)).is_none() {
        count(|s| s.drop_foreign_source += 1);
        return xdp_action::XDP_DROP;
    }
    if !vip(&to) {
        return xdp_action::XDP_DROP;
    }
    strip::<IP6_LEN>(ctx)
}

/// Whether `dst` is this host's: only then is the packet ours to unwrap.
#[inline(always)]
fn local(dst: &Addr) -> bool {
    // SAFETY: only tested for presence.
    let mine = unsafe { DECAP_LOCAL.get(dst) }.is_some();
    if !mine {
        count(|s| s.pass_not_local += 1);
    }
    mine
}

/// Whether the inner packet goes to a VIP this backend serves (counted
/// when not).
#[inline(always)]
fn vip(to: &Addr) -> bool {
    // SAFETY: only tested for presence.
    let ok = unsafe { DECAP_INNER.get(to) }.is_some();
    if !ok {
        count(|s| s.drop_not_vip += 1);
    }
    ok
}

/// Unwraps an IP-in-IP packet to this host; the verdict.
#[inline(always)]
fn unwrap(ctx: &XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + 14 <= end {
        // SAFETY: bounds-checked just now.
        if unsafe { *((data + 12) as *const [u8; 2]) } == ETH_P_IPV6 {
            return unwrap6(ctx);
        }
    }
    // Ethernet, outer IPv4 and the inner IPv4 header's fixed part.
    if data + ETH_LEN + IP_LEN + IP_LEN > end {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: the 54 bytes read below were bounds-checked just above.
    let (ethertype, outer, inner) = unsafe {
        (
            *((data + 12) as *const [u8; 2]),
            *((data + ETH_LEN) as *const [u8; IP_LEN]),
            *((data + ETH_LEN + IP_LEN) as *const [u8; IP_LEN]),
        )
    };
    let inner_vihl = inner[0];
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
    if !local(&addr_v4([outer[16], outer[17], outer[18], outer[19]])) {
        return xdp_action::XDP_PASS;
    }
    let src = [outer[12], outer[13], outer[14], outer[15]];
    if DECAP_ALLOW4.get(&Key::new(32, src)).is_none() {
        count(|s| s.drop_foreign_source += 1);
        return xdp_action::XDP_DROP;
    }
    if !vip(&addr_v4([inner[16], inner[17], inner[18], inner[19]])) {
        return xdp_action::XDP_DROP;
    }
    strip::<IP_LEN>(ctx)
}

/// Removes the `OUTER` bytes of outer header: the Ethernet header moves up
/// over it (the two do not overlap, `OUTER` being 20 or 40), then the
/// frame starts there.
#[inline(always)]
fn strip<const OUTER: usize>(ctx: &XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + OUTER + ETH_LEN > end {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: both 14-byte ranges were bounds-checked just above.
    unsafe {
        core::ptr::copy_nonoverlapping(
            data as *const [u8; ETH_LEN],
            (data + OUTER) as *mut [u8; ETH_LEN],
            1,
        );
        if bpf_xdp_adjust_head(ctx.ctx.cast(), OUTER as i32) != 0 {
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
