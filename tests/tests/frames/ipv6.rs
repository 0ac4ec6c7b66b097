//! IPv6 on crafted frames (BPF_PROG_TEST_RUN), the IPv6 program reached
//! through the main one's tail call: a SYN to an IPv6 VIP leaves from the
//! IPv6 SNAT address to a backend, byte for byte, the backend's answer
//! comes back as from the VIP, an L2 DSR frame changes only its MACs, an
//! IPv6-in-IPv6 one carries the client's packet after an outer header (or,
//! too big for the path once wrapped, is answered with "packet too big"),
//! ICMPv6 errors about a source-NATed flow reach its client translated,
//! a backend's refusal of a SYN is rebuilt into that SYN toward another
//! backend, and what the program does not parse (extension headers) passes
//! untouched.

use huddle_user::{
    config::{Mode, PortRange, Proto, Service},
    kernel::packet::{
        checksums6_valid, icmp6_checksum_valid, icmp6_error, tcp6, tcp6_options, ACK, PSH, RST, SYN,
    },
    kernel::prog_run::{mac_of6, ProgRun, BALANCER_MAC},
};
use std::net::{Ipv6Addr, SocketAddr};
use testbed::{require_root, unique};

use huddle_common::verdict::{XDP_DROP, XDP_PASS, XDP_TX};

const VIP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0x100, 0, 0, 0, 0, 1);
const CLIENT: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 2);
const SNAT: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 1);
const NAT: PortRange = PortRange {
    min: 20000,
    max: 32767,
};

fn backend(i: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x11 + i)
}

fn env(tag: &str) -> ProgRun {
    require_root();
    let bs = [backend(0), backend(1), backend(2)];
    let service = |port: u16, to: u16, mode: Mode| {
        let mut s = Service::plain(
            (VIP, port).into(),
            Proto::Tcp,
            bs.iter().map(|b| SocketAddr::from((*b, to))).collect(),
        );
        s.mode = mode;
        s
    };
    let mut cfg = huddle_user::kernel::prog_run::config(
        vec![
            service(80, 8080, Mode::Snat),
            service(8080, 8080, Mode::DsrL2),
            service(9090, 9090, Mode::DsrIpip),
        ],
        NAT,
        4096,
        1024,
    );
    cfg.snat_ips6 = vec![SNAT];
    let env = ProgRun::new(&unique(tag), &cfg, &[]).expect("PROG_TEST_RUN namespace");
    for n in bs.iter().chain([CLIENT].iter()) {
        env.neighbour6(*n).unwrap();
    }
    env
}

/// A client's frame from port `sport` to the VIP's port `vport`.
fn from_client(sport: u16, vport: u16, tcp: (u8, u32, u32), payload: &[u8]) -> Vec<u8> {
    tcp6(
        (CLIENT, sport),
        (VIP, vport),
        tcp,
        payload,
        (mac_of6(CLIENT), BALANCER_MAC),
    )
}

/// The balancer's frame to the client's port `sport` from the VIP's
/// `vport`.
fn to_client(sport: u16, vport: u16, tcp: (u8, u32, u32), payload: &[u8]) -> Vec<u8> {
    tcp6(
        (VIP, vport),
        (CLIENT, sport),
        tcp,
        payload,
        (BALANCER_MAC, mac_of6(CLIENT)),
    )
}

fn by_mac(out: &[u8]) -> Ipv6Addr {
    (0..3)
        .map(backend)
        .find(|b| out[..6] == mac_of6(*b))
        .unwrap_or_else(|| panic!("no backend has MAC {:02x?}", &out[..6]))
}

#[test]
fn an_ipv6_syn_is_source_natted_to_a_backend_and_its_answer_translated_back() {
    let env = env("v6-snat");
    let syn = from_client(40000, 80, (SYN, 1000, 0), &[]);
    let (verdict, out) = env.run(&syn).unwrap();
    assert_eq!(verdict, XDP_TX);
    let b = by_mac(&out);
    let nat_port = u16::from_be_bytes([out[54], out[55]]);
    assert!((NAT.min..=NAT.max).contains(&nat_port), "{nat_port}");
    let want = tcp6(
        (SNAT, nat_port),
        (b, 8080),
        (SYN, 1000, 0),
        &[],
        (BALANCER_MAC, mac_of6(b)),
    );
    assert_eq!(out, want, "the SYN from the IPv6 SNAT address to {b}");
    assert!(checksums6_valid(&out));
    // The backend's SYN-ACK: back to the client, from the VIP.
    let synack = tcp6(
        (b, 8080),
        (SNAT, nat_port),
        (SYN | ACK, 7000, 1001),
        &[],
        (mac_of6(b), BALANCER_MAC),
    );
    let (verdict, out) = env.run(&synack).unwrap();
    assert_eq!(verdict, XDP_TX);
    let want = to_client(40000, 80, (SYN | ACK, 7000, 1001), &[]);
    assert_eq!(out, want, "the SYN-ACK as from the VIP");
    // The handshake's ACK and a request go to the same tuple.
    for (flags, payload) in [(ACK, &b""[..]), (ACK | PSH, &b"GET / HTTP/1.1\r\n\r\n"[..])] {
        let f = from_client(40000, 80, (flags, 1001, 7001), payload);
        let (verdict, out) = env.run(&f).unwrap();
        assert_eq!(verdict, XDP_TX);
        let want = tcp6(
            (SNAT, nat_port),
            (b, 8080),
            (flags, 1001, 7001),
            payload,
            (BALANCER_MAC, mac_of6(b)),
        );
        assert_eq!(out, want);
    }
    let st = env.dp.service_stats(env.dp.services[0].id).unwrap();
    assert_eq!((st.half_open, st.promoted), (1, 1));
}

#[test]
fn an_ipv6_l2_dsr_frame_changes_only_its_macs_and_extension_headers_to_the_vip_drop() {
    let env = env("v6-dsr");
    let syn = from_client(41000, 8080, (SYN, 5000, 0), &[]);
    let (verdict, out) = env.run(&syn).unwrap();
    assert_eq!(verdict, XDP_TX);
    let b = by_mac(&out);
    assert_eq!(out[6..12], BALANCER_MAC);
    assert_eq!(out[12..], syn[12..], "only the MAC addresses change");
    // A hop-by-hop options header before TCP: not parsed, so not
    // balanced; to the VIP, so dropped rather than left to a kernel that
    // would forward it (`GUARDED`).
    let mut ext = syn.clone();
    ext[20] = 0; // next header: hop-by-hop
    let payload_len = u16::from_be_bytes([ext[18], ext[19]]) + 8;
    ext[18..20].copy_from_slice(&payload_len.to_be_bytes());
    ext.splice(54..54, [6u8, 0, 1, 4, 0, 0, 0, 0]);
    let (verdict, out) = env.run(&ext).unwrap();
    assert_eq!((verdict, &out), (XDP_DROP, &ext));
    let g = env.dp.global_stats().unwrap();
    assert_eq!((g.pass_v6_ext, g.drop_guarded), (0, 1));
    let _ = b;
}

#[test]
fn an_ipv6_in_ipv6_frame_carries_the_clients_packet_after_an_outer_header() {
    let mut env = env("v6-ipip");
    env.dp.set_encap6(SNAT).unwrap();
    let syn = from_client(42000, 9090, (SYN, 7000, 0), &[]);
    let (verdict, out) = env.run(&syn).unwrap();
    assert_eq!(verdict, XDP_TX);
    assert_eq!(out.len(), syn.len() + 40);
    let b = by_mac(&out);
    let outer = &out[14..54];
    assert_eq!(outer[0] >> 4, 6, "version");
    assert_eq!(
        u16::from_be_bytes([outer[4], outer[5]]) as usize,
        syn.len() - 14,
        "payload length: the whole inner packet"
    );
    assert_eq!((outer[6], outer[7]), (41, 64), "next header, hop limit");
    assert_eq!(outer[8..24], SNAT.octets(), "outer source");
    assert_eq!(outer[24..40], b.octets(), "outer destination: the backend");
    assert_eq!(out[54..], syn[14..], "the client's packet, unchanged");
    // The same flow keeps its flow label.
    let ack = from_client(42000, 9090, (ACK, 7001, 1), &[]);
    let (_, out2) = env.run(&ack).unwrap();
    assert_eq!(out2[14..18], out[14..18], "flow label");
}

#[test]
fn a_packet_too_big_once_wrapped_gets_packet_too_big_from_the_vip() {
    let mut env = env("v6-mtu");
    env.dp.set_encap6(SNAT).unwrap();
    env.ns.ip(&["link", "set", "hb0", "mtu", "1400"]).unwrap();
    let frame = |flags: u8, payload: &[u8]| from_client(43000, 9090, (flags, 7001, 1), payload);
    let syn = from_client(43000, 9090, (SYN, 7000, 0), &[]);
    for f in [syn, frame(ACK, &[])] {
        assert_eq!(env.run(&f).unwrap().0, XDP_TX);
    }
    // The next-hop cache expires: the first packet after, a big one,
    // still learns the MTU.
    env.dp.refresh_next_hops().unwrap();
    // 1,400 bytes of IPv6: fits the link, not once 40 more are in front.
    let big = frame(ACK | PSH, &[0x61; 1340]);
    let (verdict, out) = env.run(&big).unwrap();
    assert_eq!(verdict, XDP_TX, "answered back out");
    // As much of the packet as keeps the answer within 1,280 bytes.
    let want = icmp6_error(
        (2, 0, 1360u32.to_be_bytes()),
        VIP,
        CLIENT,
        &big[14..14 + 1232],
        (BALANCER_MAC, mac_of6(CLIENT)),
    );
    assert_eq!(out.len(), 14 + 1280);
    assert_eq!(out, want, "ICMPv6 packet too big, MTU 1360, from the VIP");
    assert!(icmp6_checksum_valid(&out));
    let g = env.dp.global_stats().unwrap();
    assert_eq!((g.icmp_too_big, g.encap), (1, 2));
    // One that fits is wrapped as ever.
    let fits = frame(ACK | PSH, &[0x61; 1300]);
    let (verdict, out) = env.run(&fits).unwrap();
    assert_eq!(verdict, XDP_TX);
    assert_eq!(out.len(), fits.len() + 40);
    assert_eq!(out[54..], fits[14..]);
    assert_eq!(env.dp.global_stats().unwrap().icmp_too_big, 1);
}

#[test]
fn icmpv6_errors_about_a_translated_flow_reach_its_client_translated_back() {
    let env = env("v6-icmp");
    let syn = from_client(44000, 80, (SYN, 1000, 0), &[]);
    let (verdict, out) = env.run(&syn).unwrap();
    assert_eq!(verdict, XDP_TX);
    let b = by_mac(&out);
    let nat_port = u16::from_be_bytes([out[54], out[55]]);
    let sent = &out;
    let router: Ipv6Addr = "fd00:213::fe".parse().unwrap();
    // From the backend, quoting the header and 8 bytes; from a router on
    // the way, quoting the whole SYN (its TCP checksum too).
    for (kind, from, quoted, shown_from) in [(2, b, 48, VIP), (1, router, 60, router)] {
        let rest = if kind == 2 {
            1280u32.to_be_bytes()
        } else {
            [0; 4]
        };
        let err = icmp6_error(
            (kind, 0, rest),
            from,
            SNAT,
            &sent[14..14 + quoted],
            (mac_of6(b), BALANCER_MAC),
        );
        let (verdict, out) = env.run(&err).unwrap();
        assert_eq!(verdict, XDP_TX, "from {from}");
        let want = icmp6_error(
            (kind, 0, rest),
            shown_from,
            CLIENT,
            &syn[14..14 + quoted],
            (BALANCER_MAC, mac_of6(CLIENT)),
        );
        assert_eq!(out, want, "ICMPv6 from {from}, translated for the client");
        assert!(icmp6_checksum_valid(&out));
    }
    assert_eq!(env.dp.global_stats().unwrap().icmp_translated, 2);
    // About a tuple the balancer never used, or not an error: the kernel's.
    let stranger = tcp6(
        (SNAT, nat_port ^ 1),
        (b, 8080),
        (SYN, 1000, 0),
        &[],
        (BALANCER_MAC, mac_of6(b)),
    );
    let unknown = icmp6_error(
        (1, 4, [0; 4]),
        b,
        SNAT,
        &stranger[14..14 + 48],
        (mac_of6(b), BALANCER_MAC),
    );
    let echo = icmp6_error(
        (128, 0, [0, 1, 0, 1]),
        b,
        SNAT,
        b"ping",
        (mac_of6(b), BALANCER_MAC),
    );
    for f in [unknown, echo] {
        let (verdict, out) = env.run(&f).unwrap();
        assert_eq!((verdict, &out), (XDP_PASS, &f));
    }
    assert_eq!(env.dp.global_stats().unwrap().icmp_translated, 2);
    // Quoting the flow's tuple but not the client's sequence number: a
    // forgery, dropped.
    let forged_syn = tcp6(
        (SNAT, nat_port),
        (b, 8080),
        (SYN, 1000 + (1 << 31), 0),
        &[],
        (BALANCER_MAC, mac_of6(b)),
    );
    let forged = icmp6_error(
        (1, 4, [0; 4]),
        router,
        SNAT,
        &forged_syn[14..14 + 48],
        (mac_of6(b), BALANCER_MAC),
    );
    assert_eq!(env.run(&forged).unwrap().0, XDP_DROP);
    let g = env.dp.global_stats().unwrap();
    assert_eq!((g.icmp_translated, g.icmp_unproven), (2, 1));
}

/// MSS 1440, SACK permitted, timestamps, NOP, window scale 7.
const SYN_OPTIONS: [u8; 20] = [
    2, 4, 0x05, 0xa0, 4, 2, 8, 10, 0, 1, 0xe2, 0x40, 0, 0, 0, 0, 1, 3, 3, 7,
];

#[test]
fn a_refused_ipv6_syn_goes_to_another_backend_with_its_options() {
    let env = env("v6-retry");
    let client_macs = (mac_of6(CLIENT), BALANCER_MAC);
    let syn = tcp6_options(
        (CLIENT, 45000),
        (VIP, 80),
        (SYN, 5000, 0),
        &SYN_OPTIONS,
        &[],
        client_macs,
    );
    let (verdict, out) = env.run(&syn).unwrap();
    assert_eq!(verdict, XDP_TX);
    let b1 = by_mac(&out);
    let port1 = u16::from_be_bytes([out[54], out[55]]);
    let refusal = |b: Ipv6Addr, port: u16| {
        tcp6(
            (b, 8080),
            (SNAT, port),
            (RST | ACK, 0, 5001),
            &[],
            (mac_of6(b), BALANCER_MAC),
        )
    };
    // b1 refuses: the RST comes back out as the client's SYN, byte for
    // byte, toward another backend from a NAT tuple of its own.
    let (verdict, out) = env.run(&refusal(b1, port1)).unwrap();
    assert_eq!(verdict, XDP_TX, "the refusal must be turned into a SYN");
    let b2 = by_mac(&out);
    assert_ne!(b2, b1, "retried on the backend that refused");
    let port2 = u16::from_be_bytes([out[54], out[55]]);
    let want = tcp6_options(
        (SNAT, port2),
        (b2, 8080),
        (SYN, 5000, 0),
        &SYN_OPTIONS,
        &[],
        (BALANCER_MAC, mac_of6(b2)),
    );
    assert_eq!(out, want, "the rebuilt SYN");
    assert!(checksums6_valid(&out));
    // The refusing backend's tuple is forgotten; b2's SYN-ACK reaches the
    // client from the VIP.
    let (verdict, _) = env.run(&refusal(b1, port1)).unwrap();
    assert_eq!(verdict, XDP_PASS);
    let synack = tcp6(
        (b2, 8080),
        (SNAT, port2),
        (SYN | ACK, 300, 5001),
        &[],
        (mac_of6(b2), BALANCER_MAC),
    );
    let (verdict, out) = env.run(&synack).unwrap();
    assert_eq!(verdict, XDP_TX);
    let want = to_client(45000, 80, (SYN | ACK, 300, 5001), &[]);
    assert_eq!(out, want, "the new backend's SYN-ACK, as from the VIP");
}
