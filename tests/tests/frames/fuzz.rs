//! Random and mutated packets through the real XDP program
//! (BPF_PROG_TEST_RUN), seeded and reproducible, with invariants checked on
//! every output:
//!
//! - a packet the parser must refuse (not IPv4, truncated anywhere, bad
//!   IHL or total length, IP options, fragments, bad TCP data offset or UDP
//!   length, other protocols) comes back unchanged with XDP_PASS, or with
//!   XDP_DROP if addressed to the VIP or a backend;
//! - traffic that is not for a service (nor a reply to one) comes back
//!   unchanged: XDP_DROP if to the VIP or a backend (`GUARDED`: a kernel
//!   that forwards would send it on), else XDP_PASS;
//! - a rewritten packet goes from the SNAT address to a backend of the
//!   service's ring on its port (or, translated back, from the VIP to the
//!   client), keeps its length and payload, and has valid IP and L4
//!   checksums whenever the input had;
//! - a packet of a DSR service leaves with its IP packet untouched: in
//!   dsr-l2 to a backend's MAC, in dsr-ipip inside an outer header from
//!   the encapsulation prefix to a backend, with a valid checksum;
//! - an ICMP error to the SNAT address about a translated flow reaches
//!   that flow's client with valid checksums, or is dropped as one that
//!   cannot be real (`icmp_unproven`); any other ICMP passes (dropped if
//!   to the VIP or a backend);
//! - IPv6 (a source-NATed, an L2 DSR and an IPv6-in-IPv6 service): a
//!   rewritten packet goes from the IPv6 SNAT address to a backend (or
//!   back from the VIP to a client), its length and payload kept, its
//!   checksum valid whenever the input's was; an L2 DSR frame changes only
//!   its MACs; a wrapped one carries the packet unchanged after an outer
//!   header to a backend; an ICMPv6 error to the SNAT address reaches a
//!   client that opened a flow, its checksum valid whenever the input's
//!   was; anything else, extension headers included, passes unchanged.
//!
//! `HUDDLE_FUZZ_CASES` sets the count (default: the full 1,000,000, about
//! 10 s), `HUDDLE_FUZZ_SEED` the seed. A failure prints the seed, the case and the
//! packet in hex.

use huddle_common::headers::ETH_LEN;
use huddle_user::{
    config::{Config, Mode, PortRange, Proto, Service},
    kernel::packet::{
        checksum, checksums_valid, endpoints, icmp_checksums_valid, icmp_error, l4_checksum, Frame,
        ACK, FIN, RST, SYN,
    },
    kernel::packet::{checksums6_valid, icmp6_checksum_valid, icmp6_error, tcp6},
    kernel::prog_run::mac_of6,
    kernel::prog_run::{mac_of, ProgRun, BALANCER_IP, BALANCER_MAC},
};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use testbed::{require_root, unique};

use huddle_common::verdict::{XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);
const CLIENTS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 213, 0, 2), Ipv4Addr::new(10, 213, 0, 3)];
const NAT: PortRange = PortRange {
    min: 20000,
    max: 32767,
};
/// (VIP port, protocol number, backend port): source NAT.
const SERVICES: [(u16, u8, u16); 2] = [(80, 6, 8080), (53, 17, 5353)];
/// DSR services (VIP port = backend port): L2, IP-in-IP (TCP and UDP).
const DSR_L2: u16 = 8081;
const DSR_IPIP: [(u16, u8); 2] = [(9091, 6), (9053, 17)];
const ENCAP_PREFIX: &str = "10.213.64.0/20";
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0x100, 0, 0, 0, 0, 1);
const SNAT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 1);
const CLIENTS6: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 2),
    Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 3),
];
/// IPv6 services: source NAT 80 -> 8080, L2 DSR on 8081.
const V6_DSR: u16 = 8081;
/// IPv6 service in dsr-ipip mode (VIP port = backend port).
const V6_IPIP: u16 = 9096;

fn backends6() -> Vec<Ipv6Addr> {
    (0..3)
        .map(|i| Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x11 + i))
        .collect()
}

fn backends() -> Vec<Ipv4Addr> {
    (0..3).map(|i| Ipv4Addr::new(10, 213, 0, 11 + i)).collect()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64: every seed, including 0, gives a good stream.
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }
}

/// Why the program's parser must refuse `f`, if it must.
fn refused(f: &[u8]) -> Option<&'static str> {
    if f.len() < ETH_LEN || u16::from_be_bytes([f[12], f[13]]) != 0x0800 {
        return Some("not IPv4");
    }
    if f.len() < ETH_LEN + 20 {
        return Some("truncated IP header");
    }
    let ip = &f[ETH_LEN..];
    if ip[0] >> 4 != 4 || ip[0] & 0x0f < 5 {
        return Some("bad version or IHL");
    }
    if ip[0] & 0x0f > 5 {
        return Some("IP options");
    }
    let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if tot > ip.len() || tot < 20 {
        return Some("bad total length");
    }
    if u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
        return Some("fragment");
    }
    let l4 = &ip[20..];
    let l4_len = tot - 20;
    match ip[9] {
        6 => {
            if l4.len() < 20 {
                return Some("truncated TCP header");
            }
            let doff = usize::from(l4[12] >> 4) * 4;
            if doff < 20 || doff > l4_len {
                return Some("bad TCP data offset");
            }
        }
        17 => {
            if l4.len() < 8 {
                return Some("truncated UDP header");
            }
            let ulen = usize::from(u16::from_be_bytes([l4[4], l4[5]]));
            if ulen < 8 || ulen > l4_len {
                return Some("bad UDP length");
            }
        }
        _ => return Some("not TCP or UDP"),
    }
    None
}

/// Whether `f` is an IPv4 frame (its fixed header there) to the VIP or a
/// backend that no service balances: one the parser refuses, ICMP, to a
/// backend, or to a port and protocol of the VIP that is no service's.
/// The program drops it (`GUARDED`): a kernel that forwards would send it
/// on.
fn guarded_unbalanced(f: &[u8]) -> bool {
    if f.len() < ETH_LEN + 20 || f[12..14] != [8, 0] {
        return false;
    }
    let dst = Ipv4Addr::new(f[30], f[31], f[32], f[33]);
    if dst != VIP {
        return backends().contains(&dst);
    }
    if refused(f).is_some() {
        return true;
    }
    let proto = f[ETH_LEN + 9];
    let dport = u16::from_be_bytes([f[ETH_LEN + 22], f[ETH_LEN + 23]]);
    let balanced = SERVICES
        .iter()
        .any(|(p, pr, _)| *p == dport && *pr == proto)
        || (dport, proto) == (DSR_L2, 6)
        || DSR_IPIP.contains(&(dport, proto));
    !balanced
}

/// Offset and length of the L4 payload of a parseable frame.
fn payload(f: &[u8]) -> (usize, usize) {
    let ip = &f[ETH_LEN..];
    let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let hdr = if ip[9] == 6 {
        usize::from(ip[20 + 12] >> 4) * 4
    } else {
        8
    };
    (ETH_LEN + 20 + hdr, tot - 20 - hdr)
}

/// Recomputes both checksums of a parseable frame.
fn fix_checksums(f: &mut [u8]) {
    if refused(f).is_some() {
        return;
    }
    f[ETH_LEN + 10] = 0;
    f[ETH_LEN + 11] = 0;
    let c = checksum(&f[ETH_LEN..ETH_LEN + 20], 0);
    f[ETH_LEN + 10..ETH_LEN + 12].copy_from_slice(&c.to_be_bytes());
    let off = ETH_LEN + 20 + if f[ETH_LEN + 9] == 6 { 16 } else { 6 };
    let mut c = l4_checksum(f);
    if f[ETH_LEN + 9] == 17 && c == 0 {
        c = 0xffff;
    }
    f[off..off + 2].copy_from_slice(&c.to_be_bytes());
}

struct Gen {
    /// (backend, NAT port, protocol) of flows the program opened, so
    /// replies can hit real NAT entries.
    nat: Vec<(Ipv4Addr, u16, u8)>,
    /// The same for IPv6 (TCP).
    nat6: Vec<(Ipv6Addr, u16)>,
}

impl Gen {
    fn frame(&mut self, r: &mut Rng) -> Vec<u8> {
        match r.below(24) {
            // An ICMPv6 message to the IPv6 SNAT address, mostly an error
            // about a tuple the program opened, quoting 48 bytes or more.
            23 => {
                let (b, port) = if !self.nat6.is_empty() && r.chance(80) {
                    self.nat6[r.below(self.nat6.len() as u64) as usize]
                } else {
                    (backends6()[0], NAT.min + r.below(100) as u16)
                };
                let sent = tcp6(
                    (SNAT6, port),
                    (b, 8080),
                    (SYN, 1000, 0),
                    &[],
                    (BALANCER_MAC, mac_of6(b)),
                );
                let cut = ETH_LEN + 48 + r.below(13) as usize;
                let kind = [(2, 0), (1, 4), (3, 0), (4, 1), (128, 0)][r.below(5) as usize];
                let from = if r.chance(50) {
                    b
                } else {
                    "fd00:213::fe".parse().unwrap()
                };
                icmp6_error(
                    (kind.0, kind.1, [0, 0, 0x05, 0x00]),
                    from,
                    SNAT6,
                    &sent[ETH_LEN..cut],
                    (mac_of6(b), BALANCER_MAC),
                )
            }
            // IPv6 to a VIP: source NAT, L2 DSR or IPv6-in-IPv6, any flags.
            21 => {
                let client = CLIENTS6[r.below(2) as usize];
                let port = [80, V6_DSR, V6_IPIP, 81][r.below(4) as usize];
                let flags = match r.below(3) {
                    0 => SYN,
                    1 => ACK,
                    _ => r.byte(),
                };
                let pl = {
                    let n = r.below(80) as usize;
                    r.bytes(n)
                };
                tcp6(
                    (client, 40000 + r.below(300) as u16),
                    (VIP6, port),
                    (flags, r.next() as u32, r.next() as u32),
                    &pl,
                    (mac_of6(client), BALANCER_MAC),
                )
            }
            // An IPv6 backend's reply to the SNAT address.
            22 => {
                let (b, port) = if !self.nat6.is_empty() && r.chance(80) {
                    self.nat6[r.below(self.nat6.len() as u64) as usize]
                } else {
                    (backends6()[0], NAT.min + r.below(100) as u16)
                };
                tcp6(
                    (b, 8080),
                    (SNAT6, port),
                    (r.byte() & !RST, r.next() as u32, r.next() as u32),
                    &[],
                    (mac_of6(b), BALANCER_MAC),
                )
            }
            // An ICMP error to the SNAT address, mostly about a tuple the
            // program opened, quoting 28 bytes or more.
            20 => {
                let (b, port, proto) = if !self.nat.is_empty() && r.chance(80) {
                    self.nat[r.below(self.nat.len() as u64) as usize]
                } else {
                    (backends()[0], NAT.min + r.below(100) as u16, 6)
                };
                let sent = if proto == 6 {
                    Frame::tcp((BALANCER_IP, port), (b, 8080)).syn().build()
                } else {
                    Frame::udp((BALANCER_IP, port), (b, 5353)).build()
                };
                let cut = (ETH_LEN + 28 + r.below(20) as usize).min(sent.len());
                let kind = [(3, 4), (3, 1), (11, 0), (8, 0)][r.below(4) as usize];
                let from = if r.chance(50) {
                    b
                } else {
                    Ipv4Addr::new(10, 213, 0, 254)
                };
                icmp_error(
                    (kind.0, kind.1, [0, 0, 0x05, 0x00]),
                    from,
                    BALANCER_IP,
                    &sent[ETH_LEN..cut],
                    (mac_of(b), BALANCER_MAC),
                )
            }
            // Client to a VIP, mostly to a service port.
            0..=10 => {
                let client = CLIENTS[r.below(2) as usize];
                let sport = 40000 + r.below(500) as u16;
                let (vport, proto) = match r.below(5) {
                    0 | 1 => {
                        let (p, pr, _) = SERVICES[r.below(2) as usize];
                        (p, pr)
                    }
                    2 => (DSR_L2, 6),
                    _ => DSR_IPIP[r.below(2) as usize],
                };
                let vport = if r.chance(90) { vport } else { r.next() as u16 };
                let pl = {
                    let n = r.below(80) as usize;
                    r.bytes(n)
                };
                let f = if proto == 6 && r.chance(80) {
                    let flags = match r.below(4) {
                        0 => SYN,
                        1 => ACK,
                        _ => r.byte(),
                    };
                    Frame::tcp((client, sport), (VIP, vport)).flags(flags)
                } else {
                    let f = Frame::udp((client, sport), (VIP, vport));
                    if r.chance(10) {
                        f.no_udp_checksum()
                    } else {
                        f
                    }
                };
                f.payload(&pl).macs(mac_of(client), BALANCER_MAC).build()
            }
            // A backend's reply to the SNAT address.
            11..=14 => {
                let (b, port, proto) = if !self.nat.is_empty() && r.chance(80) {
                    self.nat[r.below(self.nat.len() as u64) as usize]
                } else {
                    let b = backends()[r.below(3) as usize];
                    (
                        b,
                        NAT.min + r.below(u64::from(NAT.max - NAT.min)) as u16,
                        if r.chance(50) { 6 } else { 17 },
                    )
                };
                let mut pl = {
                    let n = r.below(80) as usize;
                    r.bytes(n)
                };
                let f = if proto == 6 && r.chance(20) {
                    // A refusal of a client's SYN (they carry sequence
                    // number 1000): retried on another backend if the
                    // tuple is a half-open flow's.
                    Frame::tcp((b, 8080), (BALANCER_IP, port))
                        .flags(RST | ACK)
                        .seq_ack(0, 1001)
                } else if proto == 6 && r.chance(10) {
                    // A TIME_WAIT's answer to a SYN: a bare ACK, resent
                    // from another tuple if the tuple is a half-open flow's.
                    pl.clear();
                    Frame::tcp((b, 8080), (BALANCER_IP, port))
                        .flags(ACK)
                        .seq_ack(r.next() as u32, r.next() as u32)
                } else if proto == 6 {
                    Frame::tcp((b, 8080), (BALANCER_IP, port)).flags(r.byte())
                } else {
                    Frame::udp((b, 5353), (BALANCER_IP, port))
                };
                f.payload(&pl).macs(mac_of(b), BALANCER_MAC).build()
            }
            // IPv4 to somebody else.
            15 => Frame::tcp((CLIENTS[0], 1234), (Ipv4Addr::new(10, 213, 0, 99), 80))
                .flags(r.byte())
                .macs(mac_of(CLIENTS[0]), BALANCER_MAC)
                .build(),
            // VLAN-tagged IPv4 to the VIP.
            16 => {
                let mut f = Frame::tcp((CLIENTS[0], 40001), (VIP, 80))
                    .syn()
                    .macs(mac_of(CLIENTS[0]), BALANCER_MAC)
                    .build();
                f.splice(12..12, [0x81, 0x00, 0x00, r.byte() & 0x0f]);
                f
            }
            // IPv6 with extension headers, to anything.
            17 => {
                let mut f = Vec::new();
                f.extend_from_slice(&BALANCER_MAC);
                f.extend_from_slice(&mac_of(CLIENTS[0]));
                f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
                let ext = {
                    let n = 8 * (1 + r.below(3) as usize);
                    r.bytes(n)
                };
                let body = {
                    let n = r.below(60) as usize;
                    r.bytes(n)
                };
                f.extend_from_slice(&((ext.len() + body.len()) as u16).to_be_bytes());
                f.push([0u8, 43, 60, 44][r.below(4) as usize]);
                f.push(64);
                f.extend_from_slice(&r.bytes(32));
                f.extend_from_slice(&ext);
                f.extend_from_slice(&body);
                f
            }
            // ARP, or noise.
            18 => {
                let mut f = BALANCER_MAC.to_vec();
                f.extend_from_slice(&mac_of(CLIENTS[0]));
                f.extend_from_slice(&[0x08, 0x06]);
                f.extend_from_slice(&r.bytes(28));
                f
            }
            _ => {
                let n = r.below(120) as usize;
                r.bytes(n)
            }
        }
    }

    /// Damages a frame one way, mostly in its headers.
    fn mutate(f: &mut Vec<u8>, r: &mut Rng) {
        let ip = ETH_LEN;
        match r.below(10) {
            0 => {
                let n = r.below(f.len() as u64 + 1) as usize;
                f.truncate(n);
            }
            1 if !f.is_empty() => {
                let i = r.below(f.len().min(80) as u64) as usize;
                f[i] = r.byte();
            }
            2 if f.len() > ip => f[ip] = (f[ip] & 0xf0) | (r.byte() & 0x0f),
            3 if f.len() > ip + 3 => {
                let v = r.next() as u16;
                f[ip + 2..ip + 4].copy_from_slice(&v.to_be_bytes());
            }
            4 if f.len() > ip + 7 => {
                f[ip + 6] |= [0x20, 0x1f, 0x40][r.below(3) as usize];
                f[ip + 7] = r.byte();
            }
            5 if f.len() > ip + 9 => f[ip + 9] = r.byte(),
            6 if f.len() > ip + 20 => {
                // IP options: grow the header by 1..10 words.
                let words = 1 + r.below(10) as usize;
                f[ip] = 0x40 | (5 + words as u8);
                let opts = r.bytes(words * 4);
                f.splice(ip + 20..ip + 20, opts);
                let tot =
                    u16::from_be_bytes([f[ip + 2], f[ip + 3]]).wrapping_add((words * 4) as u16);
                f[ip + 2..ip + 4].copy_from_slice(&tot.to_be_bytes());
            }
            7 if f.len() > ip + 32 => f[ip + 32] = r.byte(), // TCP data offset
            8 if f.len() > ip + 25 => {
                let v = r.next() as u16;
                f[ip + 24..ip + 26].copy_from_slice(&v.to_be_bytes()); // UDP length
            }
            _ => {
                let extra = {
                    let n = r.below(16) as usize;
                    r.bytes(n)
                };
                f.extend_from_slice(&extra); // trailing bytes after the IP packet
            }
        }
    }
}

/// IPv6 frames: `None` if `f` is not IPv6 (the other checks take it),
/// else what happened or what is wrong.
fn v6_checked(
    f: &[u8],
    verdict: u32,
    out: &[u8],
    nat6: &mut Vec<(Ipv6Addr, u16)>,
    clients6: &mut std::collections::HashSet<Ipv6Addr>,
) -> Option<Result<&'static str, &'static str>> {
    if f.len() < ETH_LEN || f[12..14] != [0x86, 0xdd] {
        return None;
    }
    if verdict == XDP_PASS && out == f {
        return Some(Ok("IPv6 passed"));
    }
    if verdict == XDP_DROP {
        return Some(Ok("IPv6 dropped"));
    }
    let addr = |b: &[u8], at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&b[at..at + 16]).unwrap());
    let tot = |b: &[u8]| ETH_LEN + 40 + usize::from(u16::from_be_bytes([b[18], b[19]]));
    if f.len() >= ETH_LEN + 48 && f[ETH_LEN + 6] == 58 {
        // ICMPv6, translated: same length, to a client, from the VIP (the
        // backend complained) or the router that did.
        let valid = tot(f) == f.len() && icmp6_checksum_valid(f);
        return Some(if out.len() != f.len() || out[ETH_LEN + 6] != 58 {
            Err("ICMPv6 translated into something else")
        } else if addr(f, ETH_LEN + 24) != SNAT6 || f[ETH_LEN + 40] >= 128 {
            Err("ICMPv6 translated that was not an error to the SNAT address")
        } else if !clients6.contains(&addr(out, ETH_LEN + 24)) {
            Err("ICMPv6 translated to somebody who opened no flow")
        } else if valid && !icmp6_checksum_valid(out) {
            Err("translated ICMPv6 with a bad checksum")
        } else {
            Ok("ICMPv6 error translated to its client")
        });
    }
    if f.len() >= ETH_LEN + 60
        && f[ETH_LEN + 6] == 6
        && addr(f, ETH_LEN + 24) == VIP6
        && u16::from_be_bytes([f[56], f[57]]) == V6_IPIP
    {
        let o = &out[ETH_LEN..];
        return Some(
            if out.len() != f.len() + 40 || out[ETH_LEN + 40..] != f[ETH_LEN..] {
                Err("IPv6 dsr-ipip did not carry the packet unchanged after an outer header")
            } else if o[0] >> 4 != 6 || o[6] != 41 || o[7] != 64 {
                Err("IPv6 dsr-ipip outer header: version, next header or hop limit wrong")
            } else if usize::from(u16::from_be_bytes([o[4], o[5]])) != tot(f) - ETH_LEN {
                Err("IPv6 dsr-ipip outer payload length wrong")
            } else if addr(out, ETH_LEN + 8) != SNAT6
                || !backends6().contains(&addr(out, ETH_LEN + 24))
            {
                Err("IPv6 dsr-ipip not from the outer source to a backend")
            } else {
                Ok("IPv6 dsr-ipip sent")
            },
        );
    }
    let whole = f.len() >= ETH_LEN + 60 && f[ETH_LEN + 6] == 6;
    if whole
        && addr(f, ETH_LEN + 24) == SNAT6
        && backends6().contains(&addr(f, ETH_LEN + 8))
        && matches!(verdict, XDP_TX | XDP_REDIRECT)
        && is_tuple_retry(f, out, 40)
    {
        // A backend's TIME_WAIT refused a client's SYN: resent to the same
        // backend from another tuple.
        let port = |b: &[u8], at: usize| u16::from_be_bytes([b[at], b[at + 1]]);
        let (b, old_port, new_port) = (addr(f, ETH_LEN + 8), port(f, 56), port(out, 54));
        return Some(
            if addr(out, ETH_LEN + 8) != SNAT6
                || addr(out, ETH_LEN + 24) != b
                || port(out, 56) != 8080
                || new_port == old_port
                || !(NAT.min..=NAT.max).contains(&new_port)
            {
                Err("IPv6: a resent SYN not from another tuple to the same backend")
            } else if !checksums6_valid(out) {
                Err("IPv6: a resent SYN with a bad checksum")
            } else {
                if nat6.len() < 4096 {
                    nat6.push((b, new_port));
                }
                Ok("IPv6 SYN resent from another tuple")
            },
        );
    }
    if !whole || out.len() != f.len() || !matches!(verdict, XDP_TX | XDP_REDIRECT | XDP_PASS) {
        return Some(Err("IPv6: changed what it should have passed"));
    }
    let (src, dst) = (addr(f, ETH_LEN + 8), addr(f, ETH_LEN + 24));
    let (osrc, odst) = (addr(out, ETH_LEN + 8), addr(out, ETH_LEN + 24));
    let dport = u16::from_be_bytes([f[56], f[57]]);
    let tot = ETH_LEN + 40 + usize::from(u16::from_be_bytes([f[18], f[19]]));
    if tot <= f.len() && out[ETH_LEN + 60..tot] != f[ETH_LEN + 60..tot] {
        return Some(Err("IPv6: payload changed"));
    }
    let valid = tot == f.len() && checksums6_valid(f);
    if dst == VIP6 && dport == V6_DSR {
        if out[12..] != f[12..] || !backends6().iter().any(|b| out[..6] == mac_of6(*b)) {
            return Some(Err(
                "IPv6 dsr-l2: more than the MACs changed, or not to a backend",
            ));
        }
        return Some(Ok("IPv6 dsr-l2 sent"));
    }
    if valid && !checksums6_valid(out) {
        return Some(Err("IPv6: a valid packet came out with a bad checksum"));
    }
    let oport = (
        u16::from_be_bytes([out[54], out[55]]),
        u16::from_be_bytes([out[56], out[57]]),
    );
    if dst == VIP6 && dport == 80 {
        if osrc != SNAT6 || !backends6().contains(&odst) || oport.1 != 8080 {
            return Some(Err("IPv6: not from the SNAT address to a backend's port"));
        }
        if nat6.len() < 4096 {
            nat6.push((odst, oport.0));
        }
        clients6.insert(src);
        return Some(Ok("IPv6 source-NATed"));
    }
    if dst == SNAT6 && backends6().contains(&src) {
        if osrc != VIP6 || oport.0 != 80 || !clients6.contains(&odst) {
            return Some(Err(
                "IPv6 reply not translated back to VIP -> a client that opened a flow",
            ));
        }
        return Some(Ok("IPv6 reply translated"));
    }
    Some(Err("IPv6: rewrote traffic that is not a service's"))
}

/// ICMP frames: `None` if `f` is not whole IPv4 ICMP (the other checks
/// take it), else what happened or what is wrong. An error about a flow
/// the program translated goes to a client that opened one, as ICMP with
/// valid checksums (when they were), its length kept; anything else
/// passes unchanged.
fn icmp_checked(
    f: &[u8],
    verdict: u32,
    out: &[u8],
    clients: &std::collections::HashSet<Ipv4Addr>,
) -> Option<Result<&'static str, &'static str>> {
    let whole = f.len() >= ETH_LEN + 20
        && u16::from_be_bytes([f[12], f[13]]) == 0x0800
        && f[ETH_LEN] == 0x45
        && f[ETH_LEN + 9] == 1
        && u16::from_be_bytes([f[ETH_LEN + 6], f[ETH_LEN + 7]]) & 0x3fff == 0
        && usize::from(u16::from_be_bytes([f[ETH_LEN + 2], f[ETH_LEN + 3]])) + ETH_LEN <= f.len()
        && usize::from(u16::from_be_bytes([f[ETH_LEN + 2], f[ETH_LEN + 3]])) >= 20;
    if !whole {
        return None;
    }
    if verdict == XDP_PASS && out == f {
        return Some(Ok("ICMP passed"));
    }
    // Dropped only as an unproven error about a flow: type 3 or 11, to
    // the SNAT address, quoting a packet from it (`icmp_unproven`).
    let about_a_flow = f.len() >= ETH_LEN + 48
        && matches!(f[ETH_LEN + 20], 3 | 11)
        && f[ETH_LEN + 16..ETH_LEN + 20] == BALANCER_IP.octets()
        && f[ETH_LEN + 40..ETH_LEN + 44] == BALANCER_IP.octets();
    if verdict == XDP_DROP && about_a_flow {
        return Some(Ok("ICMP error about a flow dropped as unproven"));
    }
    let to = Ipv4Addr::new(out[30], out[31], out[32], out[33]);
    Some(if !matches!(verdict, XDP_TX | XDP_REDIRECT | XDP_PASS) {
        Err("ICMP dropped")
    } else if out.len() != f.len() || out[ETH_LEN + 9] != 1 {
        Err("ICMP translated into something else")
    } else if !clients.contains(&to) {
        Err("ICMP translated to somebody who opened no flow")
    } else if icmp_checksums_valid(f) && !icmp_checksums_valid(out) {
        Err("translated ICMP with a bad checksum")
    } else if f[ETH_LEN + 16..ETH_LEN + 20] != BALANCER_IP.octets() {
        Err("translated ICMP that was not to the SNAT address")
    } else {
        Ok("ICMP error translated to its client")
    })
}

/// A parseable packet to a DSR service's VIP and port: dropped (no
/// backend, no flow) or passed unchanged (a TCP segment of no flow), or
/// sent with its IP packet untouched, by MAC (`l2`) or wrapped.
fn dsr_checked(f: &[u8], verdict: u32, out: &[u8], l2: bool) -> Result<&'static str, &'static str> {
    if verdict == XDP_DROP {
        return Ok("DSR dropped");
    }
    if verdict == XDP_PASS && out == f {
        return Ok("DSR passed");
    }
    if !matches!(verdict, XDP_TX | XDP_REDIRECT | XDP_PASS) {
        return Err("DSR: unexpected verdict");
    }
    if l2 {
        if out.len() != f.len() || out[12..] != f[12..] {
            return Err("dsr-l2 changed more than the MAC addresses");
        }
        if !backends().iter().any(|b| out[..6] == mac_of(*b)) {
            return Err("dsr-l2 frame not to a backend's MAC");
        }
        return Ok("dsr-l2 sent");
    }
    if out.len() != f.len() + 20 || out[ETH_LEN + 20..] != f[ETH_LEN..] {
        return Err("dsr-ipip did not carry the packet unchanged after an outer header");
    }
    let o = &out[ETH_LEN..ETH_LEN + 20];
    let inner_len = u16::from_be_bytes([f[ETH_LEN + 2], f[ETH_LEN + 3]]);
    let prefix: huddle_user::config::Prefix = ENCAP_PREFIX.parse().unwrap();
    if o[0] != 0x45 || o[9] != 4 || o[8] != 64 {
        return Err("dsr-ipip outer header: version, protocol or TTL wrong");
    }
    if u16::from_be_bytes([o[2], o[3]]) != inner_len + 20 {
        return Err("dsr-ipip outer length wrong");
    }
    if checksum(o, 0) != 0 {
        return Err("dsr-ipip outer header checksum wrong");
    }
    if !prefix.contains(Ipv4Addr::new(o[12], o[13], o[14], o[15])) {
        return Err("dsr-ipip outer source outside the prefix");
    }
    if !backends().contains(&Ipv4Addr::new(o[16], o[17], o[18], o[19])) {
        return Err("dsr-ipip outer destination not a backend");
    }
    Ok("dsr-ipip sent")
}

/// Whether `out` is `f`, a backend's RST+ACK to a NAT tuple, turned into a
/// SYN (the kernel's retry of a refused connection).
fn is_retry(f: &[u8], out: &[u8]) -> bool {
    let flags = |p: &[u8]| p.get(ETH_LEN + 33).copied().unwrap_or(0);
    f.get(ETH_LEN + 9) == Some(&6)
        && out.get(ETH_LEN + 9) == Some(&6)
        && flags(f) & (RST | ACK | SYN) == RST | ACK
        && flags(out) == SYN
}

/// Whether `out` is `f`, a backend's bare ACK to a NAT tuple (what a
/// TIME_WAIT answers a SYN with), turned into a SYN from another tuple
/// (the kernel's resend of a SYN the backend's TIME_WAIT refused). `ip_len`:
/// the IP header's length (20: IPv4 without options, 40: IPv6).
fn is_tuple_retry(f: &[u8], out: &[u8], ip_len: usize) -> bool {
    let at = ETH_LEN + ip_len;
    let byte = |p: &[u8], i: usize| p.get(i).copied().unwrap_or(0);
    let word = |p: &[u8], i: usize| u16::from_be_bytes([byte(p, i), byte(p, i + 1)]);
    let v6 = ip_len == 40;
    let tcp = |p: &[u8]| byte(p, ETH_LEN + if v6 { 6 } else { 9 }) == 6;
    // TCP header and payload, from the IP header's length field.
    let l4_len = if v6 {
        word(f, ETH_LEN + 4)
    } else {
        word(f, ETH_LEN + 2).wrapping_sub(20)
    };
    tcp(f)
        && tcp(out)
        && byte(f, at + 13) & (RST | ACK | SYN | FIN) == ACK
        && usize::from(l4_len) == usize::from(byte(f, at + 12) >> 4) * 4
        && byte(out, at + 13) == SYN
}

fn hex(f: &[u8]) -> String {
    f.iter().map(|b| format!("{b:02x}")).collect()
}

fn config() -> Config {
    let bs = backends();
    let svc = |vip_port: u16, proto, port: u16| {
        Service::plain(
            (VIP, vip_port).into(),
            proto,
            bs.iter().map(|b| SocketAddr::from((*b, port))).collect(),
        )
    };
    let dsr = |port: u16, proto, mode| {
        let mut s = svc(port, proto, port);
        s.mode = mode;
        s
    };
    let mut c = huddle_user::kernel::prog_run::config(
        vec![
            svc(80, Proto::Tcp, 8080),
            svc(53, Proto::Udp, 5353),
            dsr(DSR_L2, Proto::Tcp, Mode::DsrL2),
            dsr(DSR_IPIP[0].0, Proto::Tcp, Mode::DsrIpip),
            dsr(DSR_IPIP[1].0, Proto::Udp, Mode::DsrIpip),
        ],
        NAT,
        4096,
        1024,
    );
    c.encap_prefix = Some(ENCAP_PREFIX.parse().unwrap());
    let b6 = backends6();
    let svc6 = |vip_port: u16, port: u16, mode| {
        let mut s = Service::plain(
            (VIP6, vip_port).into(),
            Proto::Tcp,
            b6.iter().map(|b| SocketAddr::from((*b, port))).collect(),
        );
        s.mode = mode;
        s
    };
    c.services.push(svc6(80, 8080, Mode::Snat));
    c.services.push(svc6(V6_DSR, V6_DSR, Mode::DsrL2));
    c.services.push(svc6(V6_IPIP, V6_IPIP, Mode::DsrIpip));
    c.snat_ips6 = vec![SNAT6];
    c
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn a_fuzzed_packet_path_never_rewrites_wrongly() {
    require_root();
    let cases = env_u64("HUDDLE_FUZZ_CASES", 1_000_000);
    let seed = env_u64("HUDDLE_FUZZ_SEED", 0x4855_4444_4c45);
    let mut neigh = backends();
    neigh.extend_from_slice(&CLIENTS);
    let mut env =
        ProgRun::new(&unique("fuzz"), &config(), &neigh).expect("PROG_TEST_RUN namespace");
    env.dp.set_encap6(SNAT6).unwrap();
    for n in backends6().into_iter().chain(CLIENTS6) {
        env.neighbour6(n).unwrap();
    }
    let mut g = Gen {
        nat: Vec::new(),
        nat6: Vec::new(),
    };
    let mut clients = std::collections::HashSet::new();
    let mut clients6 = std::collections::HashSet::new();
    let mut tally = [0u64; 5];
    let mut reasons = std::collections::BTreeMap::<&str, u64>::new();
    for case in 0..cases {
        let mut r = Rng(seed ^ case.wrapping_mul(0x2545_F491_4F6C_DD1D));
        let mut f = g.frame(&mut r);
        if r.chance(50) {
            for _ in 0..=r.below(2) {
                Gen::mutate(&mut f, &mut r);
            }
            if r.chance(50) {
                fix_checksums(&mut f);
            }
        }
        if f.len() < ETH_LEN {
            f.resize(ETH_LEN, 0); // the kernel refuses shorter test frames
        }
        let (verdict, out) = env.run(&f).unwrap_or_else(|e| {
            panic!(
                "case {case} (seed {seed:#x}): PROG_TEST_RUN failed: {e:#}\ninput {}",
                hex(&f)
            )
        });
        let fail = |why: &str| -> ! {
            panic!(
                "case {case} (seed {seed:#x}, HUDDLE_FUZZ_SEED={seed} to replay): {why}\nverdict {verdict}\ninput  {}\noutput {}",
                hex(&f),
                hex(&out)
            )
        };
        tally[verdict.min(4) as usize] += 1;
        if let Some(why) = v6_checked(&f, verdict, &out, &mut g.nat6, &mut clients6) {
            match why {
                Ok(what) => *reasons.entry(what).or_default() += 1,
                Err(e) => fail(e),
            }
            continue;
        }
        if guarded_unbalanced(&f) {
            if verdict != XDP_DROP || out != f {
                fail("not balanced, to a VIP or a backend: not dropped unchanged");
            }
            *reasons
                .entry("not balanced, to a VIP or a backend: dropped")
                .or_default() += 1;
            continue;
        }
        if let Some(why) = icmp_checked(&f, verdict, &out, &clients) {
            match why {
                Ok(what) => *reasons.entry(what).or_default() += 1,
                Err(e) => fail(e),
            }
            continue;
        }
        if let Some(why) = refused(&f) {
            *reasons.entry(why).or_default() += 1;
            if verdict != XDP_PASS || out != f {
                fail(&format!("refused input ({why}) was not passed unchanged"));
            }
            continue;
        }
        let ((src, _sport), (dst, dport)) = endpoints(&f);
        let proto = f[ETH_LEN + 9];
        let service = SERVICES
            .iter()
            .find(|(p, pr, _)| dst == VIP && *p == dport && *pr == proto);
        let reply = dst == BALANCER_IP && (NAT.min..=NAT.max).contains(&dport);
        if dst == VIP && (dport == DSR_L2 || DSR_IPIP.contains(&(dport, proto))) {
            match dsr_checked(&f, verdict, &out, dport == DSR_L2 && proto == 6) {
                Ok(what) => *reasons.entry(what).or_default() += 1,
                Err(e) => fail(e),
            }
            continue;
        }
        match verdict {
            XDP_PASS if out == f => {
                *reasons.entry("passed").or_default() += 1;
            }
            XDP_DROP => {
                if service.is_none() {
                    fail("dropped traffic that is not a service's");
                }
            }
            // XDP_PASS with a changed packet: rewritten, then handed to the
            // kernel because the FIB had no next hop for it.
            XDP_PASS | XDP_TX | XDP_REDIRECT => {
                if verdict == XDP_PASS {
                    *reasons
                        .entry("rewritten, passed to the kernel")
                        .or_default() += 1;
                }
                if service.is_none() && !reply {
                    fail("rewrote traffic that is not for a service");
                }
                if reply && is_retry(&f, &out) {
                    // A backend refused a client's SYN: the RST came out
                    // as that SYN toward another backend.
                    let ((osrc, osport), (odst, odport)) = endpoints(&out);
                    if osrc != BALANCER_IP
                        || !backends().contains(&odst)
                        || odst == src
                        || odport != 8080
                        || !(NAT.min..=NAT.max).contains(&osport)
                    {
                        fail("a retried SYN not from the SNAT address to another backend");
                    }
                    if !checksums_valid(&out) {
                        fail("a retried SYN with a bad checksum");
                    }
                    let ack = u32::from_be_bytes(f[ETH_LEN + 28..ETH_LEN + 32].try_into().unwrap());
                    let seq =
                        u32::from_be_bytes(out[ETH_LEN + 24..ETH_LEN + 28].try_into().unwrap());
                    if seq.wrapping_add(1) != ack {
                        fail("a retried SYN whose sequence number the refusal did not acknowledge");
                    }
                    *reasons.entry("refused SYN retried").or_default() += 1;
                    if g.nat.len() < 4096 {
                        g.nat.push((odst, osport, proto));
                    }
                    continue;
                }
                if reply && is_tuple_retry(&f, &out, 20) {
                    // A backend's TIME_WAIT refused a client's SYN: its
                    // ACK came out as that SYN toward the same backend
                    // from another tuple.
                    let ((osrc, osport), (odst, odport)) = endpoints(&out);
                    if osrc != BALANCER_IP
                        || odst != src
                        || odport != 8080
                        || osport == dport
                        || !(NAT.min..=NAT.max).contains(&osport)
                    {
                        fail("a resent SYN not from another tuple to the same backend");
                    }
                    if !checksums_valid(&out) {
                        fail("a resent SYN with a bad checksum");
                    }
                    *reasons.entry("SYN resent from another tuple").or_default() += 1;
                    if g.nat.len() < 4096 {
                        g.nat.push((odst, osport, proto));
                    }
                    continue;
                }
                if out.len() != f.len() {
                    fail("length changed");
                }
                let (po, pl) = payload(&f);
                if out[po..po + pl] != f[po..po + pl] {
                    fail("payload changed");
                }
                if checksums_valid(&f) && !checksums_valid(&out) {
                    fail("a valid packet came out with a bad checksum");
                }
                let ((osrc, osport), (odst, odport)) = endpoints(&out);
                if let Some((_, _, bport)) = service {
                    if osrc != BALANCER_IP || !backends().contains(&odst) || odport != *bport {
                        fail("not from the SNAT address to a ring backend's port");
                    }
                    if !(NAT.min..=NAT.max).contains(&osport) {
                        fail("NAT port outside the range");
                    }
                    if g.nat.len() < 4096 {
                        g.nat.push((odst, osport, proto));
                    }
                    clients.insert(src);
                } else {
                    let vport = SERVICES
                        .iter()
                        .find(|(_, pr, _)| *pr == proto)
                        .map_or(0, |s| s.0);
                    if osrc != VIP || osport != vport || !clients.contains(&odst) {
                        fail("reply not translated back to VIP -> a client that opened a flow");
                    }
                    if !backends().contains(&src) {
                        fail("translated a reply that no backend sent");
                    }
                }
            }
            _ => fail("unexpected verdict"),
        }
    }
    println!(
        "{cases} fuzzed packets (seed {seed:#x}): pass {}, tx {}, redirect {}, drop {}; refusals and passes by reason: {reasons:?}",
        tally[2], tally[3], tally[4], tally[1]
    );
    assert!(
        tally[3] > cases / 20,
        "too few packets were rewritten to test much"
    );
}
