//! The packets-per-second measurement of `huddle bench`: a generator run
//! with BPF_PROG_TEST_RUN in live-frames mode and a counting sink, or,
//! where the kernel refuses live frames, a counting reflector that sends
//! each frame back as a new one.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_redirect, generated::bpf_xdp_adjust_head},
    macros::{map, xdp},
    maps::{Array, LruHashMap, PerCpuArray},
    programs::XdpContext,
};
use huddle_common::{
    addr_v4, FlowKey, FlowValue, GenConfig, GenNat, DEFAULT_FLOW_TABLE_SIZE, FAMILY_V4, GEN_FRAME,
};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, tcp::TcpHdr};

/// The balancer's checksum arithmetic (only `apply` and `words` are used
/// here).
#[allow(dead_code)]
#[path = "../csum.rs"]
mod csum;
use csum::{apply, words};

/// The frame `gen` writes on every run (user space fills it in).
#[map]
static GEN_TEMPLATE: Array<[u8; GEN_FRAME]> = Array::with_max_entries(1, 0);

#[map]
static GEN_CONFIG: Array<GenConfig> = Array::with_max_entries(1, 0);

/// Per CPU: frames generated (index 0) and frames the sink took (1).
#[map]
static GEN_COUNT: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// Writes the template over the frame at `start` (which holds
/// `GEN_FRAME` bytes) and gives it the next of the configured client
/// ports, counted in `n`.
///
/// # Safety
/// The `GEN_FRAME` bytes from `start` are the packet's; `n` is this CPU's.
#[inline(always)]
unsafe fn write_template(start: usize, tpl: &[u8; GEN_FRAME], cfg: &GenConfig, n: *mut u64) {
    // SAFETY: as the caller promises.
    unsafe {
        core::ptr::copy_nonoverlapping(tpl.as_ptr(), start as *mut u8, GEN_FRAME);
        let flow = (*n % u64::from(cfg.flows.max(1))) as u16;
        *n += 1;
        let port = cfg.base_port.wrapping_add(flow).to_be_bytes();
        let sport = (start + EthHdr::LEN + Ipv4Hdr::LEN) as *mut [u8; 2];
        *sport = port;
    }
}

/// Run with BPF_PROG_TEST_RUN in live-frames mode: writes the template
/// into the frame (the kernel reuses pages without copying the template
/// again, and the program under test rewrites them), gives it the next
/// client port, and redirects it to the configured interface.
#[xdp]
pub fn gen(ctx: XdpContext) -> u32 {
    let (Some(cfg), Some(tpl)) = (GEN_CONFIG.get(0), GEN_TEMPLATE.get(0)) else {
        return xdp_action::XDP_ABORTED;
    };
    let start = ctx.data();
    if start + GEN_FRAME > ctx.data_end() {
        return xdp_action::XDP_ABORTED;
    }
    let Some(n) = GEN_COUNT.get_ptr_mut(0) else {
        return xdp_action::XDP_ABORTED;
    };
    // SAFETY: the frame holds GEN_FRAME bytes (checked); the counter is
    // this CPU's.
    unsafe {
        write_template(start, tpl, cfg, n);
        bpf_redirect(cfg.ifindex, 0) as u32
    }
}

/// The generator where the kernel refuses live frames, on the peer of the
/// interface under test: counts what the program under test sent (as
/// `sink`), writes the template over it (taking back the 20 bytes an
/// IP-in-IP path put in front) and sends it back, so that the few hundred
/// frames user space sent once circulate between the two ends, each pass
/// one packet through the program under test, until `stop` is set.
#[xdp]
pub fn bounce(ctx: XdpContext) -> u32 {
    let (Some(cfg), Some(tpl)) = (GEN_CONFIG.get(0), GEN_TEMPLATE.get(0)) else {
        return xdp_action::XDP_ABORTED;
    };
    let (Some(made), Some(took)) = (GEN_COUNT.get_ptr_mut(0), GEN_COUNT.get_ptr_mut(1)) else {
        return xdp_action::XDP_ABORTED;
    };
    // SAFETY: this CPU's counter.
    unsafe { *took += 1 };
    if cfg.stop != 0 {
        return xdp_action::XDP_DROP;
    }
    let extra = ctx.data_end().saturating_sub(ctx.data() + GEN_FRAME);
    if extra > 0 {
        if extra > 64 {
            return xdp_action::XDP_DROP;
        }
        // SAFETY: plain helper call; the pointers are derived afresh below.
        if unsafe { bpf_xdp_adjust_head(ctx.ctx.cast(), extra as i32) } != 0 {
            return xdp_action::XDP_DROP;
        }
    }
    let start = ctx.data();
    if start + GEN_FRAME > ctx.data_end() {
        return xdp_action::XDP_DROP;
    }
    // SAFETY: the frame holds GEN_FRAME bytes (checked); the counter is
    // this CPU's.
    unsafe { write_template(start, tpl, cfg, made) };
    xdp_action::XDP_TX
}

/// The generator's flows, for `lookup_tx`: the balancer's flow-table type,
/// key, value and size.
#[map]
static GEN_FLOWS: LruHashMap<FlowKey, FlowValue> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// The minimal forwarder plus one lookup in a table like the balancer's
/// flow table (its key, value and size). Timed next to the balancer, it
/// shows how much of the forwarder's packet rate that lookup alone
/// leaves on this veth pair (a 16-byte key costs less: see the README).
#[xdp]
pub fn lookup_tx(ctx: XdpContext) -> u32 {
    let start = ctx.data();
    if start + EthHdr::LEN + Ipv4Hdr::LEN + TcpHdr::LEN > ctx.data_end() {
        return xdp_action::XDP_PASS;
    }
    let eth = start as *mut EthHdr;
    // SAFETY: bounds checked above.
    unsafe {
        let ip = (start + EthHdr::LEN) as *const Ipv4Hdr;
        if u16::from_be((*eth).ether_type) != 0x0800 || (*ip).proto != 6 {
            return xdp_action::XDP_PASS;
        }
        let tcp = (start + EthHdr::LEN + Ipv4Hdr::LEN) as *const TcpHdr;
        let key = FlowKey::new(
            &addr_v4((*ip).src_addr),
            &addr_v4((*ip).dst_addr),
            u16::from_ne_bytes((*tcp).source),
            u16::from_ne_bytes((*tcp).dest),
            6,
            FAMILY_V4,
        );
        if GEN_FLOWS.get(key).is_none() {
            return xdp_action::XDP_PASS;
        }
        core::mem::swap(&mut (*eth).dst_addr, &mut (*eth).src_addr);
    }
    xdp_action::XDP_TX
}

/// The bare NAT forwarder's flows (see `nat_tx`).
#[map]
static GEN_NAT: LruHashMap<[u64; 2], GenNat> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);

/// The bare forwarders' entry for the frame at `start`, whose Ethernet,
/// IPv4 and TCP headers the caller checked lie in the packet; `None` for
/// anything but IPv4 (no options) and TCP, or a flow the table lacks.
///
/// # Safety
/// As said: the 54 bytes from `start` are the packet's.
#[inline(always)]
unsafe fn nat_entry(start: usize) -> Option<&'static GenNat> {
    // SAFETY: as the caller promises.
    unsafe {
        let eth = start as *const u8;
        let ip = eth.add(EthHdr::LEN);
        let l4 = ip.add(Ipv4Hdr::LEN);
        if *eth.add(12).cast::<[u8; 2]>() != [8, 0] || *ip != 0x45 || *ip.add(9) != 6 {
            return None;
        }
        let key = [
            ip.add(12).cast::<u64>().read_unaligned(),
            u64::from(l4.cast::<u32>().read_unaligned()),
        ];
        GEN_NAT.get(key)
    }
}

/// A bare NAT forwarder: no more than any balancer that rewrites a flow
/// must do. One lookup with the narrowest key (addresses and ports, 16
/// bytes), then the new addresses, ports, checksums and MACs from the
/// entry, worked out beforehand, and XDP_TX. Timed next to the balancer,
/// it is the ceiling a source-NAT balancer reaches on this veth pair.
#[xdp]
pub fn nat_tx(ctx: XdpContext) -> u32 {
    let start = ctx.data();
    if start + EthHdr::LEN + Ipv4Hdr::LEN + TcpHdr::LEN > ctx.data_end() {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: bounds checked above; the object allows misaligned access,
    // which the verifier allows in packets.
    unsafe {
        let Some(n) = nat_entry(start) else {
            return xdp_action::XDP_PASS;
        };
        let eth = start as *mut u8;
        let ip = eth.add(EthHdr::LEN);
        let l4 = ip.add(Ipv4Hdr::LEN);
        ip.add(12).cast::<[u8; 8]>().write_unaligned(n.addrs);
        l4.cast::<[u8; 4]>().write_unaligned(n.ports);
        let check = ip.add(10).cast::<u16>();
        check.write_unaligned(apply(check.read_unaligned(), u64::from(n.ip_diff)));
        let check = l4.add(16).cast::<u16>();
        check.write_unaligned(apply(check.read_unaligned(), u64::from(n.l4_diff)));
        eth.cast::<[u8; 12]>().write_unaligned(n.macs);
    }
    xdp_action::XDP_TX
}

/// A bare IP-in-IP forwarder: no more than any balancer that
/// encapsulates a flow must do (Katran's path). The bare NAT forwarder's
/// lookup (its entry's addresses give the outer source and destination),
/// 20 bytes more at the front, the Ethernet header moved there with the
/// entry's MACs, an outer IPv4 header as the balancer's (the inner TOS,
/// IP id and DF, TTL 64) and its checksum, and XDP_TX. Timed
/// next to the balancer's IP-in-IP path, it is that path's ceiling on
/// this veth pair.
#[xdp]
pub fn ipip_tx(ctx: XdpContext) -> u32 {
    let start = ctx.data();
    if start + EthHdr::LEN + Ipv4Hdr::LEN + TcpHdr::LEN > ctx.data_end() {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: bounds checked above.
    // The entry, and the inner header's first eight bytes: its length,
    // and the TOS, IP id and DF the outer one copies (as the balancer's).
    let Some((n, inner)) =
        (unsafe { nat_entry(start).map(|n| (*n, *((start + EthHdr::LEN) as *const [u8; 8]))) })
    else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: plain helper call; the pointers are derived afresh below.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx.cast(), -(Ipv4Hdr::LEN as i32)) } != 0 {
        return xdp_action::XDP_DROP;
    }
    let start = ctx.data();
    if start + EthHdr::LEN + Ipv4Hdr::LEN > ctx.data_end() {
        return xdp_action::XDP_DROP;
    }
    let len = (u16::from_be_bytes([inner[2], inner[3]]) + Ipv4Hdr::LEN as u16).to_be_bytes();
    let a = n.addrs;
    let mut iph: [u8; 20] = [
        0x45,
        inner[1],
        len[0],
        len[1],
        inner[4],
        inner[5],
        inner[6] & 0x40,
        0,
        64,
        4,
        0,
        0,
        a[0],
        a[1],
        a[2],
        a[3],
        a[4],
        a[5],
        a[6],
        a[7],
    ];
    let check = apply(0xffff, words(&iph)).to_ne_bytes();
    iph[10..12].copy_from_slice(&check);
    // SAFETY: the new Ethernet and IP headers lie inside the packet
    // (checked just above).
    unsafe {
        let eth = start as *mut u8;
        eth.cast::<[u8; 12]>().write_unaligned(n.macs);
        eth.add(12).cast::<[u8; 2]>().write_unaligned([8, 0]);
        eth.add(EthHdr::LEN).cast::<[u8; 20]>().write_unaligned(iph);
    }
    xdp_action::XDP_TX
}

/// Counts and drops whatever arrives.
#[xdp]
pub fn sink(_ctx: XdpContext) -> u32 {
    if let Some(n) = GEN_COUNT.get_ptr_mut(1) {
        // SAFETY: this CPU's counter.
        unsafe { *n += 1 };
    }
    xdp_action::XDP_DROP
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
