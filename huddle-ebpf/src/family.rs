//! The address families: what differs between IPv4 and IPv6 packets
//! (address width, the service lookup, the rewrite, the next hop, DSR),
//! so the request and reply paths in `balance` are written once and built
//! once per family (no family test on the packet path).

use crate::{
    csum, dsr, icmp6,
    maps::put,
    maps::{SERVICES, SERVICES6, SERVICE_INDEX},
    parse::Packet,
    rewrite::{self, Tuple},
};
use aya_ebpf::{bindings::bpf_fib_lookup, programs::XdpContext};
use huddle_common::{
    addr_v4, service_slot, Addr, Backend, Config, ServiceKey, ServiceKey6, ServiceValue, FAMILY_V4,
    FAMILY_V6, PROTO_TCP, SERVICE_INDEX_BITS, SERVICE_KIND_SNAT, SERVICE_KIND_VIP,
};
use network_types::ip::{Ipv4Hdr, Ipv6Hdr};

pub trait Family: Sized {
    /// An address as the packet holds it.
    type Addr: Copy + PartialEq;
    /// The fixed IP header.
    type Hdr;
    /// `FAMILY_V4` or `FAMILY_V6`.
    const FAMILY: u8;
    /// Length of the fixed IP header.
    const IP_LEN: usize;
    /// The frame's EtherType.
    const ETHERTYPE: [u8; 2];
    /// Where TCP options start in a frame with this family's fixed header.
    const OPTS_AT: usize;
    /// Whether a refused SYN can be rebuilt toward another backend.
    const RETRY: bool;
    /// The 16-byte form of an address, as map keys hold it.
    fn wide(a: &Self::Addr) -> Addr;
    /// The packet form of a 16-byte address (its first bytes).
    fn narrow(a: &Addr) -> &Self::Addr;
    /// The service (VIP:port/proto) `p` is addressed to, if any.
    fn vip(p: &Packet<Self>, cfg: &Config) -> Option<ServiceValue>;
    /// Whether `p` is addressed to one of the balancer's SNAT addresses.
    fn to_snat(p: &Packet<Self>, cfg: &Config) -> bool;
    /// This family's SNAT addresses in `Config::snat_addrs`: first index
    /// and count.
    fn snat_range(cfg: &Config) -> (u32, u32);
    /// The addresses the IP header holds now (after a rewrite).
    fn addrs(p: &Packet<Self>) -> (&Self::Addr, &Self::Addr);
    /// Puts the addresses into a FIB request.
    fn fib_addrs(params: &mut bpf_fib_lookup, src: &Self::Addr, dst: &Self::Addr);
    /// Whether the FIB's answer names `dst` itself as the next hop (no
    /// gateway).
    fn fib_dst_is(params: &bpf_fib_lookup, dst: &Self::Addr) -> bool;
    /// Rewrites addresses and ports, keeping checksums valid.
    fn rewrite(p: &Packet<Self>, to: &Tuple<'_, Self::Addr>);
    /// Sends a client packet of a `dsr-ipip` flow to its backend inside
    /// an outer header of this family (see `dsr`).
    fn encap(ctx: &XdpContext, p: &Packet<Self>, cfg: &Config, id: u32, backend: &Backend) -> u32;
    /// Answers a packet `encap` found too big (`dsr::TOO_BIG`).
    fn too_big(ctx: &XdpContext) -> u32;
    /// Writes a fresh IP header at `ip` for a TCP segment of `tcp_len`
    /// bytes from `src` to `dst` and returns its pseudo header's sum (for
    /// the TCP checksum).
    ///
    /// # Safety
    /// `ip` must point into the packet with the whole header in bounds.
    unsafe fn syn_ip(ip: *mut u8, src: &Self::Addr, dst: &Self::Addr, tcp_len: u16) -> u64;
}

pub enum V4 {}

impl V4 {
    /// `SERVICES`' value for `key`, from the live half of `SERVICE_INDEX`
    /// (or from `SERVICES` itself while no half is live).
    #[inline(always)]
    fn service(cfg: &Config, key: &ServiceKey) -> Option<ServiceValue> {
        let half = u32::from(cfg.service_half);
        if half == 0 {
            // SAFETY: copied out at once (values are replaced whole).
            return unsafe { SERVICES.get(key) }.copied();
        }
        let word = key.word();
        let mul = cfg.service_mul[usize::from(half == 2)];
        let slot = ((half - 1) << SERVICE_INDEX_BITS) | service_slot(word, mul);
        let e = SERVICE_INDEX.get(slot)?;
        // A half is rewritten only while the other is live, so the entry
        // is read whole.
        (e.key.word() == word).then_some(e.value)
    }
}

impl Family for V4 {
    type Addr = [u8; 4];
    type Hdr = Ipv4Hdr;
    const FAMILY: u8 = FAMILY_V4;
    const IP_LEN: usize = 20;
    const ETHERTYPE: [u8; 2] = [0x08, 0x00];
    const OPTS_AT: usize = 14 + 20 + 20;
    const RETRY: bool = true;

    #[inline(always)]
    fn wide(a: &[u8; 4]) -> Addr {
        addr_v4(*a)
    }

    #[inline(always)]
    fn narrow(a: &Addr) -> &[u8; 4] {
        // SAFETY: the first 4 of 16 bytes, alignment 1.
        unsafe { &*a.as_ptr().cast::<[u8; 4]>() }
    }

    #[inline(always)]
    fn vip(p: &Packet<V4>, cfg: &Config) -> Option<ServiceValue> {
        let key = ServiceKey {
            addr: *p.dst(),
            port_be: u16::from_ne_bytes(p.dport),
            proto: p.proto,
            kind: SERVICE_KIND_VIP,
        };
        V4::service(cfg, &key)
    }

    #[inline(always)]
    fn to_snat(p: &Packet<V4>, cfg: &Config) -> bool {
        let key = ServiceKey {
            addr: *p.dst(),
            port_be: 0,
            proto: 0,
            kind: SERVICE_KIND_SNAT,
        };
        V4::service(cfg, &key).is_some()
    }

    #[inline(always)]
    fn snat_range(cfg: &Config) -> (u32, u32) {
        (0, u32::from(cfg.snat_count))
    }

    #[inline(always)]
    fn addrs(p: &Packet<V4>) -> (&[u8; 4], &[u8; 4]) {
        // SAFETY: the IP header was bounds-checked by `parse`.
        unsafe { (&(*p.ip).src_addr, &(*p.ip).dst_addr) }
    }

    #[inline(always)]
    fn fib_addrs(params: &mut bpf_fib_lookup, src: &[u8; 4], dst: &[u8; 4]) {
        params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(*src);
        params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(*dst);
    }

    #[inline(always)]
    fn fib_dst_is(params: &bpf_fib_lookup, dst: &[u8; 4]) -> bool {
        // SAFETY: a union field the helper filled.
        unsafe { params.__bindgen_anon_4.ipv4_dst == u32::from_ne_bytes(*dst) }
    }

    #[inline(always)]
    fn rewrite(p: &Packet<V4>, to: &Tuple<'_, [u8; 4]>) {
        rewrite::rewrite(p, to);
    }

    #[inline(always)]
    fn encap(ctx: &XdpContext, p: &Packet<V4>, cfg: &Config, id: u32, backend: &Backend) -> u32 {
        dsr::encap(ctx, p, cfg, id, *V4::narrow(&backend.addr))
    }

    /// Never asked: IPv4's answer fits under `encap`.
    #[inline(always)]
    fn too_big(_ctx: &XdpContext) -> u32 {
        aya_ebpf::bindings::xdp_action::XDP_DROP
    }

    /// DF set, TTL 64.
    #[inline(always)]
    unsafe fn syn_ip(ip: *mut u8, src: &[u8; 4], dst: &[u8; 4], tcp_len: u16) -> u64 {
        let tot = (20 + tcp_len).to_be_bytes();
        let iph: [u8; 20] = [
            0x45, 0, tot[0], tot[1], 0, 0, 0x40, 0, 64, PROTO_TCP, 0, 0, src[0], src[1], src[2],
            src[3], dst[0], dst[1], dst[2], dst[3],
        ];
        // SAFETY: the caller's bounds.
        unsafe {
            put(ip.cast::<[u8; 20]>(), &iph);
            ip.add(10)
                .cast::<u16>()
                .write_unaligned(csum::apply(0xffff, csum::words(&iph)));
        }
        csum::tcp_pseudo(src, dst, tcp_len)
    }
}

pub enum V6 {}

impl V6 {
    #[inline(always)]
    fn lookup(addr: &[u8; 16], port_be: u16, proto: u8, kind: u8) -> Option<ServiceValue> {
        let key = ServiceKey6 {
            addr: *addr,
            port_be,
            proto,
            kind,
            _pad: 0,
        };
        // SAFETY: copied out at once (values are replaced whole).
        unsafe { SERVICES6.get(&key) }.copied()
    }

    /// Whether `addr` is one of the balancer's IPv6 SNAT addresses.
    #[inline(always)]
    pub fn is_snat(addr: &[u8; 16]) -> bool {
        V6::lookup(addr, 0, 0, SERVICE_KIND_SNAT).is_some()
    }
}

impl Family for V6 {
    type Addr = [u8; 16];
    type Hdr = Ipv6Hdr;
    const FAMILY: u8 = FAMILY_V6;
    const IP_LEN: usize = 40;
    const ETHERTYPE: [u8; 2] = [0x86, 0xdd];
    const OPTS_AT: usize = 14 + 40 + 20;
    const RETRY: bool = true;

    #[inline(always)]
    fn wide(a: &[u8; 16]) -> Addr {
        *a
    }

    #[inline(always)]
    fn narrow(a: &Addr) -> &[u8; 16] {
        a
    }

    #[inline(always)]
    fn vip(p: &Packet<V6>, _cfg: &Config) -> Option<ServiceValue> {
        V6::lookup(
            p.dst(),
            u16::from_ne_bytes(p.dport),
            p.proto,
            SERVICE_KIND_VIP,
        )
    }

    #[inline(always)]
    fn to_snat(p: &Packet<V6>, _cfg: &Config) -> bool {
        V6::is_snat(p.dst())
    }

    #[inline(always)]
    fn snat_range(cfg: &Config) -> (u32, u32) {
        (u32::from(cfg.snat_count), u32::from(cfg.snat6_count))
    }

    #[inline(always)]
    fn addrs(p: &Packet<V6>) -> (&[u8; 16], &[u8; 16]) {
        // SAFETY: the IP header was bounds-checked by `parse6`.
        unsafe { (&(*p.ip).src_addr, &(*p.ip).dst_addr) }
    }

    #[inline(always)]
    fn fib_addrs(params: &mut bpf_fib_lookup, src: &[u8; 16], dst: &[u8; 16]) {
        let w = |a: &[u8; 16], i: usize| u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
        params.__bindgen_anon_3.ipv6_src = [w(src, 0), w(src, 4), w(src, 8), w(src, 12)];
        params.__bindgen_anon_4.ipv6_dst = [w(dst, 0), w(dst, 4), w(dst, 8), w(dst, 12)];
    }

    #[inline(always)]
    fn fib_dst_is(params: &bpf_fib_lookup, dst: &[u8; 16]) -> bool {
        let w = |i: usize| u32::from_ne_bytes([dst[i], dst[i + 1], dst[i + 2], dst[i + 3]]);
        // SAFETY: a union field the helper filled.
        let got = unsafe { params.__bindgen_anon_4.ipv6_dst };
        got == [w(0), w(4), w(8), w(12)]
    }

    #[inline(always)]
    fn rewrite(p: &Packet<V6>, to: &Tuple<'_, [u8; 16]>) {
        rewrite::rewrite6(p, to);
    }

    #[inline(always)]
    fn encap(ctx: &XdpContext, p: &Packet<V6>, cfg: &Config, id: u32, backend: &Backend) -> u32 {
        dsr::encap6(ctx, p, cfg, id, backend)
    }

    #[inline(always)]
    fn too_big(ctx: &XdpContext) -> u32 {
        icmp6::too_big(ctx)
    }

    /// Hop limit 64, no flow label.
    #[inline(always)]
    unsafe fn syn_ip(ip: *mut u8, src: &[u8; 16], dst: &[u8; 16], tcp_len: u16) -> u64 {
        let len = tcp_len.to_be_bytes();
        // SAFETY: the caller's bounds.
        unsafe {
            put(
                ip.cast::<[u8; 8]>(),
                &[0x60, 0, 0, 0, len[0], len[1], PROTO_TCP, 64],
            );
            put(ip.add(8).cast::<[u8; 16]>(), src);
            put(ip.add(24).cast::<[u8; 16]>(), dst);
        }
        csum::tcp_pseudo(src, dst, tcp_len)
    }
}
