//! Retries: a refused or unanswered SYN goes to another backend; a TIME_WAIT refusal to another tuple.

use super::fixture::*;

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
