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
