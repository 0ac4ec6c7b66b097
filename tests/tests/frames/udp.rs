//! UDP: checksums both ways, flows established by the client's datagram after an answer.

use super::fixture::*;

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

/// One datagram, its answer, one more: a UDP flow established on one
/// exchange, which a sender that spoofs its address can make blind.
/// Returns the tuple it took, or `None` if the first datagram was dropped.
fn pair(env: &ProgRun, src: Ipv4Addr, sport: u16) -> Option<(Ipv4Addr, u16)> {
    let q = Frame::udp((src, sport), (VIP, 53))
        .payload(b"q")
        .macs(mac_of(CLIENT), BALANCER_MAC)
        .build();
    let (v, out) = env.run(&q).unwrap();
    if v != XDP_TX {
        return None;
    }
    let ((_, p), (b, _)) = endpoints(&out);
    // Marks the flow answered; to a made-up client with no neighbour
    // entry it goes to the kernel (PASS), which is where a spoofer's go.
    env.run(&udp_answer(b, p)).unwrap();
    assert_eq!(env.run(&q).unwrap().0, XDP_TX);
    Some((b, p))
}

/// Spoofed pairs fill this CPU's NAT tuples: a real client's new flow is
/// refused. After `UDP_UNCONFIRMED_IDLE_NS` (2 s) of silence their tuples
/// are free again, but not that of a confirmed flow (two exchanges), which
/// keeps its tuple and its answers.
#[test]
fn spoofed_udp_pairs_hold_their_tuples_two_seconds_a_confirmed_flow_keeps_its_own() {
    require_root();
    pin_to(0);
    let mut cfg = config(&[backend(0)], true);
    let ports = 16 * cpus() as u16;
    cfg.nat_ports = PortRange {
        min: 20000,
        max: 20000 + ports - 1,
    };
    let env = ProgRun::new(&unique("pr-udp-idle"), &cfg, &[backend(0), CLIENT]).unwrap();
    let id = env.dp.services[1].backend_ids[0];
    // A real client, two exchanges: confirmed.
    let (b, port) = pair(&env, CLIENT, 41200).expect("the real flow");
    assert_eq!(env.run(&udp_answer(b, port)).unwrap().0, XDP_TX);
    let (_, out) = env.run(&udp_frame(41200).build()).unwrap();
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 5353)));
    // Spoofed pairs until no tuple of this CPU's 16 is left.
    let spoofer = |i: u32| Ipv4Addr::new(10, 213, 200 + (i >> 8) as u8, i as u8);
    let held = (0..64u32)
        .map_while(|i| pair(&env, spoofer(i), 40000))
        .count() as u64;
    println!("{held} spoofed pairs hold a tuple each");
    assert_eq!(held, 15, "this CPU's slice less the real flow's tuple");
    let (v, _) = env.run(&udp_frame(41201).build()).unwrap();
    assert_eq!(v, XDP_DROP, "no tuple left for a real client's new flow");
    std::thread::sleep(std::time::Duration::from_millis(2300));
    // Silent 2.3 s: every spoofed pair's tuple is free, the real one not.
    let (v, _) = env.run(&udp_frame(41201).build()).unwrap();
    assert_eq!(v, XDP_TX, "the real client's new flow has a tuple now");
    let again = (1000..1064u32)
        .map_while(|i| pair(&env, spoofer(i), 40000))
        .count() as u64;
    let freed = env.dp.backend_stats(id).unwrap().udp_unconfirmed_freed;
    println!("then {again} new pairs; {freed} silent unconfirmed flows freed");
    assert_eq!(freed, held, "every spoofed pair's tuple, none else");
    let (_, out) = env.run(&udp_frame(41200).build()).unwrap();
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 5353)));
    let (v, out) = env.run(&udp_answer(b, port)).unwrap();
    assert_eq!(v, XDP_TX, "the confirmed flow still has its NAT entry");
    assert_eq!(endpoints(&out), ((VIP, 53), (CLIENT, 41200)));
}
