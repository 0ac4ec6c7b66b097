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
