//! Bounds-checked header parsing. A packet is either a well-formed IPv4 or
//! IPv6 TCP/UDP packet we may rewrite, or a reason to leave it to the
//! kernel.

use crate::net::family::{Family, V4, V6};
use aya_ebpf::programs::XdpContext;
use core::mem::size_of;
use huddle_common::headers;
use huddle_common::{PROTO_TCP, PROTO_UDP};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};

/// TCP flag bits (byte 13 of the header).
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
/// Set by the sender on the last segment of a write.
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;

const ETH_P_IP: u16 = u16::from_be_bytes(headers::ETH_P_IP);
const ETH_P_IPV6: u16 = u16::from_be_bytes(headers::ETH_P_IPV6);
const IP_MF: u16 = 0x2000;
const IP_OFFSET: u16 = 0x1fff;

/// Why a packet is not ours to rewrite; each maps to a counter.
#[derive(Clone, Copy)]
pub enum Skip {
    NotIpv4,
    IpOptions,
    Fragment,
    Malformed,
    NotTcpUdp,
    /// IPv6 with extension headers, or not TCP/UDP.
    V6Extension,
}

/// A parsed TCP or UDP packet of address family `F` (IPv4 with a 20-byte
/// header, or IPv6 without extension headers).
pub struct Packet<F: Family = V4> {
    pub eth: *mut EthHdr,
    pub ip: *mut F::Hdr,
    /// Start of the TCP or UDP header.
    pub l4: *mut u8,
    pub proto: u8,
    /// Ports exactly as in the packet (network order bytes); the
    /// addresses are read where they lie (`src`, `dst`).
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    /// TCP flags, 0 for UDP.
    pub tcp_flags: u8,
    /// Length of the IP packet, header included.
    pub tot_len: u16,
    /// Bytes of TCP or UDP payload.
    pub payload_len: u16,
    /// TCP sequence and acknowledgement numbers (host order), 0 for UDP.
    pub seq: u32,
    pub ack: u32,
}

impl<F: Family> Packet<F> {
    /// The source address in the IP header (as rewritten, if it was).
    #[inline(always)]
    pub fn src(&self) -> &F::Addr {
        // SAFETY: `parse` checked the header's bounds.
        unsafe { F::addrs(self.ip).0 }
    }

    #[inline(always)]
    pub fn dst(&self) -> &F::Addr {
        // SAFETY: as in `src`.
        unsafe { F::addrs(self.ip).1 }
    }

    #[inline(always)]
    pub fn is_tcp(&self) -> bool {
        self.proto == PROTO_TCP
    }

    #[inline(always)]
    pub fn has_flag(&self, flag: u8) -> bool {
        self.tcp_flags & flag != 0
    }
}

/// Pointer to a `T` at `offset`, if the whole `T` lies inside the packet.
#[inline(always)]
pub fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *mut T)
}

/// Whether the frame is IPv6 (by its EtherType).
#[inline(always)]
pub fn is_ipv6(ctx: &XdpContext) -> bool {
    ptr_at::<EthHdr>(ctx, 0)
        // SAFETY: checked by `ptr_at`.
        .is_some_and(|e| u16::from_be(unsafe { (*e).ether_type }) == ETH_P_IPV6)
}

/// Whether the frame, already parsed as a whole IPv4 packet that is not
/// TCP or UDP, is ICMP.
#[inline(always)]
pub fn is_icmp(ctx: &XdpContext) -> bool {
    ptr_at::<Ipv4Hdr>(ctx, EthHdr::LEN)
        // SAFETY: checked by `ptr_at`.
        .is_some_and(|ip| unsafe { (*ip).proto } == 1)
}

#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Packet, Skip> {
    let eth: *mut EthHdr = ptr_at(ctx, 0).ok_or(Skip::NotIpv4)?;
    // SAFETY: `ptr_at` checked the header lies within the packet.
    if u16::from_be(unsafe { (*eth).ether_type }) != ETH_P_IP {
        return Err(Skip::NotIpv4);
    }
    let ip: *mut Ipv4Hdr = ptr_at(ctx, EthHdr::LEN).ok_or(Skip::Malformed)?;
    // SAFETY: as above.
    let iph = unsafe { &*ip };
    if iph.vihl >> 4 != 4 {
        return Err(Skip::Malformed);
    }
    let ihl = iph.vihl & 0x0f;
    if ihl < 5 {
        return Err(Skip::Malformed);
    }
    if ihl > 5 {
        return Err(Skip::IpOptions);
    }
    let tot_len = u16::from_be_bytes(iph.tot_len);
    let l3_avail = ctx.data_end() - ctx.data() - EthHdr::LEN;
    if usize::from(tot_len) > l3_avail || usize::from(tot_len) < Ipv4Hdr::LEN {
        return Err(Skip::Malformed);
    }
    if u16::from_be_bytes(iph.frags) & (IP_MF | IP_OFFSET) != 0 {
        return Err(Skip::Fragment);
    }
    let l4_len = usize::from(tot_len) - Ipv4Hdr::LEN;
    let proto = iph.proto;
    let t = transport(ctx, EthHdr::LEN + Ipv4Hdr::LEN, l4_len, proto)?;
    Ok(t.packet(eth, ip, proto, tot_len))
}

/// An IPv6 TCP or UDP packet whose next header is the transport one.
/// Extension headers (fragments included) are left to the kernel: the
/// program never rewrites what it did not parse.
#[inline(always)]
pub fn parse6(ctx: &XdpContext) -> Result<Packet<V6>, Skip> {
    let eth: *mut EthHdr = ptr_at(ctx, 0).ok_or(Skip::NotIpv4)?;
    let ip: *mut Ipv6Hdr = ptr_at(ctx, EthHdr::LEN).ok_or(Skip::Malformed)?;
    // SAFETY: `ptr_at` checked the header lies within the packet.
    let iph = unsafe { &*ip };
    if iph.vcf[0] >> 4 != 6 {
        return Err(Skip::Malformed);
    }
    let l4_len = usize::from(u16::from_be_bytes(iph.payload_len));
    let l3_avail = ctx.data_end() - ctx.data() - EthHdr::LEN;
    // A jumbogram (payload length 0) or a packet longer than the frame.
    if l4_len == 0 || Ipv6Hdr::LEN + l4_len > l3_avail || Ipv6Hdr::LEN + l4_len > 0xffff {
        return Err(Skip::Malformed);
    }
    let proto = iph.next_hdr;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Err(Skip::V6Extension);
    }
    let t = transport(ctx, EthHdr::LEN + Ipv6Hdr::LEN, l4_len, proto)?;
    Ok(t.packet(eth, ip, proto, (Ipv6Hdr::LEN + l4_len) as u16))
}

/// The transport fields of a packet.
struct Transport {
    l4: *mut u8,
    sport: [u8; 2],
    dport: [u8; 2],
    tcp_flags: u8,
    payload_len: u16,
    seq: u32,
    ack: u32,
}

impl Transport {
    /// The packet these transport fields belong to.
    #[inline(always)]
    fn packet<F: Family>(
        self,
        eth: *mut EthHdr,
        ip: *mut F::Hdr,
        proto: u8,
        tot_len: u16,
    ) -> Packet<F> {
        Packet {
            eth,
            ip,
            l4: self.l4,
            proto,
            sport: self.sport,
            dport: self.dport,
            tcp_flags: self.tcp_flags,
            tot_len,
            payload_len: self.payload_len,
            seq: self.seq,
            ack: self.ack,
        }
    }
}

/// The TCP or UDP header at `l4_off`, `l4_len` bytes of transport in all.
#[inline(always)]
fn transport(ctx: &XdpContext, l4_off: usize, l4_len: usize, proto: u8) -> Result<Transport, Skip> {
    match proto {
        PROTO_TCP => {
            let tcp: *mut TcpHdr = ptr_at(ctx, l4_off).ok_or(Skip::Malformed)?;
            // SAFETY: checked by `ptr_at`; the header is plain bytes.
            let raw: &[u8; TcpHdr::LEN] = unsafe { &*tcp.cast() };
            let doff = usize::from(raw[12] >> 4) * 4;
            if doff < TcpHdr::LEN || doff > l4_len {
                return Err(Skip::Malformed);
            }
            Ok(Transport {
                l4: tcp.cast::<u8>(),
                sport: [raw[0], raw[1]],
                dport: [raw[2], raw[3]],
                tcp_flags: raw[13],
                payload_len: (l4_len - doff) as u16,
                seq: u32::from_be_bytes([raw[4], raw[5], raw[6], raw[7]]),
                ack: u32::from_be_bytes([raw[8], raw[9], raw[10], raw[11]]),
            })
        }
        PROTO_UDP => {
            let udp: *mut UdpHdr = ptr_at(ctx, l4_off).ok_or(Skip::Malformed)?;
            // SAFETY: checked by `ptr_at`.
            let u = unsafe { &*udp };
            let ulen = usize::from(u16::from_be_bytes(u.len));
            if ulen < UdpHdr::LEN || ulen > l4_len {
                return Err(Skip::Malformed);
            }
            Ok(Transport {
                l4: udp.cast::<u8>(),
                sport: u.src,
                dport: u.dst,
                tcp_flags: 0,
                payload_len: (ulen - UdpHdr::LEN) as u16,
                seq: 0,
                ack: 0,
            })
        }
        _ => Err(Skip::NotTcpUdp),
    }
}
