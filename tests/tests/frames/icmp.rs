//! ICMP errors about a translated flow reach its client translated back (IPv4; IPv6 in `ipv6`).

use super::fixture::*;

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

/// An ICMP error must be able to be real to reach a client: about TCP, it
/// quotes a sequence number where the client is (the SYN's own for a
/// half-open flow, within the flow's window for an open one); about UDP,
/// it comes from the backend. A forger who guessed a NAT tuple (the ports
/// are a known range) gets nothing through.
#[test]
fn a_forged_icmp_error_about_a_flow_is_dropped() {
    let env = env("pr-icmp-forged");
    let ring = [backend(0), backend(1), backend(2)];
    let router = Ipv4Addr::new(10, 213, 0, 254);
    let err = |from: Ipv4Addr, quoted: &[u8], b: Ipv4Addr| {
        icmp_error(
            (3, 4, [0, 0, 0x04, 0xb0]),
            from,
            BALANCER_IP,
            &quoted[ETH_LEN..ETH_LEN + 28],
            (mac_of(b), BALANCER_MAC),
        )
    };
    // Half-open: the client's SYN went out at 1000.
    let (b, port) = open_flow(&env, 46100, &ring);
    let far = 1000u32.wrapping_add(1 << 31);
    let forged = Frame::tcp((BALANCER_IP, port), (b, 8080))
        .syn()
        .seq_ack(far, 0)
        .build();
    assert_eq!(env.run(&err(router, &forged, b)).unwrap().0, XDP_DROP);
    let real = Frame::tcp((BALANCER_IP, port), (b, 8080)).syn().build();
    assert_eq!(env.run(&err(router, &real, b)).unwrap().0, XDP_TX);
    // Open: the client is at 1001.
    let (b, port) = establish(&env, 46101, &ring);
    let data = |seq: u32| {
        Frame::tcp((BALANCER_IP, port), (b, 8080))
            .flags(ACK)
            .seq_ack(seq, 7001)
            .build()
    };
    assert_eq!(
        env.run(&err(b, &data(1001 + (1 << 31)), b)).unwrap().0,
        XDP_DROP
    );
    assert_eq!(env.run(&err(b, &data(1001), b)).unwrap().0, XDP_TX);
    // UDP quotes nothing to check: only the backend's own errors count.
    let (_, out) = env.run(&udp_frame(46102).build()).unwrap();
    let ((_, nat_port), (ub, _)) = endpoints(&out);
    let sent = Frame::udp((BALANCER_IP, nat_port), (ub, 5353))
        .payload(b"query")
        .build();
    assert_eq!(env.run(&err(router, &sent, ub)).unwrap().0, XDP_DROP);
    assert_eq!(env.run(&err(ub, &sent, ub)).unwrap().0, XDP_TX);
    let g: GlobalStats = env.dp.global_stats().unwrap();
    assert_eq!((g.icmp_unproven, g.icmp_translated), (3, 3));
}

/// Each ICMP error the program translates is one a spoofer could send at
/// the packet rate (a UDP backend's own address is no secret): the gate
/// lets a burst of `ICMP_BURST` through, then one per `ICMP_EVERY_NS`, per
/// CPU, as Linux limits its own ICMP; the rest are dropped and counted.
#[test]
fn icmp_errors_past_the_rate_are_dropped_and_counted() {
    use huddle_common::{ICMP_BURST, ICMP_EVERY_NS};
    pin_to(0);
    let env = env("pr-icmp-rate");
    let (_, out) = env.run(&udp_frame(46200).build()).unwrap();
    let ((_, nat_port), (ub, _)) = endpoints(&out);
    let sent = Frame::udp((BALANCER_IP, nat_port), (ub, 5353))
        .payload(b"query")
        .build();
    let err = icmp_error(
        (3, 3, [0; 4]),
        ub,
        BALANCER_IP,
        &sent[ETH_LEN..ETH_LEN + 28],
        (mac_of(ub), BALANCER_MAC),
    );
    let sent_n = 1000u64;
    let start = std::time::Instant::now();
    let mut tx = 0u64;
    for _ in 0..sent_n {
        match env.run(&err).unwrap().0 {
            XDP_TX => tx += 1,
            v => assert_eq!(v, XDP_DROP),
        }
    }
    let elapsed = start.elapsed().as_nanos() as u64;
    let g: GlobalStats = env.dp.global_stats().unwrap();
    assert!(tx >= ICMP_BURST, "a burst goes through: {tx}");
    let allowed = ICMP_BURST + elapsed / ICMP_EVERY_NS + 1;
    assert!(
        tx <= allowed,
        "{tx} translated in {elapsed} ns, {allowed} allowed"
    );
    assert_eq!((g.icmp_translated, g.icmp_rate_limited), (tx, sent_n - tx));
}
