//! Crafting and checking Ethernet/IPv4/TCP/UDP frames, for `huddle bench`
//! and the PROG_TEST_RUN tests: `Frame::tcp(..).syn().payload(..).build()`.

use huddle_common::headers::{ETH_LEN, IP_LEN, TCP_LEN, UDP_LEN};
use std::net::{Ipv4Addr, Ipv6Addr};

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L4 {
    Tcp { flags: u8 },
    Udp { zero_checksum: bool },
}

/// A frame under construction.
#[derive(Clone, Debug)]
pub struct Frame {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    pub l4: L4,
    pub payload: Vec<u8>,
    pub ttl: u8,
    pub id: u16,
    /// TCP sequence and acknowledgement numbers.
    pub seq: u32,
    pub ack: u32,
    /// TCP options (a multiple of 4 bytes, at most 40).
    pub options: Vec<u8>,
}

impl Frame {
    #[must_use]
    pub fn tcp(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> Frame {
        Frame {
            src_mac: [0x02, 0, 0, 0, 0, 0x02],
            dst_mac: [0x02, 0, 0, 0, 0, 0x01],
            src: src.0,
            dst: dst.0,
            sport: src.1,
            dport: dst.1,
            l4: L4::Tcp { flags: ACK },
            payload: Vec::new(),
            ttl: 64,
            id: 0x1234,
            seq: 1000,
            ack: 2000,
            options: Vec::new(),
        }
    }

    #[must_use]
    pub fn udp(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> Frame {
        Frame {
            l4: L4::Udp {
                zero_checksum: false,
            },
            ..Frame::tcp(src, dst)
        }
    }

    #[must_use]
    pub fn flags(mut self, flags: u8) -> Frame {
        self.l4 = L4::Tcp { flags };
        self
    }

    /// TCP sequence and acknowledgement numbers.
    #[must_use]
    pub fn seq_ack(mut self, seq: u32, ack: u32) -> Frame {
        self.seq = seq;
        self.ack = ack;
        self
    }

    /// TCP options, as a SYN carries them (padded to 4 bytes by the caller).
    #[must_use]
    pub fn options(mut self, o: &[u8]) -> Frame {
        self.options = o.to_vec();
        self
    }

    #[must_use]
    pub fn syn(self) -> Frame {
        self.flags(SYN)
    }

    #[must_use]
    pub fn payload(mut self, p: &[u8]) -> Frame {
        self.payload = p.to_vec();
        self
    }

    #[must_use]
    pub fn macs(mut self, src: [u8; 6], dst: [u8; 6]) -> Frame {
        self.src_mac = src;
        self.dst_mac = dst;
        self
    }

    /// UDP without a checksum (allowed in IPv4).
    #[must_use]
    pub fn no_udp_checksum(mut self) -> Frame {
        self.l4 = L4::Udp {
            zero_checksum: true,
        };
        self
    }

    /// The frame's bytes with correct IP and L4 checksums.
    #[must_use]
    pub fn build(&self) -> Vec<u8> {
        let l4_len = match self.l4 {
            L4::Tcp { .. } => TCP_LEN + self.options.len(),
            L4::Udp { .. } => UDP_LEN,
        } + self.payload.len();
        let tot_len = (IP_LEN + l4_len) as u16;
        let mut f = Vec::with_capacity(ETH_LEN + tot_len as usize);
        f.extend_from_slice(&self.dst_mac);
        f.extend_from_slice(&self.src_mac);
        f.extend_from_slice(&0x0800u16.to_be_bytes());
        f.push(0x45);
        f.push(0);
        f.extend_from_slice(&tot_len.to_be_bytes());
        f.extend_from_slice(&self.id.to_be_bytes());
        f.extend_from_slice(&0x4000u16.to_be_bytes()); // DF
        f.push(self.ttl);
        f.push(match self.l4 {
            L4::Tcp { .. } => 6,
            L4::Udp { .. } => 17,
        });
        f.extend_from_slice(&[0, 0]);
        f.extend_from_slice(&self.src.octets());
        f.extend_from_slice(&self.dst.octets());
        let ip_sum = checksum(&f[ETH_LEN..ETH_LEN + IP_LEN], 0);
        f[ETH_LEN + 10..ETH_LEN + 12].copy_from_slice(&ip_sum.to_be_bytes());
        let l4_start = f.len();
        f.extend_from_slice(&self.sport.to_be_bytes());
        f.extend_from_slice(&self.dport.to_be_bytes());
        match self.l4 {
            L4::Tcp { flags } => {
                f.extend_from_slice(&self.seq.to_be_bytes());
                f.extend_from_slice(&(if flags & ACK != 0 { self.ack } else { 0 }).to_be_bytes());
                f.push((((TCP_LEN + self.options.len()) / 4) as u8) << 4);
                f.push(flags);
                f.extend_from_slice(&64240u16.to_be_bytes());
                f.extend_from_slice(&[0, 0, 0, 0]);
                f.extend_from_slice(&self.options);
            }
            L4::Udp { .. } => {
                f.extend_from_slice(&(l4_len as u16).to_be_bytes());
                f.extend_from_slice(&[0, 0]);
            }
        }
        f.extend_from_slice(&self.payload);
        let zero = matches!(
            self.l4,
            L4::Udp {
                zero_checksum: true
            }
        );
        if !zero {
            let sum = l4_checksum(&f);
            let off = l4_start
                + if matches!(self.l4, L4::Tcp { .. }) {
                    16
                } else {
                    6
                };
            let sum = if sum == 0 && !matches!(self.l4, L4::Tcp { .. }) {
                0xffff
            } else {
                sum
            };
            f[off..off + 2].copy_from_slice(&sum.to_be_bytes());
        }
        f
    }
}

/// One's-complement sum over `data` (plus `initial`), folded and inverted.
#[must_use]
pub fn checksum(data: &[u8], initial: u32) -> u16 {
    let mut sum = u64::from(initial);
    for chunk in data.chunks(2) {
        let word = if chunk.len() == 2 {
            u16::from_be_bytes([chunk[0], chunk[1]])
        } else {
            u16::from_be_bytes([chunk[0], 0])
        };
        sum += u64::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The TCP/UDP checksum a frame's L4 header should carry (checksum field
/// taken as zero).
#[must_use]
pub fn l4_checksum(frame: &[u8]) -> u16 {
    let ip = &frame[ETH_LEN..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let proto = ip[9];
    let mut seg = ip[ihl..tot].to_vec();
    let off = if proto == 6 { 16 } else { 6 };
    seg[off] = 0;
    seg[off + 1] = 0;
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&ip[12..20]);
    pseudo.push(0);
    pseudo.push(proto);
    pseudo.extend_from_slice(&((tot - ihl) as u16).to_be_bytes());
    pseudo.extend_from_slice(&seg);
    checksum(&pseudo, 0)
}

/// `frame` (IPv4, TCP or UDP) as a veth hands it over from a sender with
/// checksum offload on: its L4 checksum holds only the pseudo header's
/// sum, folded and not inverted (the kernel's CHECKSUM_PARTIAL), for a
/// device to finish.
#[must_use]
pub fn left_to_offload(mut frame: Vec<u8>) -> Vec<u8> {
    let ip = &frame[ETH_LEN..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let proto = ip[9];
    let mut pseudo = ip[12..20].to_vec();
    pseudo.extend_from_slice(&[0, proto]);
    pseudo.extend_from_slice(&((tot - ihl) as u16).to_be_bytes());
    let sum = !checksum(&pseudo, 0);
    let off = ETH_LEN + ihl + if proto == 6 { 16 } else { 6 };
    frame[off..off + 2].copy_from_slice(&sum.to_be_bytes());
    frame
}

/// Whether both checksums of an IPv4 TCP/UDP frame are valid (a UDP
/// checksum of 0 means none and is valid).
#[must_use]
pub fn checksums_valid(frame: &[u8]) -> bool {
    if frame.len() < ETH_LEN + IP_LEN {
        return false;
    }
    let ip = &frame[ETH_LEN..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if checksum(&ip[..ihl], 0) != 0 {
        return false;
    }
    let proto = ip[9];
    let off = ihl + if proto == 6 { 16 } else { 6 };
    let stored = u16::from_be_bytes([ip[off], ip[off + 1]]);
    if proto == 17 && stored == 0 {
        return true;
    }
    let want = l4_checksum(frame);
    let want = if proto == 17 && want == 0 {
        0xffff
    } else {
        want
    };
    stored == want
}

/// (src, sport, dst, dport) of an IPv4 TCP/UDP frame.
#[must_use]
pub fn endpoints(frame: &[u8]) -> ((Ipv4Addr, u16), (Ipv4Addr, u16)) {
    let ip = &frame[ETH_LEN..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let sport = u16::from_be_bytes([ip[ihl], ip[ihl + 1]]);
    let dport = u16::from_be_bytes([ip[ihl + 2], ip[ihl + 3]]);
    ((src, sport), (dst, dport))
}

/// `frame`'s IP packet inside an outer IPv4 header (protocol 4) from `src`
/// to `dst`, as the balancer's dsr-ipip mode builds it: TOS, IP id and DF
/// of the inner header, TTL 64; Ethernet addresses `macs` (source,
/// destination).
#[must_use]
pub fn ipip(frame: &[u8], src: Ipv4Addr, dst: Ipv4Addr, macs: ([u8; 6], [u8; 6])) -> Vec<u8> {
    let inner = &frame[ETH_LEN..];
    let tot_len = (inner.len() + IP_LEN) as u16;
    let mut f = Vec::with_capacity(frame.len() + IP_LEN);
    f.extend_from_slice(&macs.1);
    f.extend_from_slice(&macs.0);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    f.extend_from_slice(&[0x45, inner[1]]);
    f.extend_from_slice(&tot_len.to_be_bytes());
    f.extend_from_slice(&inner[4..6]);
    f.extend_from_slice(&[inner[6] & 0x40, 0, 64, 4, 0, 0]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    let sum = checksum(&f[ETH_LEN..ETH_LEN + IP_LEN], 0);
    f[ETH_LEN + 10..ETH_LEN + 12].copy_from_slice(&sum.to_be_bytes());
    f.extend_from_slice(inner);
    f
}

/// An ICMP error frame (`kind`, `code`, the 4 bytes after the checksum
/// `rest`) from `src` to `dst`, quoting `quoted` (an IP packet, cut as the
/// sender likes), with valid checksums; Ethernet addresses `macs`
/// (source, destination).
#[must_use]
pub fn icmp_error(
    (kind, code, rest): (u8, u8, [u8; 4]),
    src: Ipv4Addr,
    dst: Ipv4Addr,
    quoted: &[u8],
    macs: ([u8; 6], [u8; 6]),
) -> Vec<u8> {
    let tot_len = (IP_LEN + 8 + quoted.len()) as u16;
    let mut f = Vec::new();
    f.extend_from_slice(&macs.1);
    f.extend_from_slice(&macs.0);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    f.extend_from_slice(&[0x45, 0]);
    f.extend_from_slice(&tot_len.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 0, 64, 1, 0, 0]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    let sum = checksum(&f[ETH_LEN..ETH_LEN + IP_LEN], 0);
    f[ETH_LEN + 10..ETH_LEN + 12].copy_from_slice(&sum.to_be_bytes());
    let icmp = f.len();
    f.extend_from_slice(&[kind, code, 0, 0]);
    f.extend_from_slice(&rest);
    f.extend_from_slice(quoted);
    let sum = checksum(&f[icmp..], 0);
    f[icmp + 2..icmp + 4].copy_from_slice(&sum.to_be_bytes());
    f
}

/// Whether an ICMP frame's IP header and ICMP message both sum right.
#[must_use]
pub fn icmp_checksums_valid(frame: &[u8]) -> bool {
    frame.len() >= ETH_LEN + IP_LEN + 8
        && checksum(&frame[ETH_LEN..ETH_LEN + IP_LEN], 0) == 0
        && checksum(&frame[ETH_LEN + IP_LEN..], 0) == 0
}

/// An IPv6 TCP frame (no extension headers, hop limit 64, window 64240)
/// with a valid checksum; Ethernet addresses `macs` (source, destination).
#[must_use]
pub fn tcp6(
    src: (Ipv6Addr, u16),
    dst: (Ipv6Addr, u16),
    (flags, seq, ack): (u8, u32, u32),
    payload: &[u8],
    macs: ([u8; 6], [u8; 6]),
) -> Vec<u8> {
    tcp6_options(src, dst, (flags, seq, ack), &[], payload, macs)
}

/// The same with TCP `options` (a multiple of 4 bytes).
#[must_use]
pub fn tcp6_options(
    src: (Ipv6Addr, u16),
    dst: (Ipv6Addr, u16),
    (flags, seq, ack): (u8, u32, u32),
    options: &[u8],
    payload: &[u8],
    macs: ([u8; 6], [u8; 6]),
) -> Vec<u8> {
    let doff = TCP_LEN + options.len();
    let l4_len = doff + payload.len();
    let mut f = Vec::new();
    f.extend_from_slice(&macs.1);
    f.extend_from_slice(&macs.0);
    f.extend_from_slice(&0x86ddu16.to_be_bytes());
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(l4_len as u16).to_be_bytes());
    f.extend_from_slice(&[6, 64]);
    f.extend_from_slice(&src.0.octets());
    f.extend_from_slice(&dst.0.octets());
    f.extend_from_slice(&src.1.to_be_bytes());
    f.extend_from_slice(&dst.1.to_be_bytes());
    f.extend_from_slice(&seq.to_be_bytes());
    f.extend_from_slice(&(if flags & ACK != 0 { ack } else { 0 }).to_be_bytes());
    f.extend_from_slice(&[(doff as u8 / 4) << 4, flags]);
    f.extend_from_slice(&64240u16.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 0]);
    f.extend_from_slice(options);
    f.extend_from_slice(payload);
    let sum = l4_checksum6(&f);
    let off = ETH_LEN + 40 + 16;
    f[off..off + 2].copy_from_slice(&sum.to_be_bytes());
    f
}

/// An ICMPv6 error frame (`kind`, `code`, the 4 bytes after the checksum
/// `rest`) from `src` to `dst`, hop limit 64, quoting `quoted` (an IPv6
/// packet, cut as the sender likes), with a valid checksum; Ethernet
/// addresses `macs` (source, destination).
#[must_use]
pub fn icmp6_error(
    (kind, code, rest): (u8, u8, [u8; 4]),
    src: Ipv6Addr,
    dst: Ipv6Addr,
    quoted: &[u8],
    macs: ([u8; 6], [u8; 6]),
) -> Vec<u8> {
    let len = 8 + quoted.len();
    let mut f = Vec::new();
    f.extend_from_slice(&macs.1);
    f.extend_from_slice(&macs.0);
    f.extend_from_slice(&0x86ddu16.to_be_bytes());
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(len as u16).to_be_bytes());
    f.extend_from_slice(&[58, 64]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(&[kind, code, 0, 0]);
    f.extend_from_slice(&rest);
    f.extend_from_slice(quoted);
    let sum = icmp6_checksum(&f);
    f[ETH_LEN + 42..ETH_LEN + 44].copy_from_slice(&sum.to_be_bytes());
    f
}

/// The checksum an ICMPv6 frame (no extension headers) should carry.
#[must_use]
pub fn icmp6_checksum(frame: &[u8]) -> u16 {
    let ip = &frame[ETH_LEN..];
    let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let mut msg = ip[40..40 + len].to_vec();
    msg[2] = 0;
    msg[3] = 0;
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&ip[8..40]);
    pseudo.extend_from_slice(&(len as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, 58]);
    pseudo.extend_from_slice(&msg);
    checksum(&pseudo, 0)
}

/// Whether an ICMPv6 frame's checksum is valid.
#[must_use]
pub fn icmp6_checksum_valid(frame: &[u8]) -> bool {
    frame.len() >= ETH_LEN + 48
        && u16::from_be_bytes([frame[ETH_LEN + 42], frame[ETH_LEN + 43]]) == icmp6_checksum(frame)
}

/// The TCP/UDP checksum an IPv6 frame's L4 header should carry.
#[must_use]
pub fn l4_checksum6(frame: &[u8]) -> u16 {
    let ip = &frame[ETH_LEN..];
    let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let proto = ip[6];
    let mut seg = ip[40..40 + len].to_vec();
    let off = if proto == 6 { 16 } else { 6 };
    seg[off] = 0;
    seg[off + 1] = 0;
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&ip[8..40]);
    pseudo.extend_from_slice(&(len as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, proto]);
    pseudo.extend_from_slice(&seg);
    checksum(&pseudo, 0)
}

/// Whether an IPv6 TCP/UDP frame's L4 checksum is valid.
#[must_use]
pub fn checksums6_valid(frame: &[u8]) -> bool {
    let proto = frame[ETH_LEN + 6];
    let off = ETH_LEN + 40 + if proto == 6 { 16 } else { 6 };
    u16::from_be_bytes([frame[off], frame[off + 1]]) == l4_checksum6(frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_frames_have_valid_checksums() {
        let a = (Ipv4Addr::new(10, 0, 0, 2), 40000);
        let b = (Ipv4Addr::new(10, 0, 0, 1), 80);
        for f in [
            Frame::tcp(a, b).syn().build(),
            Frame::tcp(a, b).payload(b"GET / HTTP/1.0\r\n\r\n").build(),
            Frame::udp(a, b).payload(b"ping").build(),
            Frame::udp(a, b).payload(b"odd").no_udp_checksum().build(),
        ] {
            assert!(checksums_valid(&f), "{f:02x?}");
        }
        let mut bad = Frame::tcp(a, b).syn().build();
        bad[ETH_LEN + 24] ^= 1;
        assert!(!checksums_valid(&bad));
    }
}
