//! Latency: one sample per request turn, to its backend.

use super::fixture::*;

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
