//! The real XDP program on crafted frames (BPF_PROG_TEST_RUN), fixture
//! style: input frame from the builder, expected verdict, expected bytes.

use huddle_common::headers::ETH_LEN;
use huddle_common::{BackendStats, FlowKey, GlobalStats, NatKey, FAMILY_V4};
use huddle_user::{
    config::{Config, PortRange, Proto, Service},
    kernel::dataplane::keys::ip_bytes,
    kernel::packet::{
        checksums_valid, endpoints, icmp_checksums_valid, icmp_error, Frame, ACK, FIN, PSH, RST,
        SYN,
    },
    kernel::prog_run::{mac_of, ProgRun, BALANCER_IP, BALANCER_MAC},
};
use std::{
    collections::HashMap,
    net::{Ipv4Addr, SocketAddr},
};
use testbed::{require_root, unique};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
/// Half-open slots of `config`'s balancers.
const HALF_OPEN_SLOTS: u32 = 1024;

const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);
const NAT: PortRange = PortRange {
    min: 20000,
    max: 32767,
};

fn backend(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 11 + i)
}

fn config(backends: &[Ipv4Addr], udp: bool) -> Config {
    let service = |vip_port: u16, proto, port: u16| {
        Service::plain(
            (VIP, vip_port).into(),
            proto,
            backends
                .iter()
                .map(|b| SocketAddr::from((*b, port)))
                .collect(),
        )
    };
    let mut services = vec![service(80, Proto::Tcp, 8080)];
    if udp {
        services.push(service(53, Proto::Udp, 5353));
    }
    huddle_user::kernel::prog_run::config(services, NAT, 4096, HALF_OPEN_SLOTS)
}

/// An environment with three backends, all neighbours resolved.
fn env(tag: &str) -> ProgRun {
    require_root();
    let backends = [backend(0), backend(1), backend(2)];
    let mut neigh = backends.to_vec();
    neigh.push(CLIENT);
    ProgRun::new(&unique(tag), &config(&backends, true), &neigh)
        .expect("set up PROG_TEST_RUN namespace")
}

fn client_frame(sport: u16) -> Frame {
    Frame::tcp((CLIENT, sport), (VIP, 80)).macs(mac_of(CLIENT), BALANCER_MAC)
}

/// Sends a SYN and checks it came out as SYN from the SNAT address to one
/// of `ring`, byte for byte. Returns (backend, NAT port).
fn open_flow(env: &ProgRun, sport: u16, ring: &[Ipv4Addr]) -> (Ipv4Addr, u16) {
    let input = client_frame(sport).syn().build();
    let (verdict, out) = env.run(&input).unwrap();
    assert_eq!(verdict, XDP_TX, "SYN to the VIP must be sent back out");
    let ((src, nat_port), (dst, dport)) = endpoints(&out);
    assert_eq!(src, BALANCER_IP);
    assert!(
        ring.contains(&dst),
        "backend {dst} is not in the ring {ring:?}"
    );
    assert_eq!(dport, 8080);
    assert!(
        (NAT.min..=NAT.max).contains(&nat_port),
        "NAT port {nat_port} outside {NAT}"
    );
    let expected = Frame::tcp((BALANCER_IP, nat_port), (dst, 8080))
        .syn()
        .macs(BALANCER_MAC, mac_of(dst))
        .build();
    assert_eq!(
        out, expected,
        "rewritten SYN differs from the expected bytes"
    );
    assert!(checksums_valid(&out));
    (dst, nat_port)
}

/// Opens a flow and completes its handshake: SYN, the backend's SYN-ACK,
/// and the client's ACK of it, which moves the flow from the half-open
/// table to the flow table. Returns (backend, NAT port).
fn establish(env: &ProgRun, sport: u16, ring: &[Ipv4Addr]) -> (Ipv4Addr, u16) {
    let (b, port) = open_flow(env, sport, ring);
    let synack = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(SYN | ACK)
        .seq_ack(7000, 1001)
        .macs(mac_of(b), BALANCER_MAC);
    assert_eq!(env.run(&synack.build()).unwrap().0, XDP_TX);
    let ack = client_frame(sport).flags(ACK).seq_ack(1001, 7001);
    let (verdict, out) = env.run(&ack.build()).unwrap();
    assert_eq!(verdict, XDP_TX);
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 8080)));
    (b, port)
}

#[test]
fn syn_is_rewritten_to_a_ring_backend_and_the_reply_translated_back() {
    let env = env("pr-syn");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, nat_port) = open_flow(&env, 40000, &ring);

    // Data from the client on the same flow goes to the same backend.
    let data = client_frame(40000)
        .flags(ACK | PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n")
        .build();
    let (verdict, out) = env.run(&data).unwrap();
    assert_eq!(verdict, XDP_TX);
    let expected = Frame::tcp((BALANCER_IP, nat_port), (b, 8080))
        .flags(ACK | PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n")
        .macs(BALANCER_MAC, mac_of(b))
        .build();
    assert_eq!(out, expected);

    // The backend's reply is translated back to VIP -> client.
    let reply = Frame::tcp((b, 8080), (BALANCER_IP, nat_port))
        .flags(SYN | ACK)
        .macs(mac_of(b), BALANCER_MAC)
        .build();
    let (verdict, out) = env.run(&reply).unwrap();
    assert_eq!(verdict, XDP_TX);
    let expected = Frame::tcp((VIP, 80), (CLIENT, 40000))
        .flags(SYN | ACK)
        .macs(BALANCER_MAC, mac_of(CLIENT))
        .build();
    assert_eq!(
        out, expected,
        "translated reply differs from the expected bytes"
    );

    let id = env.dp.services[0].backend_ids[ring.iter().position(|x| *x == b).unwrap()];
    let st: BackendStats = env.dp.backend_stats(id).unwrap();
    assert_eq!(
        (st.pkts_to, st.pkts_from, st.syns, st.flows_new),
        (2, 1, 1, 0),
        "half-open until the client acknowledges the SYN-ACK: {st:?}"
    );
    // An ACK of the wrong sequence number does not establish it...
    forward(&env, client_frame(40000).flags(ACK).seq_ack(1001, 555));
    assert_eq!(env.dp.backend_stats(id).unwrap().flows_new, 0);
    // ...the right one does (the SYN-ACK above carried seq 1000).
    forward(&env, client_frame(40000).flags(ACK).seq_ack(1001, 1001));
    assert_eq!(env.dp.backend_stats(id).unwrap().flows_new, 1);
    let sv = env.dp.service_stats(0).unwrap();
    assert_eq!((sv.half_open, sv.promoted), (1, 1));
}

/// Runs `frame` and checks the program forwarded it.
fn forward(env: &ProgRun, frame: Frame) {
    let (verdict, _) = env.run(&frame.build()).unwrap();
    assert_eq!(verdict, XDP_TX);
}

#[test]
fn each_request_turn_gives_one_latency_sample_to_its_backend() {
    let env = env("pr-lat");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, nat_port) = open_flow(&env, 40100, &ring);
    let ids = &env.dp.services[0].backend_ids;
    let id = ids[ring.iter().position(|x| *x == b).unwrap()];
    let from_backend =
        || Frame::tcp((b, 8080), (BALANCER_IP, nat_port)).macs(mac_of(b), BALANCER_MAC);
    assert_ne!(
        env.dp.pulse(id).unwrap().syn_wait_ns,
        0,
        "a SYN is owed an answer"
    );
    forward(&env, from_backend().flags(SYN | ACK));
    assert_eq!(env.dp.pulse(id).unwrap().syn_wait_ns, 0);
    forward(&env, client_frame(40100).flags(ACK).seq_ack(1001, 1001));

    // Two requests on one keep-alive connection: two samples, each timed
    // from the request to the first data back, not to a bare ACK.
    for round in 1..=2u64 {
        forward(
            &env,
            client_frame(40100)
                .flags(ACK | PSH)
                .payload(b"GET / HTTP/1.1\r\n\r\n"),
        );
        // More request segments do not restart the turn.
        forward(
            &env,
            client_frame(40100)
                .flags(ACK | PSH)
                .payload(b"X-More: 1\r\n\r\n"),
        );
        assert_ne!(
            env.dp.pulse(id).unwrap().turn_wait_ns,
            0,
            "a request is owed an answer"
        );
        std::thread::sleep(std::time::Duration::from_millis(3));
        forward(&env, from_backend().flags(ACK));
        assert_eq!(
            env.dp.backend_stats(id).unwrap().answered,
            round - 1,
            "a bare ACK is no answer"
        );
        forward(
            &env,
            from_backend()
                .flags(ACK | PSH)
                .payload(b"HTTP/1.1 200 OK\r\n"),
        );
        forward(&env, from_backend().flags(ACK | PSH).payload(b"body"));
        let st = env.dp.backend_stats(id).unwrap();
        assert_eq!(
            (st.turns, st.answered, st.syn_acks),
            (round, round, 1),
            "{st:?}"
        );
        assert!(
            st.ttfb_ns >= round * 3_000_000,
            "time to first byte {} ns",
            st.ttfb_ns
        );
        assert_eq!(env.dp.pulse(id).unwrap().turn_wait_ns, 0);
    }
    let hist = env.dp.latency(id).unwrap();
    assert_eq!(hist.buckets.iter().sum::<u64>(), 2);
    let first = hist.buckets.iter().position(|n| *n > 0).unwrap();
    assert!(
        huddle_common::latency::bucket_bounds(first).1 > 3_000_000,
        "samples of at least 3 ms landed in bucket {first}"
    );
    for other in ids.iter().filter(|o| **o != id) {
        let st = env.dp.backend_stats(*other).unwrap();
        assert_eq!((st.turns, st.answered), (0, 0), "backend {other}: {st:?}");
        assert_eq!(
            env.dp.latency(*other).unwrap().buckets.iter().sum::<u64>(),
            0
        );
    }

    // A SYN answered by RST is a refused connection, not a sample.
    let (b2, port2) = open_flow(&env, 40101, &ring);
    let id2 = ids[ring.iter().position(|x| *x == b2).unwrap()];
    let before = env.dp.backend_stats(id2).unwrap();
    forward(
        &env,
        Frame::tcp((b2, 8080), (BALANCER_IP, port2))
            .flags(RST | ACK)
            .macs(mac_of(b2), BALANCER_MAC),
    );
    let after = env.dp.backend_stats(id2).unwrap();
    assert_eq!(after.refused, before.refused + 1);
    assert_eq!(after.syn_acks, before.syn_acks);
}

#[test]
fn udp_with_and_without_checksum_is_translated_both_ways() {
    let env = env("pr-udp");
    for (sport, zero) in [(41000u16, false), (41001, true)] {
        let mut f = Frame::udp((CLIENT, sport), (VIP, 53))
            .payload(b"query")
            .macs(mac_of(CLIENT), BALANCER_MAC);
        if zero {
            f = f.no_udp_checksum();
        }
        let (verdict, out) = env.run(&f.build()).unwrap();
        assert_eq!(verdict, XDP_TX);
        let ((src, nat_port), (dst, dport)) = endpoints(&out);
        assert_eq!((src, dport), (BALANCER_IP, 5353));
        let mut want = Frame::udp((BALANCER_IP, nat_port), (dst, 5353))
            .payload(b"query")
            .macs(BALANCER_MAC, mac_of(dst));
        if zero {
            want = want.no_udp_checksum();
        }
        assert_eq!(out, want.build(), "zero checksum: {zero}");
        let reply = Frame::udp((dst, 5353), (BALANCER_IP, nat_port))
            .payload(b"answer")
            .macs(mac_of(dst), BALANCER_MAC);
        let (verdict, out) = env.run(&reply.build()).unwrap();
        assert_eq!(verdict, XDP_TX);
        let want = Frame::udp((VIP, 53), (CLIENT, sport))
            .payload(b"answer")
            .macs(BALANCER_MAC, mac_of(CLIENT));
        assert_eq!(out, want.build());
    }
}

/// The program finds services through the live half of an index the
/// control plane rewrites on every reload: a service added is balanced
/// and one removed passes at once, through two reloads (both halves).
#[test]
fn services_added_or_removed_by_a_reload_are_balanced_or_passed_at_once() {
    let mut env = env("pr-svcidx");
    let backends = [backend(0), backend(1), backend(2)];
    let syn_to = |env: &ProgRun, sport: u16, port: u16| {
        let f = Frame::tcp((CLIENT, sport), (VIP, port))
            .syn()
            .macs(mac_of(CLIENT), BALANCER_MAC);
        env.run(&f.build()).unwrap().0
    };
    let udp_to = |env: &ProgRun, sport: u16| {
        let f = Frame::udp((CLIENT, sport), (VIP, 53))
            .payload(b"query")
            .macs(mac_of(CLIENT), BALANCER_MAC);
        env.run(&f.build()).unwrap().0
    };
    assert_eq!(syn_to(&env, 42000, 81), XDP_PASS, "no service on :81 yet");
    assert_eq!(udp_to(&env, 42001), XDP_TX);
    let mut reloaded = config(&backends, false);
    let extra = Service::plain(
        (VIP, 81).into(),
        Proto::Tcp,
        backends
            .iter()
            .map(|b| SocketAddr::from((*b, 8081)))
            .collect(),
    );
    reloaded.services.push(extra);
    env.dp.reconcile(&reloaded).unwrap();
    assert_eq!(syn_to(&env, 42002, 81), XDP_TX, "the service added");
    assert_eq!(syn_to(&env, 42003, 80), XDP_TX, "the service kept");
    assert_eq!(udp_to(&env, 42004), XDP_PASS, "the service removed");
    env.dp.reconcile(&config(&backends, true)).unwrap();
    assert_eq!(syn_to(&env, 42005, 81), XDP_PASS, "removed again");
    assert_eq!(udp_to(&env, 42006), XDP_TX, "back again");
    assert_eq!(syn_to(&env, 42007, 80), XDP_TX);
}

/// Frames that must come back unchanged with XDP_PASS.
#[test]
fn traffic_that_is_not_ours_passes_untouched() {
    let env = env("pr-pass");
    let syn = client_frame(40000).syn().build();
    let mut arp = vec![0xffu8; 6];
    arp.extend_from_slice(&mac_of(CLIENT));
    arp.extend_from_slice(&[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 1]);
    arp.extend_from_slice(&mac_of(CLIENT));
    arp.extend_from_slice(&CLIENT.octets());
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&BALANCER_IP.octets());
    let mut ipv6 = syn.clone();
    ipv6[12..14].copy_from_slice(&[0x86, 0xdd]);
    let mut vlan = syn[..12].to_vec();
    vlan.extend_from_slice(&[0x81, 0x00, 0x00, 0x05]);
    vlan.extend_from_slice(&syn[12..]);
    let mut options = syn.clone();
    options[ETH_LEN] = 0x46;
    let mut frag_mf = syn.clone();
    frag_mf[ETH_LEN + 6] = 0x20;
    let mut frag_off = syn.clone();
    frag_off[ETH_LEN + 7] = 0x10;
    let mut ihl_small = syn.clone();
    ihl_small[ETH_LEN] = 0x44;
    let mut v6_in_v4 = syn.clone();
    v6_in_v4[ETH_LEN] = 0x65;
    let mut long_total = syn.clone();
    long_total[ETH_LEN + 2..ETH_LEN + 4].copy_from_slice(&200u16.to_be_bytes());
    let mut short_total = syn.clone();
    short_total[ETH_LEN + 2..ETH_LEN + 4].copy_from_slice(&30u16.to_be_bytes());
    let mut bad_doff = syn.clone();
    bad_doff[ETH_LEN + 20 + 12] = 0x40;
    let mut big_doff = syn.clone();
    big_doff[ETH_LEN + 20 + 12] = 0xf0;
    let mut icmp = syn.clone();
    icmp[ETH_LEN + 9] = 1;
    let fixtures: Vec<(&str, Vec<u8>)> = vec![
        (
            "TCP to a non-VIP address",
            Frame::tcp((CLIENT, 40000), (Ipv4Addr::new(10, 213, 0, 99), 80))
                .syn()
                .build(),
        ),
        (
            "TCP to the VIP on another port",
            Frame::tcp((CLIENT, 40000), (VIP, 81)).syn().build(),
        ),
        (
            "UDP to the VIP's TCP port",
            Frame::udp((CLIENT, 40000), (VIP, 80)).build(),
        ),
        ("ARP request", arp),
        ("IPv6 ethertype", ipv6),
        ("VLAN-tagged frame", vlan),
        ("IPv4 with options", options),
        ("fragment with MF", frag_mf),
        ("fragment with an offset", frag_off),
        ("IHL below 5", ihl_small),
        ("version 6 in an IPv4 frame", v6_in_v4),
        ("total length beyond the frame", long_total),
        ("total length shorter than the headers", short_total),
        ("TCP data offset below 5", bad_doff),
        ("TCP data offset beyond the packet", big_doff),
        ("ICMP to the VIP", icmp),
        (
            "TCP ACK of an unknown flow to the VIP",
            client_frame(40001).flags(ACK).build(),
        ),
        (
            "reply to the NAT range without a NAT entry (the host's own traffic)",
            Frame::tcp((backend(0), 8080), (BALANCER_IP, 25000))
                .flags(SYN | ACK)
                .build(),
        ),
        (
            "SSH to the balancer",
            Frame::tcp((CLIENT, 50000), (BALANCER_IP, 22)).syn().build(),
        ),
    ];
    for (what, frame) in fixtures {
        let (verdict, out) = env.run(&frame).unwrap();
        assert_eq!(verdict, XDP_PASS, "{what}: verdict");
        assert_eq!(out, frame, "{what}: the frame was changed");
    }
    let g: GlobalStats = env.dp.global_stats().unwrap();
    // ARP and VLAN are neither family; the IPv6 frame goes to the IPv6
    // program, which finds it malformed or with extension headers.
    assert!(
        g.pass_ip_options >= 1
            && g.pass_fragment >= 2
            && g.pass_malformed + g.pass_v6_ext >= 7
            && g.pass_not_ipv4 >= 2,
        "{g:?}"
    );
}

#[test]
fn truncated_frames_are_never_rewritten() {
    let env = env("pr-trunc");
    for frame in [
        client_frame(40000).syn().payload(b"xyz").build(),
        Frame::udp((CLIENT, 41000), (VIP, 53)).payload(b"q").build(),
    ] {
        for len in 0..frame.len() {
            let cut = &frame[..len];
            if cut.len() < ETH_LEN {
                // The kernel refuses frames shorter than an Ethernet header.
                continue;
            }
            let (verdict, out) = env.run(cut).unwrap();
            assert_eq!(verdict, XDP_PASS, "frame cut at {len} bytes: verdict");
            assert_eq!(out, cut, "frame cut at {len} bytes was changed");
        }
    }
}

#[test]
fn unresolved_neighbour_hands_the_rewritten_packet_to_the_kernel() {
    require_root();
    // Backend with no neighbour entry.
    let env = ProgRun::new(
        &unique("pr-neigh"),
        &config(&[backend(5)], false),
        &[CLIENT],
    )
    .unwrap();
    let input = client_frame(40000).syn().build();
    let (verdict, out) = env.run(&input).unwrap();
    assert_eq!(verdict, XDP_PASS, "must go to the kernel, not be dropped");
    let ((src, nat_port), (dst, _)) = endpoints(&out);
    assert_eq!((src, dst), (BALANCER_IP, backend(5)));
    // Addresses rewritten and checksums valid; MACs left for the kernel.
    let expected = Frame::tcp((BALANCER_IP, nat_port), (backend(5), 8080))
        .syn()
        .macs(mac_of(CLIENT), BALANCER_MAC)
        .build();
    assert_eq!(out, expected);
    assert_eq!(env.dp.global_stats().unwrap().pass_no_neigh, 1);
}

/// Clients after `CLIENT` on its segment whose replies share its slot in
/// the per-CPU next-hop cache.
fn clients_sharing_a_hop_slot(n: usize) -> Vec<Ipv4Addr> {
    use huddle_common::{addr_v4, addr_words, client_hop_slot};
    let slot = client_hop_slot(addr_words(&addr_v4(CLIENT.octets())));
    (1u32..65_000)
        .map(|i| Ipv4Addr::from(u32::from(CLIENT) + i))
        .filter(|a| client_hop_slot(addr_words(&addr_v4(a.octets()))) == slot)
        .take(n)
        .collect()
}

#[test]
fn replies_to_clients_sharing_a_next_hop_slot_each_get_their_own_neighbour() {
    require_root();
    // One CPU: the cache is per CPU, and the clients must meet in one.
    pin_to(0);
    let others = clients_sharing_a_hop_slot(2);
    let (b_client, unresolved) = (others[0], others[1]);
    let backends = [backend(0)];
    let env = ProgRun::new(
        &unique("pr-hop"),
        &config(&backends, false),
        &[backend(0), CLIENT, b_client],
    )
    .unwrap();
    // A flow from each client; the third has no neighbour entry.
    let open = |client: Ipv4Addr| {
        let syn = Frame::tcp((client, 40000), (VIP, 80))
            .syn()
            .macs(mac_of(client), BALANCER_MAC);
        let (v, out) = env.run(&syn.build()).unwrap();
        assert_eq!(v, XDP_TX);
        endpoints(&out).0 .1
    };
    let ports: Vec<(Ipv4Addr, u16)> = [CLIENT, b_client, unresolved, CLIENT]
        .into_iter()
        .map(|c| (c, open(c)))
        .collect();
    let reply = |nat_port: u16| {
        Frame::tcp((backend(0), 8080), (BALANCER_IP, nat_port))
            .flags(SYN | ACK)
            .macs(mac_of(backend(0)), BALANCER_MAC)
            .build()
    };
    // Alternating clients in one slot: each reply takes its own client's
    // neighbour, never the one the slot held before.
    for (client, port) in ports.iter().chain(ports.iter()) {
        let (v, out) = env.run(&reply(*port)).unwrap();
        if *client == unresolved {
            assert_eq!(v, XDP_PASS, "no neighbour for {client}: the kernel's");
            continue;
        }
        assert_eq!(v, XDP_TX, "reply to {client}");
        let expected = Frame::tcp((VIP, 80), (*client, 40000))
            .flags(SYN | ACK)
            .macs(BALANCER_MAC, mac_of(*client))
            .build();
        assert_eq!(out, expected, "reply to {client}");
    }
    assert_eq!(env.dp.global_stats().unwrap().pass_no_neigh, 2);
}

#[test]
fn ring_swap_steers_new_flows_and_keeps_established_ones() {
    let env = env("pr-swap");
    let mut env = env;
    let ids = env.dp.services[0].backend_ids.clone();
    env.dp.swap_ring(0, &ids[..1]).unwrap();
    // Established (handshake complete): a half-open one could lose its
    // slot to one of the SYNs below when they hash to it (1,024 slots,
    // a fresh random seed each run: about one run in fifty).
    let (b, nat_port) = establish(&env, 42000, &[backend(0)]);
    assert_eq!(b, backend(0));
    for round in 0..20 {
        // Alternate the ring between backend 1 and backend 2 only.
        let only = if round % 2 == 0 { 1 } else { 2 };
        env.dp.swap_ring(0, &ids[only..=only]).unwrap();
        let (nb, _) = open_flow(&env, 43000 + round, &[backend(only as u8)]);
        assert_eq!(nb, backend(only as u8));
        // The established flow stays on backend 0.
        let (verdict, out) = env.run(&client_frame(42000).flags(ACK).build()).unwrap();
        assert_eq!(verdict, XDP_TX);
        assert_eq!(
            endpoints(&out),
            ((BALANCER_IP, nat_port), (backend(0), 8080))
        );
    }
    // An empty ring drops new flows (counted) but not established ones.
    env.dp.swap_ring(0, &[]).unwrap();
    let (verdict, _) = env.run(&client_frame(44000).syn().build()).unwrap();
    assert_eq!(verdict, XDP_DROP);
    assert_eq!(env.dp.service_stats(0).unwrap().drop_no_backend, 1);
    let (verdict, _) = env.run(&client_frame(42000).flags(ACK).build()).unwrap();
    assert_eq!(verdict, XDP_TX);
}

/// Round robin, a cursor per CPU: consecutive SYNs take the ring's
/// entries in order and go round; after a swap to a shorter ring, the
/// cursor, now past its end, wraps into it (here to its first entry).
#[test]
fn new_flows_take_the_ring_in_turn_and_a_shorter_ring_from_its_start() {
    let mut env = env("pr-turns");
    pin_to(0);
    let all = [backend(0), backend(1), backend(2)];
    let got: Vec<Ipv4Addr> = (0..7).map(|i| open_flow(&env, 46000 + i, &all).0).collect();
    let first = all.iter().position(|b| *b == got[0]).unwrap();
    let want: Vec<_> = (0..7).map(|i| all[(first + i) % 3]).collect();
    assert_eq!(got, want, "in turn");
    // Up to the ring's last entry, so the cursor stands at 2.
    let next = (first + 7) % 3;
    for i in 0..(5 - next) % 3 {
        open_flow(&env, 46100 + i as u16, &all);
    }
    let ids = env.dp.services[0].backend_ids.clone();
    env.dp.swap_ring(0, &ids[..2]).unwrap();
    let two = [backend(0), backend(1)];
    let got: Vec<Ipv4Addr> = (0..3).map(|i| open_flow(&env, 46200 + i, &two).0).collect();
    assert_eq!(
        got,
        [two[0], two[1], two[0]],
        "the shorter ring from its start"
    );
}

#[test]
fn flows_of_a_backend_marked_dead_move_to_the_ring() {
    let mut env = env("pr-move");
    let ids = env.dp.services[0].backend_ids.clone();
    env.dp.swap_ring(0, &ids[..1]).unwrap();
    let (b, _) = establish(&env, 42500, &[backend(0)]);
    assert_eq!(b, backend(0));
    // Backend 0 dies: out of the ring, and marked so its flows move.
    env.dp.swap_ring(0, &ids[1..2]).unwrap();
    env.dp
        .set_backend_flags(
            ids[0],
            (backend(0), 8080).into(),
            huddle_common::backend_flags::MOVE_FLOWS,
        )
        .unwrap();
    let data = client_frame(42500).flags(ACK | PSH).payload(b"more");
    let (verdict, out) = env.run(&data.build()).unwrap();
    assert_eq!(verdict, XDP_TX);
    let ((src, port), (dst, _)) = endpoints(&out);
    assert_eq!(
        (src, dst),
        (BALANCER_IP, backend(1)),
        "the flow moved to the ring"
    );
    assert!(checksums_valid(&out));
    assert_eq!(env.dp.backend_stats(ids[0]).unwrap().flows_moved, 1);
    // The new backend's answer (a RST, for TCP) reaches the client.
    let rst = Frame::tcp((backend(1), 8080), (BALANCER_IP, port))
        .flags(RST | ACK)
        .macs(mac_of(backend(1)), BALANCER_MAC)
        .build();
    let (verdict, out) = env.run(&rst).unwrap();
    assert_eq!(verdict, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 42500)));
    // It stays there: the next packet does not move again.
    let (_, out) = env.run(&data.build()).unwrap();
    assert_eq!(endpoints(&out).1 .0, backend(1));
    assert_eq!(env.dp.backend_stats(ids[0]).unwrap().flows_moved, 1);
    // Without the mark, an established flow stays on a backend out of the ring.
    env.dp
        .set_backend_flags(ids[0], (backend(0), 8080).into(), 0)
        .unwrap();
    let (b2, _) = {
        env.dp.swap_ring(0, &ids[..1]).unwrap();
        establish(&env, 42501, &[backend(0)])
    };
    env.dp.swap_ring(0, &ids[1..2]).unwrap();
    let (_, out) = env.run(&client_frame(42501).flags(ACK).build()).unwrap();
    assert_eq!(endpoints(&out).1 .0, b2);
}

#[test]
fn a_syn_flood_never_evicts_an_established_flow() {
    let env = env("pr-flood");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, port) = establish(&env, 47000, &ring);
    // 20,000 SYNs from spoofed sources: twenty times the half-open table
    // (1,024 here) and five times the flow table (4,096).
    for i in 0..20_000u32 {
        let src = Ipv4Addr::new(10, 213, 128 + (i >> 14) as u8, (i >> 6) as u8);
        let syn = Frame::tcp((src, 1024 + (i & 0x3fff) as u16), (VIP, 80))
            .syn()
            .macs(mac_of(CLIENT), BALANCER_MAC);
        let (v, _) = env.run(&syn.build()).unwrap();
        assert!(v == XDP_TX || v == XDP_PASS, "SYN {i}: verdict {v}");
    }
    let sv = env.dp.service_stats(0).unwrap();
    assert_eq!(sv.half_open, 20_001);
    assert_eq!(sv.promoted, 1);
    // The established flow still goes to its backend, and its replies
    // still find their NAT entry.
    let data = client_frame(47000).flags(ACK | PSH).payload(b"GET /");
    let (v, out) = env.run(&data.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 8080)));
    let reply = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(ACK | PSH)
        .payload(b"200")
        .macs(mac_of(b), BALANCER_MAC);
    let (v, out) = env.run(&reply.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 47000)));
    // And a real client still gets in during the flood.
    establish(&env, 47001, &ring);
}

#[test]
fn a_closed_flow_reused_by_a_new_syn_gets_a_new_nat_entry() {
    let env = env("pr-reuse");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, port) = open_flow(&env, 45000, &ring);
    let (v, _) = env
        .run(&client_frame(45000).flags(FIN | ACK).build())
        .unwrap();
    assert_eq!(v, XDP_TX);
    let (b2, port2) = open_flow(&env, 45000, &ring);
    // The old NAT entry is gone: a late reply to it is not translated.
    if (b2, port2) != (b, port) {
        let stale = Frame::tcp((b, 8080), (BALANCER_IP, port))
            .flags(ACK)
            .build();
        let (v, out) = env.run(&stale).unwrap();
        assert_eq!((v, out), (XDP_PASS, stale));
    }
    // RST from the backend is counted against it.
    let rst = Frame::tcp((b2, 8080), (BALANCER_IP, port2))
        .flags(RST)
        .build();
    assert_eq!(env.run(&rst).unwrap().0, XDP_TX);
    let id = env.dp.services[0].backend_ids[ring.iter().position(|x| *x == b2).unwrap()];
    assert_eq!(env.dp.backend_stats(id).unwrap().rsts_from, 1);
}

#[test]
fn nat_ports_of_finished_flows_are_reused_but_live_ones_never_stolen() {
    require_root();
    let mut cfg = config(&[backend(0)], false);
    cfg.nat_ports = PortRange {
        min: 20000,
        max: 20000,
    };
    let env = ProgRun::new(&unique("pr-nat"), &cfg, &[backend(0), CLIENT]).unwrap();
    let (_, port) = establish(&env, 46000, &[backend(0)]);
    assert_eq!(port, 20000);
    // The only port is held by a live flow: a second flow is refused.
    let (v, _) = env.run(&client_frame(46001).syn().build()).unwrap();
    assert_eq!(v, XDP_DROP);
    assert_eq!(env.dp.service_stats(0).unwrap().drop_nat_ports, 1);
    // Once the first flow closes and lingers for its last segments, its port
    // serves the next flow.
    assert_eq!(
        env.run(&client_frame(46000).flags(FIN | ACK).build())
            .unwrap()
            .0,
        XDP_TX
    );
    let (v, _) = env.run(&client_frame(46001).syn().build()).unwrap();
    assert_eq!(v, XDP_DROP, "a just-closed flow's port must linger");
    std::thread::sleep(std::time::Duration::from_nanos(
        huddle_common::NAT_LINGER_NS + 100_000_000,
    ));
    let (_, port) = open_flow(&env, 46001, &[backend(0)]);
    assert_eq!(port, 20000);
    // Replies on that port now belong to the new flow.
    let reply = Frame::tcp((backend(0), 8080), (BALANCER_IP, 20000))
        .flags(SYN | ACK)
        .build();
    let (v, out) = env.run(&reply).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).1, (CLIENT, 46001));
}

/// Runs the rest of the calling thread on `cpu` (PROG_TEST_RUN runs the
/// program on the caller's CPU, and each CPU has its own NAT slice).
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is empty; the calls get valid pointers.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "pinning to CPU {cpu}"
        );
    }
}

/// A balancer with one backend and `ports` NAT ports from 20000, SNAT
/// addresses `snat` (the first is `BALANCER_IP`).
fn nat_env(tag: &str, ports: u16, snat: &[Ipv4Addr]) -> ProgRun {
    require_root();
    let mut cfg = config(&[backend(0)], false);
    cfg.nat_ports = PortRange {
        min: 20000,
        max: 20000 + ports - 1,
    };
    cfg.snat_ips = snat.to_vec();
    ProgRun::new(&unique(tag), &cfg, &[backend(0), CLIENT]).unwrap()
}

/// A SYN from client port `sport`: the (SNAT address, NAT port) it left with.
fn syn_tuple(env: &ProgRun, sport: u16) -> (Ipv4Addr, u16) {
    let (v, out) = env.run(&client_frame(sport).syn().build()).unwrap();
    assert_eq!(v, XDP_TX, "SYN from port {sport}");
    endpoints(&out).0
}

fn cpus() -> usize {
    huddle_user::sys::host::possible_cpus().expect("possible CPUs")
}

#[test]
fn nat_tuples_walk_each_cpus_own_slice_in_order() {
    let env = nat_env("pr-slice", 1000, &[BALANCER_IP]);
    let n = cpus();
    let slice = 1000 / n as u16;
    for cpu in 0..n.min(2) {
        pin_to(cpu);
        let base = 20000 + cpu as u16 * slice;
        let ports: Vec<u16> = (0..5)
            .map(|i| syn_tuple(&env, 41000 + cpu as u16 * 100 + i).1)
            .collect();
        // Where the walk starts moves with the clock; from there it takes
        // one port after the other, within this CPU's slice only.
        let first = ports[0];
        let want: Vec<u16> = (0..5).map(|i| base + (first - base + i) % slice).collect();
        assert!(
            (base..base + slice).contains(&first),
            "CPU {cpu}: {first} is outside its slice {base}..{}",
            base + slice
        );
        assert_eq!(ports, want, "CPU {cpu} walks its slice in order");
    }
}

#[test]
fn a_slice_gone_round_hands_out_its_oldest_tuple_and_counts_the_early_reuse() {
    // Two ports per CPU: the third SYN comes back to the first tuple.
    let n = cpus() as u16;
    let env = nat_env("pr-wrap", 2 * n, &[BALANCER_IP]);
    pin_to(0);
    let got: Vec<u16> = (0..7).map(|i| syn_tuple(&env, 42000 + i).1).collect();
    let (x, y) = (got[0], got[1]);
    assert_eq!(
        [x.min(y), x.max(y)],
        [20000, 20001],
        "CPU 0's slice is 20000-20001: {got:?}"
    );
    assert_eq!(
        got,
        vec![x, y, x, y, x, y, x],
        "the oldest tuple goes first"
    );
    let id = env.dp.services[0].backend_ids[0];
    let st = env.dp.backend_stats(id).unwrap();
    // Rounds of two SYNs take far less than TIME_WAIT. Counting starts
    // once a whole round of this run is over: from the fifth SYN when the
    // walk began at the slice's start, the fourth when it began mid-slice.
    let want = if x == 20000 { 3 } else { 4 };
    assert_eq!(st.nat_reuse_early, want, "{st:?}");
}

#[test]
fn a_tuple_an_established_flow_holds_is_skipped_when_the_slice_comes_round() {
    let n = cpus() as u16;
    let env = nat_env("pr-skip", 2 * n, &[BALANCER_IP]);
    pin_to(0);
    let (_, held) = establish(&env, 43000, &[backend(0)]);
    let other = if held == 20000 { 20001 } else { 20000 };
    // The other port, then round: the first is a live flow's, so the
    // other again.
    assert_eq!(syn_tuple(&env, 43001).1, other);
    assert_eq!(syn_tuple(&env, 43002).1, other);
    // The established flow still owns its tuple both ways.
    let reply = Frame::tcp((backend(0), 8080), (BALANCER_IP, held))
        .flags(ACK | PSH)
        .payload(b"ok")
        .macs(mac_of(backend(0)), BALANCER_MAC);
    let (v, out) = env.run(&reply.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).1, (CLIENT, 43000));
}

/// The half-open client slot a SYN from `sport` takes in `env`.
fn client_slot(env: &ProgRun, sport: u16) -> u32 {
    let key = FlowKey {
        client: ip_bytes(CLIENT.into()),
        vip: ip_bytes(VIP.into()),
        client_port_be: sport.to_be(),
        vip_port_be: 80u16.to_be(),
        proto: 6,
        family: FAMILY_V4,
        _pad: [0; 2],
    };
    key.hash(env.dp.hash_seed()) as u32 & (HALF_OPEN_SLOTS - 1)
}

/// Client ports from `from` on whose half-open slots `keep` says yes.
fn ports_where<'a>(
    env: &'a ProgRun,
    from: u16,
    keep: impl Fn(u32) -> bool + 'a,
) -> impl Iterator<Item = u16> + 'a {
    (from..).filter(move |p| keep(client_slot(env, *p)))
}

fn half_open_lost(env: &ProgRun) -> u64 {
    env.dp.service_stats(0).unwrap().half_open_lost
}

/// A SYN reads its slots' short tags (`HALF_OPEN_TAGS`, `HALF_OPEN_NAT_TAGS`),
/// not the slots: they must say what the slots hold. A retransmitted SYN
/// is known as one (same tuple, nothing lost); a SYN on the slot of a
/// handshake under way takes it (one lost); one on the slot of a promoted
/// flow loses nothing.
#[test]
fn short_tags_tell_a_retransmission_a_handshake_under_way_and_a_free_slot_apart() {
    let env = nat_env("pr-tags", 1000, &[BALANCER_IP]);
    pin_to(0);
    let p0 = 44000;
    let s0 = client_slot(&env, p0);
    let first = syn_tuple(&env, p0);
    assert_eq!(
        syn_tuple(&env, p0),
        first,
        "a retransmission keeps its tuple"
    );
    assert_eq!(half_open_lost(&env), 0, "a retransmission takes nothing");

    let p1 = ports_where(&env, p0 + 1, |s| s == s0).next().unwrap();
    let second = syn_tuple(&env, p1);
    assert_ne!(second, first);
    assert_eq!(half_open_lost(&env), 1, "p1 took p0's handshake's slot");
    // p0's handshake is gone: its next SYN is a new flow, on a new tuple
    // (and takes the slot back from p1's).
    assert_ne!(syn_tuple(&env, p0), first);
    assert_eq!(half_open_lost(&env), 2);

    let p2 = ports_where(&env, p1 + 1, |s| s != s0).next().unwrap();
    let s2 = client_slot(&env, p2);
    establish(&env, p2, &[backend(0)]);
    let p3 = ports_where(&env, p2 + 1, |s| s == s2).next().unwrap();
    syn_tuple(&env, p3);
    assert_eq!(
        half_open_lost(&env),
        2,
        "a promoted flow's slot is free: its short tag was cleared"
    );
}

/// Both half-open tables modelled: 3,000 SYNs from distinct client ports
/// toward three backends, never answered, so both tables of 1,024 slots
/// fill and wrap. A SYN loses the handshake whose slot it takes when that
/// slot holds another tuple, on either side; the kernel counts this from
/// the short tags alone, and must count what the model does.
#[test]
fn half_open_losses_counted_from_short_tags_match_a_model_of_both_tables() {
    let env = env("pr-lost");
    losses_match_a_model(&env);
}

/// As above, all toward one backend: its NAT walk goes more than a table
/// of ports round, so tuples a table apart share a NAT slot (and, but for
/// the lap in the tag, a short tag: such losses went uncounted whenever a
/// walk happened to wrap).
#[test]
fn half_open_losses_of_nat_tuples_a_table_apart_are_counted() {
    let env = nat_env("pr-laps", 8000, &[BALANCER_IP]);
    losses_match_a_model(&env);
}

/// Sends 3,000 SYNs (client ports 10000..13000, never answered) and checks
/// the kernel's `half_open_lost` against a model of both tables.
fn losses_match_a_model(env: &ProgRun) {
    pin_to(0);
    let seed = env.dp.hash_seed();
    let mut client_slots = HashMap::new();
    let mut nat_slots = HashMap::new();
    let (mut client_lost, mut nat_lost) = (0u64, 0u64);
    for sport in 10000..13000u16 {
        let (v, out) = env.run(&client_frame(sport).syn().build()).unwrap();
        assert_eq!(v, XDP_TX, "SYN from {sport}");
        let ((_, nat_port), (b, b_port)) = endpoints(&out);
        let key = NatKey::new(
            ip_bytes(BALANCER_IP.into()),
            ip_bytes(b.into()),
            b_port.to_be(),
            nat_port.to_be(),
            6,
            FAMILY_V4,
        );
        let nat_slot =
            key.half_open_slot(seed, NAT.min, HALF_OPEN_SLOTS - 1).0 & (HALF_OPEN_SLOTS - 1);
        if client_slots
            .insert(client_slot(env, sport), sport)
            .is_some()
        {
            client_lost += 1;
        }
        if nat_slots.insert(nat_slot, key).is_some_and(|k| k != key) {
            nat_lost += 1;
        }
    }
    assert!(client_lost > 0 && nat_lost > 0, "{client_lost} {nat_lost}");
    assert_eq!(
        half_open_lost(env),
        client_lost + nat_lost,
        "lost on the client side {client_lost}, on the NAT side {nat_lost}"
    );
}

/// TCP options carrying timestamp `ts`: a SYN's as Linux lays them out
/// (MSS, SACK permitted, timestamps, window scale), or a later segment's
/// (two NOPs, timestamps).
fn ts_options(syn: bool, ts: u32) -> Vec<u8> {
    let mut o = if syn {
        vec![2, 4, 5, 0xb4, 4, 2, 8, 10]
    } else {
        vec![1, 1, 8, 10]
    };
    o.extend(ts.to_be_bytes());
    o.extend(7u32.to_be_bytes());
    if syn {
        o.extend([1, 3, 3, 7]);
    }
    o
}

/// The backend closed first, so it holds the tuple in TIME_WAIT with the
/// client's last timestamp: when the slice comes round, a SYN whose own
/// timestamp is older (the backend would answer it with an ACK of the old
/// connection, and the client wait a retransmission) is given another
/// tuple; a newer one takes it.
#[test]
fn a_tuple_whose_time_wait_would_refuse_the_syn_is_passed_over() {
    let n = cpus() as u16;
    let env = nat_env("pr-tw", 2 * n, &[BALANCER_IP]);
    pin_to(0);
    let (_, held) = establish(&env, 48000, &[backend(0)]);
    let other = if held == 20000 { 20001 } else { 20000 };
    // The backend's FIN, then the client's FIN with its latest timestamp.
    let fin = Frame::tcp((backend(0), 8080), (BALANCER_IP, held))
        .flags(FIN | ACK)
        .seq_ack(7001, 1001)
        .macs(mac_of(backend(0)), BALANCER_MAC);
    assert_eq!(env.run(&fin.build()).unwrap().0, XDP_TX);
    let last = 3_000_000_000u32;
    let client_fin = client_frame(48000)
        .flags(FIN | ACK)
        .seq_ack(1001, 7002)
        .options(&ts_options(false, last));
    let (v, out) = env.run(&client_fin.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).0, (BALANCER_IP, held));
    std::thread::sleep(std::time::Duration::from_nanos(
        huddle_common::NAT_LINGER_NS + 100_000_000,
    ));
    let syn = |sport: u16, ts: Option<u32>| {
        let f = client_frame(sport).syn();
        let f = match ts {
            Some(t) => f.options(&ts_options(true, t)),
            None => f,
        };
        let (v, out) = env.run(&f.build()).unwrap();
        assert_eq!(v, XDP_TX);
        endpoints(&out).0 .1
    };
    let id = env.dp.services[0].backend_ids[0];
    let skipped = || env.dp.backend_stats(id).unwrap().nat_tw_skipped;
    assert_eq!(syn(48001, None), other);
    // Round again: older by the wrapping comparison TCP uses.
    assert_eq!(syn(48002, Some(last.wrapping_add(1u32 << 31))), other);
    assert_eq!(skipped(), 1);
    assert_eq!(syn(48003, Some(last - 5)), other);
    assert_eq!(skipped(), 2);
    assert_eq!(syn(48004, Some(last.wrapping_add(1000))), held);
    assert_eq!(skipped(), 2);
}

#[test]
fn a_second_snat_address_doubles_the_tuples_and_its_replies_come_back() {
    let second = Ipv4Addr::new(10, 213, 0, 3);
    let n = cpus() as u16;
    // One port per CPU, two addresses: two tuples before the round ends.
    let env = nat_env("pr-snat2", n, &[BALANCER_IP, second]);
    pin_to(0);
    let got: Vec<(Ipv4Addr, u16)> = (0..3).map(|i| syn_tuple(&env, 44000 + i)).collect();
    assert!(got.iter().all(|t| t.1 == 20000), "{got:?}");
    assert_ne!(got[0].0, got[1].0, "both addresses are used: {got:?}");
    assert_eq!(got[2], got[0], "then the oldest again: {got:?}");
    // The SYN-ACK to the second SYN's address reaches the client of port
    // 44001.
    let addr = got[1].0;
    let synack = Frame::tcp((backend(0), 8080), (addr, 20000))
        .flags(SYN | ACK)
        .seq_ack(9000, 1001)
        .macs(mac_of(backend(0)), BALANCER_MAC);
    let (v, out) = env.run(&synack.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 44001)));
    assert!(checksums_valid(&out));
    // Its handshake completes and the flow keeps that address.
    let ack = client_frame(44001).flags(ACK).seq_ack(1001, 9001);
    let (v, out) = env.run(&ack.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((addr, 20000), (backend(0), 8080)));
}

#[test]
fn a_client_port_reused_right_after_a_close_reaches_its_new_connection() {
    let env = env("pr-reopen");
    let ring = [backend(0), backend(1), backend(2)];
    pin_to(0);
    let (b, port) = establish(&env, 48000, &ring);
    // The backend closes; the client's port is free again at once.
    let fin = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(FIN | ACK)
        .macs(mac_of(b), BALANCER_MAC);
    assert_eq!(env.run(&fin.build()).unwrap().0, XDP_TX);
    // A new connection from the same port: SYN, SYN-ACK, ACK.
    let (b2, port2) = establish(&env, 48000, &ring);
    assert_ne!((b2, port2), (b, port), "a new connection gets a new tuple");
    // Its data goes to the new backend and tuple, not the closed flow's.
    let data = client_frame(48000).flags(ACK | PSH).payload(b"GET /");
    let (v, out) = env.run(&data.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((BALANCER_IP, port2), (b2, 8080)));
    // And the closed flow's tuple no longer translates anything.
    let stale = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(ACK)
        .build();
    assert_eq!(env.run(&stale).unwrap(), (XDP_PASS, stale));
}

/// TCP options as a Linux client's SYN carries them: MSS 1460, SACK
/// permitted, timestamps, NOP, window scale 7.
const SYN_OPTIONS: [u8; 20] = [
    2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 1, 0xe2, 0x40, 0, 0, 0, 0, 1, 3, 3, 7,
];

/// The SYN the balancer sends toward backend `b` from NAT port `port`:
/// the client's sequence number, window and options, a fresh IP header.
fn resent_syn(b: Ipv4Addr, port: u16, seq: u32) -> Vec<u8> {
    let mut f = Frame::tcp((BALANCER_IP, port), (b, 8080))
        .syn()
        .seq_ack(seq, 0)
        .options(&SYN_OPTIONS)
        .macs(BALANCER_MAC, mac_of(b));
    f.id = 0;
    f.build()
}

/// The refusal of the SYN on NAT tuple `port` by backend `b`.
fn refusal(b: Ipv4Addr, port: u16, seq: u32) -> Vec<u8> {
    Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(RST | ACK)
        .seq_ack(0, seq.wrapping_add(1))
        .macs(mac_of(b), BALANCER_MAC)
        .build()
}

/// A client SYN from `sport` with sequence number `seq` and the options
/// of a Linux client, and the frame the balancer sent for it.
fn options_syn(env: &ProgRun, sport: u16, seq: u32) -> (Vec<u8>, Vec<u8>) {
    let syn = client_frame(sport)
        .syn()
        .seq_ack(seq, 0)
        .options(&SYN_OPTIONS)
        .build();
    let (v, out) = env.run(&syn).unwrap();
    assert_eq!(v, XDP_TX);
    (syn, out)
}

/// Backend `b`'s SYN-ACK on NAT port `port` to client port `sport`'s SYN
/// `isn` reaches the client, and the client's ACK establishes the flow.
fn complete_handshake(env: &ProgRun, b: Ipv4Addr, port: u16, sport: u16, isn: u32) {
    let synack = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(SYN | ACK)
        .seq_ack(300, isn + 1)
        .macs(mac_of(b), BALANCER_MAC);
    let (v, out) = env.run(&synack.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, sport)));
    forward(env, client_frame(sport).flags(ACK).seq_ack(isn + 1, 301));
}

/// A half-open flow from client port `sport` whose backend's SYN-ACK
/// went by (the client has not acknowledged it yet): (backend, NAT port).
fn answered_half_open(env: &ProgRun, sport: u16) -> (Ipv4Addr, u16) {
    let (b, port) = open_flow(env, sport, &[backend(0), backend(1), backend(2)]);
    forward(
        env,
        Frame::tcp((b, 8080), (BALANCER_IP, port))
            .flags(SYN | ACK)
            .seq_ack(700, 1001)
            .macs(mac_of(b), BALANCER_MAC),
    );
    (b, port)
}

fn backend_id(env: &ProgRun, b: Ipv4Addr) -> u32 {
    let i = (0..3).position(|i| backend(i) == b).expect("a backend");
    env.dp.services[0].backend_ids[i]
}

#[test]
fn a_refused_syn_goes_to_another_backend_with_its_options_and_the_client_never_sees_the_rst() {
    let env = env("pr-retry");
    let (syn, out) = options_syn(&env, 43000, 5000);
    let ((_, port1), (b1, _)) = endpoints(&out);
    // The first SYN is the client's, translated (its IP id kept).
    let mut first = resent_syn(b1, port1, 5000);
    first[ETH_LEN + 4..ETH_LEN + 6].copy_from_slice(&[0x12, 0x34]);
    assert_eq!(&out[ETH_LEN + 12..], &first[ETH_LEN + 12..], "first SYN");

    // b1 refuses: the RST itself comes back out as the same SYN toward
    // another backend, byte for byte, from a NAT tuple of its own.
    let (v, out) = env.run(&refusal(b1, port1, 5000)).unwrap();
    assert_eq!(v, XDP_TX, "the refusal must be turned into a SYN");
    let ((src, port2), (b2, _)) = endpoints(&out);
    assert_eq!(src, BALANCER_IP);
    assert_ne!(b2, b1, "retried on the backend that refused");
    assert_eq!(out, resent_syn(b2, port2, 5000), "rebuilt SYN");
    assert!(checksums_valid(&out));
    let st1 = env.dp.backend_stats(backend_id(&env, b1)).unwrap();
    assert_eq!((st1.refused, st1.retried_refused), (1, 1), "{st1:?}");
    assert_eq!(env.dp.backend_stats(backend_id(&env, b2)).unwrap().syns, 1);

    // Anything more from b1 on the old tuple is not ours any more.
    let (v, _) = env.run(&refusal(b1, port1, 5000)).unwrap();
    assert_eq!(
        v, XDP_PASS,
        "the refusing backend's tuple must be forgotten"
    );

    // A client retransmission follows the flow to b2.
    let (v, out) = env.run(&syn).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((BALANCER_IP, port2), (b2, 8080)));

    // b2 refuses too: the third backend. Then retries are used up and the
    // third refusal reaches the client.
    let (v, out) = env.run(&refusal(b2, port2, 5000)).unwrap();
    assert_eq!(v, XDP_TX);
    let ((_, port3), (b3, _)) = endpoints(&out);
    assert!(b3 != b1 && b3 != b2, "third backend {b3}");
    assert_eq!(out, resent_syn(b3, port3, 5000));
    let (v, out) = env.run(&refusal(b3, port3, 5000)).unwrap();
    assert_eq!(v, XDP_TX);
    let expected = Frame::tcp((VIP, 80), (CLIENT, 43000))
        .flags(RST | ACK)
        .seq_ack(0, 5001)
        .macs(BALANCER_MAC, mac_of(CLIENT))
        .build();
    assert_eq!(
        out, expected,
        "after two retries the RST goes to the client"
    );
}

#[test]
fn a_retried_syn_completes_its_handshake_on_the_new_backend() {
    let env = env("pr-retry-ok");
    let syn = client_frame(43100).syn().seq_ack(9000, 0).build();
    let (_, out) = env.run(&syn).unwrap();
    let ((_, port1), (b1, _)) = endpoints(&out);
    let (_, out) = env.run(&refusal(b1, port1, 9000)).unwrap();
    let ((_, port2), (b2, _)) = endpoints(&out);
    // A SYN without options is resent without options.
    let mut expected = Frame::tcp((BALANCER_IP, port2), (b2, 8080))
        .syn()
        .seq_ack(9000, 0)
        .macs(BALANCER_MAC, mac_of(b2));
    expected.id = 0;
    assert_eq!(out, expected.build());
    // b2's SYN-ACK reaches the client; the client's ACK establishes the
    // flow on b2.
    complete_handshake(&env, b2, port2, 43100, 9000);
    let st2 = env.dp.backend_stats(backend_id(&env, b2)).unwrap();
    assert_eq!((st2.syn_acks, st2.flows_new), (1, 1), "{st2:?}");
    let (_, out) = env
        .run(
            &client_frame(43100)
                .flags(ACK | PSH)
                .payload(b"GET /")
                .build(),
        )
        .unwrap();
    assert_eq!(endpoints(&out), ((BALANCER_IP, port2), (b2, 8080)));
}

/// What a backend's TIME_WAIT (or a connection it still holds) on NAT
/// tuple `port` answers a SYN with: an ACK of the old connection.
fn stale_ack(b: Ipv4Addr, port: u16) -> Vec<u8> {
    Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(ACK)
        .seq_ack(777_000, 888_000)
        .macs(mac_of(b), BALANCER_MAC)
        .build()
}

#[test]
fn a_syn_an_old_connections_time_wait_refuses_is_resent_to_the_same_backend_from_another_tuple() {
    let env = env("pr-tw-ack");
    let (_, out) = options_syn(&env, 43150, 6000);
    let ((_, port1), (b1, _)) = endpoints(&out);

    // The ACK of the old connection never reaches the client: it comes
    // back out as the client's SYN toward the same backend, byte for byte,
    // from another tuple.
    let (v, out) = env.run(&stale_ack(b1, port1)).unwrap();
    assert_eq!(v, XDP_TX, "the stale ACK must be turned into a SYN");
    let ((src, port2), (b2, _)) = endpoints(&out);
    assert_eq!((src, b2), (BALANCER_IP, b1), "same backend");
    assert_ne!(port2, port1, "another tuple");
    assert_eq!(out, resent_syn(b1, port2, 6000), "rebuilt SYN");
    assert!(checksums_valid(&out));
    let st = env.dp.backend_stats(backend_id(&env, b1)).unwrap();
    assert_eq!(
        (
            st.retried_time_wait,
            st.retried_refused,
            st.refused,
            st.syns
        ),
        (1, 0, 0, 2),
        "{st:?}"
    );
    // The old tuple is not the flow's any more.
    assert_eq!(env.run(&stale_ack(b1, port1)).unwrap().0, XDP_PASS);

    // The handshake completes on the new tuple.
    complete_handshake(&env, b1, port2, 43150, 6000);
    assert_eq!(
        env.dp
            .backend_stats(backend_id(&env, b1))
            .unwrap()
            .flows_new,
        1
    );

    // After the SYN-ACK a bare ACK from the backend is its own business.
    let (b, port) = answered_half_open(&env, 43151);
    let (v, out) = env.run(&stale_ack(b, port)).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 43151)));

    // Retries used up (the connection tried 1 + MAX_TUPLE_RETRIES
    // tuples): the last ACK goes to the client, whose reset and resend are
    // then the only way on.
    let syn3 = client_frame(43152).syn().seq_ack(8000, 0).build();
    let (_, out) = env.run(&syn3).unwrap();
    let ((_, mut port), (b, _)) = endpoints(&out);
    for _ in 0..huddle_common::MAX_TUPLE_RETRIES {
        let (v, out) = env.run(&stale_ack(b, port)).unwrap();
        assert_eq!(v, XDP_TX);
        let ((_, p), (to, _)) = endpoints(&out);
        assert_eq!(to, b);
        port = p;
    }
    let (v, out) = env.run(&stale_ack(b, port)).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 43152)));
}

#[test]
fn a_flow_that_got_anything_from_its_backend_is_never_retried() {
    let env = env("pr-noretry");
    let ring = [backend(0), backend(1), backend(2)];
    // Established, with data from the backend: its RST goes to the client.
    let (b, port) = establish(&env, 43200, &ring);
    forward(
        &env,
        Frame::tcp((b, 8080), (BALANCER_IP, port))
            .flags(ACK | PSH)
            .payload(b"HTTP/1.1 200 OK\r\n")
            .macs(mac_of(b), BALANCER_MAC),
    );
    let rst = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(RST | ACK)
        .macs(mac_of(b), BALANCER_MAC);
    let (v, out) = env.run(&rst.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 43200)));
    assert_eq!(out[ETH_LEN + 20 + 13], RST | ACK);
    // Half-open, but the backend's SYN-ACK went by: its RST is the
    // backend's word on a connection the client has seen, not a refusal.
    let (b, port) = answered_half_open(&env, 43201);
    let rst2 = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(RST | ACK)
        .macs(mac_of(b), BALANCER_MAC);
    let (v, out) = env.run(&rst2.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 43201)));
    let retried: u64 = (0..3)
        .map(|i| {
            env.dp
                .backend_stats(env.dp.services[0].backend_ids[i])
                .unwrap()
                .retried_refused
        })
        .sum();
    assert_eq!(retried, 0);
}

#[test]
fn a_syn_left_unanswered_is_retransmitted_to_another_backend() {
    let env = env("pr-silent");
    let syn = client_frame(43300).syn().seq_ack(7000, 0).build();
    let (_, out) = env.run(&syn).unwrap();
    let ((_, port1), (b1, _)) = endpoints(&out);
    // Retransmitted before syn_timeout_ms (300 ms by default): same backend.
    let (_, out) = env.run(&syn).unwrap();
    assert_eq!(endpoints(&out), ((BALANCER_IP, port1), (b1, 8080)));
    std::thread::sleep(std::time::Duration::from_millis(350));
    // After it, with no answer from b1: another backend, another tuple.
    let (v, out) = env.run(&syn).unwrap();
    assert_eq!(v, XDP_TX);
    let ((_, port2), (b2, _)) = endpoints(&out);
    assert_ne!(b2, b1);
    assert_ne!(port2, 0);
    assert_eq!(
        env.dp
            .backend_stats(backend_id(&env, b1))
            .unwrap()
            .retried_silent,
        1
    );
    // b1's late SYN-ACK finds no NAT slot: the kernel gets it (and resets).
    let late = Frame::tcp((b1, 8080), (BALANCER_IP, port1))
        .flags(SYN | ACK)
        .seq_ack(1, 7001)
        .macs(mac_of(b1), BALANCER_MAC);
    assert_eq!(env.run(&late.build()).unwrap().0, XDP_PASS);
}

fn udp_frame(sport: u16) -> Frame {
    Frame::udp((CLIENT, sport), (VIP, 53))
        .payload(b"query")
        .macs(mac_of(CLIENT), BALANCER_MAC)
}

fn udp_answer(b: Ipv4Addr, nat_port: u16) -> Vec<u8> {
    Frame::udp((b, 5353), (BALANCER_IP, nat_port))
        .payload(b"answer")
        .macs(mac_of(b), BALANCER_MAC)
        .build()
}

/// Flows established over the UDP service's backends.
fn flows_new(env: &ProgRun) -> u64 {
    env.dp.services[1]
        .backend_ids
        .iter()
        .map(|id| env.dp.backend_stats(*id).unwrap().flows_new)
        .sum()
}

#[test]
fn a_udp_flow_is_established_by_the_clients_datagram_after_an_answer_and_a_flood_never_evicts_it() {
    let env = env("pr-udp-half");
    let (v, out) = env.run(&udp_frame(41100).build()).unwrap();
    assert_eq!(v, XDP_TX);
    let ((_, port), (b, _)) = endpoints(&out);
    // Before any answer, the client's datagrams follow the half-open flow.
    let (_, out) = env.run(&udp_frame(41100).build()).unwrap();
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 5353)));
    let (v, out) = env.run(&udp_answer(b, port)).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 53), (CLIENT, 41100)));
    assert_eq!(flows_new(&env), 0, "an answer alone does not establish it");
    // The client's next datagram proves it is where it says: established.
    let (_, out) = env.run(&udp_frame(41100).build()).unwrap();
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 5353)));
    assert_eq!(flows_new(&env), 1);

    // 10,000 one-shot flows from spoofed sources, each answered by its
    // backend: two and a half times the flow table (4,096). None is
    // established, so none can evict the flow above.
    for i in 0..10_000u32 {
        let src = Ipv4Addr::new(10, 213, 128 + (i >> 14) as u8, (i >> 6) as u8);
        let q = Frame::udp((src, 1024 + (i & 0x3fff) as u16), (VIP, 53))
            .payload(b"q")
            .macs(mac_of(CLIENT), BALANCER_MAC);
        let (v, out) = env.run(&q.build()).unwrap();
        if v != XDP_TX {
            continue;
        }
        let ((_, p), (d, _)) = endpoints(&out);
        env.run(&udp_answer(d, p)).unwrap();
    }
    assert_eq!(flows_new(&env), 1, "one-shot flows stay half-open");
    let (_, out) = env.run(&udp_frame(41100).build()).unwrap();
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 5353)));
    let (v, out) = env.run(&udp_answer(b, port)).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 53), (CLIENT, 41100)));
}

#[test]
fn icmp_errors_about_a_translated_flow_reach_its_client_translated_back() {
    let env = env("pr-icmp");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, nat_port) = open_flow(&env, 46000, &ring);
    let sent = Frame::tcp((BALANCER_IP, nat_port), (b, 8080)).syn().build();
    let client_syn = client_frame(46000).syn().build();
    let router = Ipv4Addr::new(10, 213, 0, 254);
    // From the backend, quoting 28 bytes; from a router on the way,
    // quoting the whole SYN (its TCP checksum too).
    for (from, quoted, shown_from) in [(b, 28, VIP), (router, 40, router)] {
        let err = icmp_error(
            (3, 4, [0, 0, 0x04, 0xb0]),
            from,
            BALANCER_IP,
            &sent[ETH_LEN..ETH_LEN + quoted],
            (mac_of(b), BALANCER_MAC),
        );
        let (verdict, out) = env.run(&err).unwrap();
        assert_eq!(verdict, XDP_TX, "from {from}");
        let want = icmp_error(
            (3, 4, [0, 0, 0x04, 0xb0]),
            shown_from,
            CLIENT,
            &client_syn[ETH_LEN..ETH_LEN + quoted],
            (BALANCER_MAC, mac_of(CLIENT)),
        );
        assert_eq!(out, want, "ICMP from {from}, translated for the client");
        assert!(icmp_checksums_valid(&out));
    }
    let g: GlobalStats = env.dp.global_stats().unwrap();
    assert_eq!(g.icmp_translated, 2);
    // About a tuple the balancer never used, or not an error: the kernel's.
    let stranger = Frame::tcp((BALANCER_IP, 20001), (b, 8080)).syn().build();
    let unknown = icmp_error(
        (3, 1, [0; 4]),
        b,
        BALANCER_IP,
        &stranger[ETH_LEN..ETH_LEN + 28],
        (mac_of(b), BALANCER_MAC),
    );
    let echo = icmp_error(
        (8, 0, [0, 1, 0, 1]),
        b,
        BALANCER_IP,
        b"ping",
        (mac_of(b), BALANCER_MAC),
    );
    for f in [unknown, echo] {
        let (verdict, out) = env.run(&f).unwrap();
        assert_eq!((verdict, &out), (XDP_PASS, &f));
    }
    assert_eq!(env.dp.global_stats().unwrap().icmp_translated, 2);
}
