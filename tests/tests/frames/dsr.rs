//! Direct server return on crafted frames (BPF_PROG_TEST_RUN): what leaves
//! the balancer in each mode, byte for byte; the ACK clock's samples; the
//! backend agent's decap giving back the client's own packet.

use super::fixture::pin_to;
use huddle_common::{BackendStats, GlobalStats};
use huddle_user::{
    config::{Mode, PortRange, Proto, Service},
    kernel::decap::Decap,
    kernel::packet::{
        checksums_valid, icmp_checksums_valid, icmp_error, ipip, left_to_offload, Frame, ACK, FIN,
        PSH, RST,
    },
    kernel::prog_run::{mac_of, test_run, ProgRun, BALANCER_MAC},
};
use std::net::{Ipv4Addr, SocketAddr};
use testbed::{require_root, unique};

use huddle_common::verdict::{XDP_DROP, XDP_PASS, XDP_TX};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);
/// Port of the L2 service, of the IP-in-IP one, and of one whose backend
/// is behind a gateway.
const L2: u16 = 8080;
const IPIP: u16 = 9090;
const FAR: u16 = 7070;
const FAR_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 5);
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 254);
const ENCAP_PREFIX: &str = "10.213.200.0/24";

fn backend(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 11 + i)
}

fn env(tag: &str) -> ProgRun {
    require_root();
    let backends = [backend(0), backend(1), backend(2)];
    let service = |port: u16, mode: Mode, backends: &[Ipv4Addr]| {
        let mut s = Service::plain(
            (VIP, port).into(),
            Proto::Tcp,
            backends
                .iter()
                .map(|b| SocketAddr::from((*b, port)))
                .collect(),
        );
        s.mode = mode;
        s
    };
    let services = vec![
        service(L2, Mode::DsrL2, &backends),
        service(IPIP, Mode::DsrIpip, &backends),
        service(FAR, Mode::DsrL2, &[FAR_BACKEND]),
    ];
    let nat = PortRange {
        min: 20000,
        max: 32767,
    };
    let mut cfg = huddle_user::kernel::prog_run::config(services, nat, 4096, 1024);
    cfg.encap_prefix = Some(ENCAP_PREFIX.parse().unwrap());
    let mut neigh = backends.to_vec();
    neigh.extend([CLIENT, GATEWAY]);
    let env = ProgRun::new(&unique(tag), &cfg, &neigh).expect("PROG_TEST_RUN namespace");
    env.ns
        .ip(&["route", "add", "10.99.0.0/24", "via", &GATEWAY.to_string()])
        .unwrap();
    env
}

fn client(sport: u16, port: u16) -> Frame {
    Frame::tcp((CLIENT, sport), (VIP, port)).macs(mac_of(CLIENT), BALANCER_MAC)
}

/// The backend an L2 frame went to, from its destination MAC.
fn by_mac(out: &[u8]) -> Ipv4Addr {
    (0..3)
        .map(backend)
        .find(|b| out[..6] == mac_of(*b))
        .unwrap_or_else(|| panic!("no backend has MAC {:02x?}", &out[..6]))
}

fn global(env: &ProgRun) -> GlobalStats {
    env.dp.global_stats().unwrap()
}

fn stats(env: &ProgRun, service: usize, b: Ipv4Addr) -> BackendStats {
    let i = (0..3).position(|i| backend(i) == b).expect("a backend");
    env.dp
        .backend_stats(env.dp.services[service].backend_ids[i])
        .unwrap()
}

#[test]
fn l2_frames_leave_unchanged_but_for_their_mac_addresses() {
    let env = env("dsr-l2");
    let syn = client(40000, L2).syn().seq_ack(5000, 0).build();
    let (verdict, out) = env.run(&syn).unwrap();
    assert_eq!(verdict, XDP_TX);
    let b = by_mac(&out);
    let mut want = syn.clone();
    want[..6].copy_from_slice(&mac_of(b));
    want[6..12].copy_from_slice(&BALANCER_MAC);
    assert_eq!(out, want, "only the MAC addresses change");
    assert!(checksums_valid(&out));
    // The handshake's ACK and the data after it go to the same backend,
    // the IP packet untouched.
    for f in [
        client(40000, L2).flags(ACK).seq_ack(5001, 9001),
        client(40000, L2)
            .flags(ACK | PSH)
            .seq_ack(5001, 9001)
            .payload(b"GET / HTTP/1.1\r\n\r\n"),
    ] {
        let frame = f.build();
        let (verdict, out) = env.run(&frame).unwrap();
        assert_eq!(verdict, XDP_TX);
        assert_eq!(by_mac(&out), b);
        assert_eq!(out[12..], frame[12..]);
    }
    let st = env.dp.service_stats(env.dp.services[0].id).unwrap();
    assert_eq!((st.half_open, st.promoted), (1, 1));
    assert_eq!(global(&env).encap, 0);
}

/// A client's segment whose checksum was left to offload (a veth sender's)
/// reaches its backend with the full one, in both modes: the backend's
/// stack would drop it otherwise.
#[test]
fn dsr_segments_left_to_offload_reach_the_backend_with_full_checksums() {
    let env = env("dsr-offload");
    let body: Vec<u8> = (0..1401u32).map(|i| (i * 13) as u8).collect();
    for (sport, port) in [(42000, L2), (42001, IPIP)] {
        assert_eq!(
            env.run(&client(sport, port).syn().build()).unwrap().0,
            XDP_TX
        );
        let data = client(sport, port).flags(ACK | PSH).payload(&body).build();
        let (verdict, out) = env.run(&left_to_offload(data.clone())).unwrap();
        assert_eq!(verdict, XDP_TX);
        let inner = if port == L2 { 0 } else { 20 };
        assert_eq!(
            out[inner + 14..],
            data[14..],
            "port {port}: checksum not finished"
        );
    }
    assert_eq!((global(&env).csum_finished, global(&env).drop_csum), (2, 0));
}

#[test]
fn ipip_frames_carry_the_clients_packet_inside_a_per_flow_outer_source() {
    let env = env("dsr-ipip");
    let prefix: huddle_user::config::Prefix = ENCAP_PREFIX.parse().unwrap();
    let mut sources = std::collections::BTreeSet::new();
    for sport in 41000..41064u16 {
        let syn = client(sport, IPIP).syn().build();
        let (verdict, out) = env.run(&syn).unwrap();
        assert_eq!(verdict, XDP_TX, "SYN from port {sport}");
        let src = Ipv4Addr::new(out[26], out[27], out[28], out[29]);
        let dst = Ipv4Addr::new(out[30], out[31], out[32], out[33]);
        assert!(prefix.contains(src), "outer source {src} outside {prefix}");
        assert!((0..3).map(backend).any(|b| b == dst), "outer dst {dst}");
        let want = ipip(&syn, src, dst, (BALANCER_MAC, mac_of(dst)));
        assert_eq!(out, want, "outer header or inner packet differs");
        // The same flow keeps its outer source.
        let again = client(sport, IPIP).flags(ACK).build();
        let (_, out2) = env.run(&again).unwrap();
        assert_eq!(out2[26..34], out[26..34]);
        sources.insert(src);
    }
    println!("64 flows used {} outer source addresses", sources.len());
    assert!(sources.len() >= 16, "{sources:?}");
    let g = global(&env);
    assert_eq!(g.encap, 128);
    assert_eq!(g.drop_encap, 0);
}

#[test]
fn the_ack_clock_times_handshakes_and_requests_from_the_clients_segments() {
    let env = env("dsr-ack");
    let syn = client(42000, L2).syn().seq_ack(100, 0).build();
    let (_, out) = env.run(&syn).unwrap();
    let b = by_mac(&out);
    let before = stats(&env, 0, b);
    assert_eq!((before.syns, before.syn_acks), (1, 0));
    // The client's ACK of the SYN-ACK: a connect sample.
    env.run(&client(42000, L2).flags(ACK).seq_ack(101, 7001).build())
        .unwrap();
    let st = stats(&env, 0, b);
    assert_eq!(st.syn_acks, 1, "handshake timed");
    // A request, acknowledging nothing new: a turn starts.
    env.run(
        &client(42000, L2)
            .flags(ACK | PSH)
            .seq_ack(101, 7001)
            .payload(b"GET / HTTP/1.1\r\n\r\n")
            .build(),
    )
    .unwrap();
    let st = stats(&env, 0, b);
    assert_eq!((st.turns, st.answered), (1, 0));
    // More of the request 40 ms later (a dribbling client): the same turn,
    // its wait restarted, so the sample below is not the client's 40 ms.
    std::thread::sleep(std::time::Duration::from_millis(40));
    env.run(
        &client(42000, L2)
            .flags(ACK | PSH)
            .seq_ack(119, 7001)
            .payload(b"X: 1\r\n\r\n")
            .build(),
    )
    .unwrap();
    let st = stats(&env, 0, b);
    assert_eq!((st.turns, st.answered), (1, 0));
    // A duplicate ACK of old bytes answers nothing.
    env.run(&client(42000, L2).flags(ACK).seq_ack(119, 7001).build())
        .unwrap();
    assert_eq!(stats(&env, 0, b).answered, 0);
    // The client acknowledges the backend's first answer bytes.
    env.run(&client(42000, L2).flags(ACK).seq_ack(119, 7200).build())
        .unwrap();
    let st = stats(&env, 0, b);
    assert_eq!(st.answered, 1, "the answer is timed");
    assert!(
        st.ttfb_ns > 0 && st.ttfb_ns < 40_000_000,
        "timed from the request's last segment: {} ns",
        st.ttfb_ns
    );
    let pulse = {
        let i = (0..3).position(|i| backend(i) == b).unwrap();
        env.dp.pulse(env.dp.services[0].backend_ids[i]).unwrap()
    };
    assert_eq!(pulse.turn_wait_ns, 0, "nothing owed any more");
    // A keep-alive request, then the next one carrying the ACK of the
    // first's answer (held back, or the client's think time): answered,
    // not timed; the new request's turn starts.
    let request = |seq: u32, ack: u32| {
        client(42000, L2)
            .flags(ACK | PSH)
            .seq_ack(seq, ack)
            .payload(b"GET / HTTP/1.1\r\n\r\n")
            .build()
    };
    env.run(&request(128, 7200)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(40));
    env.run(&request(146, 7400)).unwrap();
    let st = stats(&env, 0, b);
    assert_eq!(
        (st.turns, st.answered, st.unclocked),
        (3, 1, 1),
        "an ACK on new data is no sample: {st:?}"
    );
    // Its answer acknowledged on its own: a sample again.
    env.run(&client(42000, L2).flags(ACK).seq_ack(164, 7600).build())
        .unwrap();
    let st = stats(&env, 0, b);
    assert_eq!((st.answered, st.unclocked), (2, 1));
}

/// The balancer sees only the client's side of a DSR flow, and that is
/// enough: a RST or FIN closes it only near the client's own sequence
/// number, so a spoofer who guessed the tuple (the client's port) does not
/// end it, nor give up its pending turn; the window follows a client that
/// sends on (12 MiB).
#[test]
fn a_spoofed_rst_or_fin_to_a_dsr_flow_leaves_it_open() {
    let env = env("dsr-close");
    let far = 1u32 << 31;
    let (_, out) = env
        .run(&client(42100, L2).syn().seq_ack(5000, 0).build())
        .unwrap();
    let b = by_mac(&out);
    env.run(&client(42100, L2).flags(ACK).seq_ack(5001, 7001).build())
        .unwrap();
    let request = client(42100, L2)
        .flags(ACK | PSH)
        .seq_ack(5001, 7001)
        .payload(b"GET / HTTP/1.1\r\n\r\n");
    env.run(&request.build()).unwrap();
    for flags in [RST, RST | ACK, FIN | ACK] {
        let spoofed = client(42100, L2)
            .flags(flags)
            .seq_ack(5019u32.wrapping_add(far), 7001);
        // Sent on (the backend's TCP judges it too), but the flow stays.
        assert_eq!(env.run(&spoofed.build()).unwrap().0, XDP_TX);
    }
    let st = stats(&env, 0, b);
    assert_eq!(
        (st.flows_closed, st.closes_unproven, st.abandoned),
        (0, 3, 0),
        "a spoofed close ended the flow or its turn"
    );
    assert_eq!(stats(&env, 0, b).turns, 1);
    // The client sends on: 200 segments 64 KiB apart.
    let mut seq = 5019u32;
    for _ in 0..200 {
        seq = seq.wrapping_add(64 << 10);
        env.run(&client(42100, L2).flags(ACK).seq_ack(seq, 7001).build())
            .unwrap();
    }
    env.run(&client(42100, L2).flags(RST).seq_ack(seq, 7001).build())
        .unwrap();
    let st = stats(&env, 0, b);
    assert_eq!(
        (st.flows_closed, st.closes_unproven, st.abandoned),
        (1, 3, 1),
        "the client's own RST, 12 MiB on, closes it and gives up its turn"
    );
}

#[test]
fn an_l2_backend_behind_a_gateway_is_never_sent_a_frame() {
    let env = env("dsr-far");
    let syn = client(43000, FAR).syn().build();
    let (verdict, _) = env.run(&syn).unwrap();
    assert_eq!(verdict, XDP_DROP);
    assert_eq!(global(&env).drop_not_onlink, 1);
}

#[test]
fn the_agents_decap_gives_back_the_clients_packet() {
    let env = env("dsr-decap");
    let mut decap = Decap::load().expect("load decap");
    let me = backend(1);
    // The balancers' outer sources: the encap prefix.
    decap.set_allow(&[ENCAP_PREFIX.parse().unwrap()]).unwrap();
    decap.set_addresses(&[me.into(), VIP.into()]).unwrap();
    let inner = client(44000, IPIP)
        .flags(ACK | PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n")
        .build();
    let outer_src = Ipv4Addr::new(10, 213, 200, 7);
    let wrapped = ipip(&inner, outer_src, me, (BALANCER_MAC, mac_of(me)));
    let prog = decap.program().unwrap();
    let (verdict, out, _) = test_run(prog, &wrapped, env.ifindex).unwrap();
    assert_eq!(verdict, XDP_PASS);
    let mut want = inner.clone();
    want[..12].copy_from_slice(&wrapped[..12]);
    assert_eq!(
        out, want,
        "the client's packet, with the outer frame's MACs"
    );
    // Not to this host, not IP-in-IP, or with outer options: untouched.
    let elsewhere = ipip(&inner, outer_src, backend(2), (BALANCER_MAC, mac_of(me)));
    let mut options = wrapped.clone();
    options[14] = 0x46;
    for (what, f) in [
        ("to another host", elsewhere),
        ("plain TCP", inner.clone()),
        ("outer options", options),
    ] {
        let (verdict, out, _) = test_run(prog, &f, env.ifindex).unwrap();
        assert_eq!((verdict, &out), (XDP_PASS, &f), "{what}");
    }
    let st = decap.stats().unwrap();
    assert_eq!(
        (st.decapped, st.pass_not_local, st.pass_malformed),
        (1, 1, 1)
    );
    // Wrapped by anyone else (a trusted inner source, CVE-2020-10136), or
    // wrapped around a packet to something not served here: dropped.
    let foreign = ipip(
        &inner,
        Ipv4Addr::new(10, 213, 0, 66),
        me,
        (BALANCER_MAC, mac_of(me)),
    );
    let elsewhere_inside = Frame::tcp((CLIENT, 44000), (Ipv4Addr::new(10, 213, 0, 99), 22))
        .macs(mac_of(CLIENT), BALANCER_MAC)
        .flags(ACK)
        .build();
    let not_vip = ipip(&elsewhere_inside, outer_src, me, (BALANCER_MAC, mac_of(me)));
    for (what, f) in [
        ("foreign outer source", &foreign),
        ("inner not a VIP", &not_vip),
    ] {
        let (verdict, _, _) = test_run(prog, f, env.ifindex).unwrap();
        assert_eq!(verdict, XDP_DROP, "{what}");
    }
    let st = decap.stats().unwrap();
    assert_eq!(
        (st.drop_foreign_source, st.drop_not_vip, st.decapped),
        (1, 1, 1)
    );
    // With --vip, only those: the host's own address inside is dropped too.
    decap.vips_only = true;
    decap.set_inner(&[VIP.into()]).unwrap();
    let to_me = Frame::tcp((CLIENT, 44000), (me, 22))
        .macs(mac_of(CLIENT), BALANCER_MAC)
        .flags(ACK)
        .build();
    let to_me = ipip(&to_me, outer_src, me, (BALANCER_MAC, mac_of(me)));
    let prog = decap.program().unwrap();
    assert_eq!(test_run(prog, &to_me, env.ifindex).unwrap().0, XDP_DROP);
    assert_eq!(test_run(prog, &wrapped, env.ifindex).unwrap().0, XDP_PASS);
    assert_eq!(decap.stats().unwrap().drop_not_vip, 2);
}

#[test]
fn a_df_packet_too_big_once_wrapped_gets_fragmentation_needed_from_the_vip() {
    pin_to(0);
    let mut env = env("dsr-mtu");
    env.ns.ip(&["link", "set", "hb0", "mtu", "1400"]).unwrap();
    for f in [client(45000, IPIP).syn(), client(45000, IPIP).flags(ACK)] {
        assert_eq!(env.run(&f.build()).unwrap().0, XDP_TX);
    }
    // The next-hop cache expires (the control plane moves its generation
    // on every second): the first packet after, a big one, still learns
    // the MTU.
    env.dp.refresh_next_hops().unwrap();
    // 1,400 bytes of IP: fits the link, not once 20 more are put in front.
    let big = client(45000, IPIP)
        .flags(ACK | PSH)
        .payload(&[0x61; 1360])
        .build();
    let (verdict, out) = env.run(&big).unwrap();
    assert_eq!(verdict, XDP_TX, "answered back out");
    let quote = &big[14..14 + 28];
    let want = icmp_error(
        (3, 4, [0, 0, 0x05, 0x64]),
        VIP,
        CLIENT,
        quote,
        (BALANCER_MAC, mac_of(CLIENT)),
    );
    assert_eq!(out, want, "ICMP fragmentation needed, MTU 1380");
    assert!(icmp_checksums_valid(&out));
    assert_eq!(global(&env).icmp_too_big, 1);
    // Without DF: wrapped, and left to the kernel to fragment (still
    // addressed to this host's MAC).
    let mut no_df = big.clone();
    no_df[20] = 0;
    let sum = huddle_user::kernel::packet::checksum(
        &{
            let mut h = no_df[14..34].to_vec();
            h[10] = 0;
            h[11] = 0;
            h
        },
        0,
    );
    no_df[24..26].copy_from_slice(&sum.to_be_bytes());
    let (verdict, out) = env.run(&no_df).unwrap();
    assert_eq!(verdict, XDP_PASS, "to the kernel, to fragment");
    assert_eq!(out.len(), no_df.len() + 20);
    assert_eq!(out[..12], no_df[..12], "still addressed to this host");
    assert_eq!(out[34..], no_df[14..], "the client's packet inside");
    assert_eq!(global(&env).encap_fragmented, 1);
    // One that fits is wrapped as ever.
    let fits = client(45000, IPIP)
        .flags(ACK | PSH)
        .payload(&[0x61; 1340])
        .build();
    let (verdict, out) = env.run(&fits).unwrap();
    assert_eq!(verdict, XDP_TX);
    assert_eq!(out.len(), fits.len() + 20);
    assert_eq!(global(&env).icmp_too_big, 1);
    // A spoofed flood of big DF packets is not reflected at its rate:
    // past a burst, one answer a millisecond (`icmp::gate`).
    let start = std::time::Instant::now();
    let answered = (0..400)
        .filter(|_| env.run(&big).unwrap().0 == XDP_TX)
        .count() as u64;
    let ms = start.elapsed().as_millis() as u64;
    let g = global(&env);
    assert!(answered <= 50 + ms + 1, "{answered} answers in {ms} ms");
    assert_eq!(
        (g.icmp_too_big, g.icmp_rate_limited),
        (1 + answered, 400 - answered)
    );
}

/// The ACK clock's samples of one source go to its backend's heavy-source
/// histogram once it gave most of them; another /24's to the other one.
#[test]
fn a_backends_samples_are_kept_apart_by_their_heaviest_source() {
    let env = env("dsr-heavy");
    let other = Ipv4Addr::new(10, 213, 7, 2);
    let from = |ip: Ipv4Addr, sport: u16| {
        Frame::tcp((ip, sport), (VIP, L2)).macs(mac_of(ip), BALANCER_MAC)
    };
    // A flow of `ip` and its backend.
    let open = |ip: Ipv4Addr, sport: u16| {
        let (_, out) = env
            .run(&from(ip, sport).syn().seq_ack(100, 0).build())
            .unwrap();
        env.run(&from(ip, sport).flags(ACK).seq_ack(101, 7001).build())
            .unwrap();
        by_mac(&out)
    };
    // `n` request turns on it, each answered (the client's pure ACK).
    let turns = |ip: Ipv4Addr, sport: u16, n: u32| {
        for k in 0..n {
            let req = from(ip, sport)
                .flags(ACK | PSH)
                .seq_ack(101 + 18 * k, 7001 + 200 * k)
                .payload(b"GET / HTTP/1.1\r\n\r\n");
            env.run(&req.build()).unwrap();
            let ack = from(ip, sport)
                .flags(ACK)
                .seq_ack(119 + 18 * k, 7201 + 200 * k);
            env.run(&ack.build()).unwrap();
        }
    };
    let b = open(CLIENT, 43000);
    let sport = (43001..44000)
        .find(|p| open(other, *p) == b)
        .expect("a flow of the other /24 on the same backend");
    turns(CLIENT, 43000, 3);
    turns(other, sport, 1);
    let i = (0..3).position(|i| backend(i) == b).unwrap();
    let id = env.dp.services[0].backend_ids[i];
    let count = |h: huddle_common::Latency| h.buckets.iter().sum::<u64>();
    let (all, heavy) = (
        count(env.dp.latency(id).unwrap()),
        count(env.dp.latency_parts(id).unwrap().1),
    );
    assert_eq!((all, heavy), (4, 3), "the heavy source's 3, the other's 1");
}
