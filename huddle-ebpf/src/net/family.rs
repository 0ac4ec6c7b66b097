//! The address families' shape: what differs between IPv4 and IPv6
//! packets (address width, header, the FIB request, a fresh header), so
//! the paths are written once and built once per family (no family test on
//! the packet path). What the balancer does differently per family is in
//! traits of its own beside the code that does it: `lb::service::Lookup`,
//! `lb::snat::rewrite::Rewrite`, `lb::dsr::Encap`.

use crate::{csum, mem::put};
use aya_ebpf::bindings::bpf_fib_lookup;
use huddle_common::{addr_v4, headers, Addr, FAMILY_V4, FAMILY_V6, PROTO_TCP};
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
    /// The addresses the IP header at `ip` holds now (after a rewrite).
    ///
    /// # Safety
    /// `ip` must point to a bounds-checked header that outlives `'a`.
    unsafe fn addrs<'a>(ip: *const Self::Hdr) -> (&'a Self::Addr, &'a Self::Addr);
    /// The one's-complement sum of an address where the packet holds it
    /// (for a pseudo header; word sums fold to what byte pairs do).
    fn addr_sum(a: &Self::Addr) -> u64;
    /// Puts the addresses into a FIB request.
    fn fib_addrs(params: &mut bpf_fib_lookup, src: &Self::Addr, dst: &Self::Addr);
    /// Whether the FIB's answer names `dst` itself as the next hop (no
    /// gateway).
    fn fib_dst_is(params: &bpf_fib_lookup, dst: &Self::Addr) -> bool;
    /// Writes a fresh IP header at `ip` for a TCP segment of `tcp_len`
    /// bytes from `src` to `dst` and returns its pseudo header's sum (for
    /// the TCP checksum).
    ///
    /// # Safety
    /// `ip` must point into the packet with the whole header in bounds.
    unsafe fn syn_ip(ip: *mut u8, src: &Self::Addr, dst: &Self::Addr, tcp_len: u16) -> u64;
}

pub enum V4 {}

impl Family for V4 {
    type Addr = [u8; 4];
    type Hdr = Ipv4Hdr;
    const FAMILY: u8 = FAMILY_V4;
    const IP_LEN: usize = headers::IP_LEN;
    const ETHERTYPE: [u8; 2] = headers::ETH_P_IP;
    const OPTS_AT: usize = headers::ETH_LEN + headers::IP_LEN + headers::TCP_LEN;
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
    unsafe fn addrs<'a>(ip: *const Ipv4Hdr) -> (&'a [u8; 4], &'a [u8; 4]) {
        // SAFETY: the caller's bounds.
        unsafe { (&(*ip).src_addr, &(*ip).dst_addr) }
    }

    #[inline(always)]
    fn addr_sum(a: &[u8; 4]) -> u64 {
        u64::from(u32::from_ne_bytes(*a))
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

impl Family for V6 {
    type Addr = [u8; 16];
    type Hdr = Ipv6Hdr;
    const FAMILY: u8 = FAMILY_V6;
    const IP_LEN: usize = headers::IP6_LEN;
    const ETHERTYPE: [u8; 2] = headers::ETH_P_IPV6;
    const OPTS_AT: usize = headers::ETH_LEN + headers::IP6_LEN + headers::TCP_LEN;
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
    unsafe fn addrs<'a>(ip: *const Ipv6Hdr) -> (&'a [u8; 16], &'a [u8; 16]) {
        // SAFETY: the caller's bounds.
        unsafe { (&(*ip).src_addr, &(*ip).dst_addr) }
    }

    #[inline(always)]
    fn addr_sum(a: &[u8; 16]) -> u64 {
        let w = |i: usize| u64::from(u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]));
        w(0) + w(4) + w(8) + w(12)
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
