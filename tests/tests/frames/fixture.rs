//! The IPv4 source-NAT balancer every frames test of `snat`, `nat`,
//! `halfopen`, `retry`, `udp`, `icmp`, `ring`, `forward`, `latency` and
//! `lifecycle` runs on: three backends, a client, and the helpers that open
//! and establish flows on it.

pub(crate) use huddle_common::headers::ETH_LEN;
pub(crate) use huddle_common::{BackendStats, FlowKey, GlobalStats, NatKey, FAMILY_V4};
pub(crate) use huddle_user::{
    config::{Config, PortRange, Proto, Service},
    kernel::dataplane::keys::ip_bytes,
    kernel::packet::{
        checksums_valid, endpoints, icmp_checksums_valid, icmp_error, Frame, ACK, FIN, PSH, RST,
        SYN,
    },
    kernel::prog_run::{mac_of, ProgRun, BALANCER_IP, BALANCER_MAC},
};
pub(crate) use std::{
    collections::HashMap,
    net::{Ipv4Addr, SocketAddr},
};
pub(crate) use testbed::{require_root, unique};

pub(crate) use huddle_common::verdict::{XDP_DROP, XDP_PASS, XDP_TX};

/// Half-open slots of `config`'s balancers.
pub(crate) const HALF_OPEN_SLOTS: u32 = 1024;

pub(crate) const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);

pub(crate) const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);

pub(crate) const NAT: PortRange = PortRange {
    min: 20000,
    max: 32767,
};

pub(crate) fn backend(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 11 + i)
}

pub(crate) fn config(backends: &[Ipv4Addr], udp: bool) -> Config {
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
pub(crate) fn env(tag: &str) -> ProgRun {
    require_root();
    let backends = [backend(0), backend(1), backend(2)];
    let mut neigh = backends.to_vec();
    neigh.push(CLIENT);
    ProgRun::new(&unique(tag), &config(&backends, true), &neigh)
        .expect("set up PROG_TEST_RUN namespace")
}

pub(crate) fn client_frame(sport: u16) -> Frame {
    Frame::tcp((CLIENT, sport), (VIP, 80)).macs(mac_of(CLIENT), BALANCER_MAC)
}

/// Sends a SYN and checks it came out as SYN from the SNAT address to one
/// of `ring`, byte for byte. Returns (backend, NAT port).
pub(crate) fn open_flow(env: &ProgRun, sport: u16, ring: &[Ipv4Addr]) -> (Ipv4Addr, u16) {
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
pub(crate) fn establish(env: &ProgRun, sport: u16, ring: &[Ipv4Addr]) -> (Ipv4Addr, u16) {
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

/// Runs `frame` and checks the program forwarded it.
pub(crate) fn forward(env: &ProgRun, frame: Frame) {
    let (verdict, _) = env.run(&frame.build()).unwrap();
    assert_eq!(verdict, XDP_TX);
}

/// Clients after `CLIENT` on its segment whose replies share its slot in
/// the per-CPU next-hop cache.
pub(crate) fn clients_sharing_a_hop_slot(n: usize) -> Vec<Ipv4Addr> {
    use huddle_common::{addr_v4, addr_words, client_hop_slot};
    let slot = client_hop_slot(addr_words(&addr_v4(CLIENT.octets())));
    (1u32..65_000)
        .map(|i| Ipv4Addr::from(u32::from(CLIENT) + i))
        .filter(|a| client_hop_slot(addr_words(&addr_v4(a.octets()))) == slot)
        .take(n)
        .collect()
}

/// Runs the rest of the calling thread on `cpu` (PROG_TEST_RUN runs the
/// program on the caller's CPU, and each CPU has its own NAT slice).
pub(crate) fn pin_to(cpu: usize) {
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
pub(crate) fn nat_env(tag: &str, ports: u16, snat: &[Ipv4Addr]) -> ProgRun {
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
pub(crate) fn syn_tuple(env: &ProgRun, sport: u16) -> (Ipv4Addr, u16) {
    let (v, out) = env.run(&client_frame(sport).syn().build()).unwrap();
    assert_eq!(v, XDP_TX, "SYN from port {sport}");
    endpoints(&out).0
}

pub(crate) fn cpus() -> usize {
    huddle_user::sys::host::possible_cpus().expect("possible CPUs")
}

/// The half-open client slot a SYN from `sport` takes in `env`.
pub(crate) fn client_slot(env: &ProgRun, sport: u16) -> u32 {
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
pub(crate) fn ports_where<'a>(
    env: &'a ProgRun,
    from: u16,
    keep: impl Fn(u32) -> bool + 'a,
) -> impl Iterator<Item = u16> + 'a {
    (from..).filter(move |p| keep(client_slot(env, *p)))
}

pub(crate) fn half_open_lost(env: &ProgRun) -> u64 {
    env.dp.service_stats(0).unwrap().half_open_lost
}

/// Sends 3,000 SYNs (client ports 10000..13000, never answered) and checks
/// the kernel's `half_open_lost` against a model of both tables.
pub(crate) fn losses_match_a_model(env: &ProgRun) {
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
pub(crate) fn ts_options(syn: bool, ts: u32) -> Vec<u8> {
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

/// TCP options as a Linux client's SYN carries them: MSS 1460, SACK
/// permitted, timestamps, NOP, window scale 7.
pub(crate) const SYN_OPTIONS: [u8; 20] = [
    2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 1, 0xe2, 0x40, 0, 0, 0, 0, 1, 3, 3, 7,
];

/// The SYN the balancer sends toward backend `b` from NAT port `port`:
/// the client's sequence number, window and options, a fresh IP header.
pub(crate) fn resent_syn(b: Ipv4Addr, port: u16, seq: u32) -> Vec<u8> {
    let mut f = Frame::tcp((BALANCER_IP, port), (b, 8080))
        .syn()
        .seq_ack(seq, 0)
        .options(&SYN_OPTIONS)
        .macs(BALANCER_MAC, mac_of(b));
    f.id = 0;
    f.build()
}

/// The refusal of the SYN on NAT tuple `port` by backend `b`.
pub(crate) fn refusal(b: Ipv4Addr, port: u16, seq: u32) -> Vec<u8> {
    Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(RST | ACK)
        .seq_ack(0, seq.wrapping_add(1))
        .macs(mac_of(b), BALANCER_MAC)
        .build()
}

/// A client SYN from `sport` with sequence number `seq` and the options
/// of a Linux client, and the frame the balancer sent for it.
pub(crate) fn options_syn(env: &ProgRun, sport: u16, seq: u32) -> (Vec<u8>, Vec<u8>) {
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
pub(crate) fn complete_handshake(env: &ProgRun, b: Ipv4Addr, port: u16, sport: u16, isn: u32) {
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
pub(crate) fn answered_half_open(env: &ProgRun, sport: u16) -> (Ipv4Addr, u16) {
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

pub(crate) fn backend_id(env: &ProgRun, b: Ipv4Addr) -> u32 {
    let i = (0..3).position(|i| backend(i) == b).expect("a backend");
    env.dp.services[0].backend_ids[i]
}

/// What a backend's TIME_WAIT (or a connection it still holds) on NAT
/// tuple `port` answers a SYN with: an ACK of the old connection.
pub(crate) fn stale_ack(b: Ipv4Addr, port: u16) -> Vec<u8> {
    Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(ACK)
        .seq_ack(777_000, 888_000)
        .macs(mac_of(b), BALANCER_MAC)
        .build()
}

pub(crate) fn udp_frame(sport: u16) -> Frame {
    Frame::udp((CLIENT, sport), (VIP, 53))
        .payload(b"query")
        .macs(mac_of(CLIENT), BALANCER_MAC)
}

pub(crate) fn udp_answer(b: Ipv4Addr, nat_port: u16) -> Vec<u8> {
    Frame::udp((b, 5353), (BALANCER_IP, nat_port))
        .payload(b"answer")
        .macs(mac_of(b), BALANCER_MAC)
        .build()
}

/// Flows established over the UDP service's backends.
pub(crate) fn flows_new(env: &ProgRun) -> u64 {
    env.dp.services[1]
        .backend_ids
        .iter()
        .map(|id| env.dp.backend_stats(*id).unwrap().flows_new)
        .sum()
}
