//! Flows the balancer promotes on proof it cannot check have a table of
//! their own: twice the flow table's size of spoofed DSR handshakes (a SYN
//! and an ACK from each of 8,192 made-up clients, each promoted into
//! `DSR_FLOWS`) leaves a verified source-NAT flow in `FLOWS`, still
//! translated on its own tuple.

use super::fixture::*;
use huddle_user::config::Mode;

/// Flow table size of `config`'s balancers.
const TABLE: u32 = 4096;
const DSR_PORT: u16 = 8081;

#[test]
fn spoofed_dsr_handshakes_twice_the_table_leave_a_verified_snat_flow_in_place() {
    require_root();
    let backends = [backend(0), backend(1), backend(2)];
    let mut cfg = config(&backends, false);
    let mut dsr = Service::plain(
        (VIP, DSR_PORT).into(),
        Proto::Tcp,
        backends
            .iter()
            .map(|b| SocketAddr::from((*b, DSR_PORT)))
            .collect(),
    );
    dsr.mode = Mode::DsrL2;
    cfg.services.push(dsr);
    let mut neigh = backends.to_vec();
    neigh.push(CLIENT);
    let env = ProgRun::new(&unique("pr-budget"), &cfg, &neigh).expect("PROG_TEST_RUN namespace");
    let (b, port) = establish(&env, 45000, &backends);
    let spoofed = 2 * TABLE;
    for i in 0..spoofed {
        let src = Ipv4Addr::from(0x0a40_0000 + i);
        for flags in [SYN, ACK] {
            let f = Frame::tcp((src, 40000), (VIP, DSR_PORT))
                .flags(flags)
                .seq_ack(1 + u32::from(flags == ACK), 0)
                .macs([2, 0, 0, 0, 0, 1], BALANCER_MAC);
            assert_eq!(env.run(&f.build()).unwrap().0, XDP_TX, "spoofed {i}");
        }
    }
    let st = env.dp.service_stats(env.dp.services[1].id).unwrap();
    println!("{spoofed} spoofed DSR handshakes: {} promoted", st.promoted);
    assert_eq!(st.promoted, u64::from(spoofed), "{st:?}");
    // The verified flow's next segment: still its backend and tuple.
    let data = client_frame(45000)
        .flags(ACK | PSH)
        .seq_ack(1001, 7001)
        .payload(b"GET / HTTP/1.1\r\n\r\n");
    let (verdict, out) = env.run(&data.build()).unwrap();
    assert_eq!(verdict, XDP_TX, "the verified flow was evicted");
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 8080)));
}

/// Spoofed source-NAT UDP flows promoted on one exchange each (a datagram,
/// the backend's answer, a second datagram: no answer need reach the
/// sender) from 8,192 made-up clients, twice the table: they go to
/// `UDP_FLOWS` and `UDP_NAT`, and the verified TCP flow is still
/// translated both ways on its tuple.
#[test]
fn spoofed_udp_pairs_twice_the_table_leave_a_verified_snat_flow_in_place() {
    require_root();
    pin_to(0);
    let backends = [backend(0), backend(1), backend(2)];
    let mut neigh = backends.to_vec();
    neigh.push(CLIENT);
    let env = ProgRun::new(&unique("pr-budget-udp"), &config(&backends, true), &neigh)
        .expect("PROG_TEST_RUN namespace");
    let (b, port) = establish(&env, 45000, &backends);
    let spoofed = 2 * TABLE;
    for i in 0..spoofed {
        let src = Ipv4Addr::from(0x0a41_0000 + i);
        let q = Frame::udp((src, 40000), (VIP, 53))
            .payload(b"q")
            .macs([2, 0, 0, 0, 0, 1], BALANCER_MAC)
            .build();
        let (v, out) = env.run(&q).unwrap();
        assert_eq!(v, XDP_TX, "spoofed {i}");
        let ((_, p), (d, _)) = endpoints(&out);
        env.run(&udp_answer(d, p)).unwrap();
        assert_eq!(env.run(&q).unwrap().0, XDP_TX, "spoofed {i}, again");
    }
    let st = env.dp.service_stats(env.dp.services[1].id).unwrap();
    println!("{spoofed} spoofed UDP pairs: {} promoted", st.promoted);
    assert_eq!(st.promoted, u64::from(spoofed), "{st:?}");
    let data = client_frame(45000)
        .flags(ACK | PSH)
        .seq_ack(1001, 7001)
        .payload(b"GET / HTTP/1.1\r\n\r\n");
    let (verdict, out) = env.run(&data.build()).unwrap();
    assert_eq!(verdict, XDP_TX, "the verified flow was evicted");
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 8080)));
    let answer = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(ACK | PSH)
        .seq_ack(7001, 1019)
        .payload(b"HTTP/1.1 200 OK\r\n\r\n")
        .macs(mac_of(b), BALANCER_MAC);
    let (verdict, out) = env.run(&answer.build()).unwrap();
    assert_eq!(verdict, XDP_TX, "its NAT entry was evicted");
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 45000)));
}
