//! Bounds-checked header parsing. A packet is either a well-formed IPv4
//! TCP/UDP packet we may rewrite, or a reason to leave it to the kernel.

use aya_ebpf::programs::XdpContext;
use core::mem::size_of;
use huddle_common::{PROTO_TCP, PROTO_UDP};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, tcp::TcpHdr, udp::UdpHdr};

/// TCP flag bits (byte 13 of the header).
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

const ETH_P_IP: u16 = 0x0800;
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
}

/// A parsed IPv4 TCP or UDP packet with a 20-byte IP header.
pub struct Packet {
    pub eth: *mut EthHdr,
    pub ip: *mut Ipv4Hdr,
    /// Start of the TCP or UDP header.
    pub l4: *mut u8,
    pub proto: u8,
    /// Addresses and ports exactly as in the packet (network order bytes).
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    /// TCP flags, 0 for UDP.
    pub tcp_flags: u8,
    /// IPv4 total length.
    pub tot_len: u16,
    /// Bytes of TCP or UDP payload.
    pub payload_len: u16,
    /// TCP sequence and acknowledgement numbers (host order), 0 for UDP.
    pub seq: u32,
    pub ack: u32,
}

impl Packet {
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
    let l4_off = EthHdr::LEN + Ipv4Hdr::LEN;
    let proto = iph.proto;
    let (sport, dport, tcp_flags, l4, payload_len, seq, ack) = match proto {
        PROTO_TCP => {
            let tcp: *mut TcpHdr = ptr_at(ctx, l4_off).ok_or(Skip::Malformed)?;
            // SAFETY: checked by `ptr_at`; the header is plain bytes.
            let raw: &[u8; TcpHdr::LEN] = unsafe { &*tcp.cast() };
            let doff = usize::from(raw[12] >> 4) * 4;
            if doff < TcpHdr::LEN || doff > l4_len {
                return Err(Skip::Malformed);
            }
            (
                [raw[0], raw[1]],
                [raw[2], raw[3]],
                raw[13],
                tcp.cast::<u8>(),
                (l4_len - doff) as u16,
                u32::from_be_bytes([raw[4], raw[5], raw[6], raw[7]]),
                u32::from_be_bytes([raw[8], raw[9], raw[10], raw[11]]),
            )
        }
        PROTO_UDP => {
            let udp: *mut UdpHdr = ptr_at(ctx, l4_off).ok_or(Skip::Malformed)?;
            // SAFETY: checked by `ptr_at`.
            let u = unsafe { &*udp };
            let ulen = usize::from(u16::from_be_bytes(u.len));
            if ulen < UdpHdr::LEN || ulen > l4_len {
                return Err(Skip::Malformed);
            }
            (
                u.src,
                u.dst,
                0,
                udp.cast::<u8>(),
                (ulen - UdpHdr::LEN) as u16,
                0,
                0,
            )
        }
        _ => return Err(Skip::NotTcpUdp),
    };
    Ok(Packet {
        eth,
        ip,
        l4,
        proto,
        src: iph.src_addr,
        dst: iph.dst_addr,
        sport,
        dport,
        tcp_flags,
        tot_len,
        payload_len,
        seq,
        ack,
    })
}
