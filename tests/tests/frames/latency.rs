//! Latency: one sample per request turn, to its backend, timed from the
//! request's last segment.

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
        // More request segments restart the wait, not the turn.
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
    // One client: both are its heavy source's (`HeavySource`).
    let heavy = env.dp.latency_parts(id).unwrap().1;
    assert_eq!(heavy.buckets.iter().sum::<u64>(), 2);
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

/// A request sent in pieces over 60 ms (an upload, a dribbling client)
/// and answered 3 ms after its last piece: the backend is timed from the
/// last piece, so the sample is the backend's 3 ms, not the client's 63.
#[test]
fn a_request_sent_slowly_is_timed_from_its_last_segment() {
    let env = env("pr-upload");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, nat_port) = establish(&env, 40200, &ring);
    let id = backend_id(&env, b);
    let from_backend =
        || Frame::tcp((b, 8080), (BALANCER_IP, nat_port)).macs(mac_of(b), BALANCER_MAC);
    let piece = |seq: u32| {
        client_frame(40200)
            .flags(ACK | PSH)
            .seq_ack(seq, 7001)
            .payload(&[b'x'; 100])
    };
    for (i, seq) in (1001u32..).step_by(100).take(4).enumerate() {
        if i > 0 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        forward(&env, piece(seq));
    }
    std::thread::sleep(std::time::Duration::from_millis(3));
    forward(
        &env,
        from_backend()
            .flags(ACK | PSH)
            .seq_ack(7001, 1401)
            .payload(b"HTTP/1.1 200 OK\r\n"),
    );
    let st = env.dp.backend_stats(id).unwrap();
    assert_eq!(
        (st.turns, st.answered),
        (1, 1),
        "one turn, one sample: {st:?}"
    );
    assert!(
        (3_000_000..40_000_000).contains(&st.ttfb_ns),
        "timed from the last piece: {} ns (the whole upload took 60 ms)",
        st.ttfb_ns
    );
}

/// Data a backend goes on sending on a flow whose turn it has answered (a
/// download its kernel drains while the process is hung, a retransmission)
/// answers no turn: what it owes on another flow stays owed, and only that
/// flow's answer clears it. (Any data cleared it: a hung backend draining
/// a slowly read download was called hung after 600 ms, not 300.)
#[test]
fn data_answering_no_turn_leaves_the_backends_owed_answer_owed() {
    let env = env("pr-drain");
    let ring = [backend(0), backend(1), backend(2)];
    // Of four flows over three backends, two share one.
    let flows: Vec<(u16, Ipv4Addr, u16)> = (40300..40304)
        .map(|sport| {
            let (b, port) = establish(&env, sport, &ring);
            (sport, b, port)
        })
        .collect();
    let (a, c) = (0..4)
        .flat_map(|i| (i + 1..4).map(move |j| (i, j)))
        .find(|&(i, j)| flows[i].1 == flows[j].1)
        .map(|(i, j)| (flows[i], flows[j]))
        .expect("two flows on one backend");
    let b = a.1;
    let id = backend_id(&env, b);
    let from = |port: u16| Frame::tcp((b, 8080), (BALANCER_IP, port)).macs(mac_of(b), BALANCER_MAC);
    let request = |sport: u16| {
        client_frame(sport)
            .flags(ACK | PSH)
            .seq_ack(1001, 7001)
            .payload(b"GET / HTTP/1.1\r\n\r\n")
    };
    // Flow a's turn, answered: the start of a long download.
    forward(&env, request(a.0));
    forward(
        &env,
        from(a.2)
            .flags(ACK | PSH)
            .seq_ack(7001, 1019)
            .payload(&[b'.'; 1000]),
    );
    assert_eq!(env.dp.pulse(id).unwrap().turn_wait_ns, 0);
    // Flow c's turn is owed; more of a's download does not answer it.
    forward(&env, request(c.0));
    let owed = env.dp.pulse(id).unwrap().turn_wait_ns;
    assert_ne!(owed, 0, "a request is owed an answer");
    for k in 1..=3u32 {
        forward(
            &env,
            from(a.2)
                .flags(ACK)
                .seq_ack(7001 + 1000 * k, 1019)
                .payload(&[b'.'; 1000]),
        );
    }
    assert_eq!(
        env.dp.pulse(id).unwrap().turn_wait_ns,
        owed,
        "data answering no turn settled what the backend owes"
    );
    assert_eq!(env.dp.backend_stats(id).unwrap().answered, 1);
    // c's answer settles it.
    forward(
        &env,
        from(c.2)
            .flags(ACK | PSH)
            .seq_ack(7001, 1019)
            .payload(b"HTTP/1.1 200 OK\r\n"),
    );
    assert_eq!(env.dp.pulse(id).unwrap().turn_wait_ns, 0);
    assert_eq!(env.dp.backend_stats(id).unwrap().answered, 2);
}

/// Evidence that a backend owing an answer is hung is further requests,
/// on any flow, counted and dated when each starts: not new connections
/// at their SYN (an idle one proves nothing), not more of a request (an
/// upload to a hung backend goes on as long as it lasts), and at most
/// `HUNG_EVIDENCE` (bounded writes of the shared line). (Counted at the
/// SYN, the requests below counted none.)
#[test]
fn requests_sent_while_an_answer_is_owed_are_the_evidence() {
    use huddle_common::HUNG_EVIDENCE;
    let env = env("pr-evid");
    let ring = [backend(0), backend(1), backend(2)];
    let flows: Vec<(u16, Ipv4Addr, u16)> = (40500..40518)
        .map(|sport| {
            let (b, port) = establish(&env, sport, &ring);
            (sport, b, port)
        })
        .collect();
    let b = flows[0].1;
    let on_b: Vec<(u16, u16)> = flows
        .iter()
        .filter(|f| f.1 == b)
        .map(|f| (f.0, f.2))
        .collect();
    let n = HUNG_EVIDENCE as usize;
    assert!(on_b.len() >= n + 2, "{} flows on one backend", on_b.len());
    let id = backend_id(&env, b);
    let pulse = || env.dp.pulse(id).unwrap();
    let first = |sport: u16| {
        client_frame(sport)
            .flags(ACK | PSH)
            .seq_ack(1001, 7001)
            .payload(b"POST / HTTP/1.1\r\n")
    };
    let more = |sport: u16| {
        client_frame(sport)
            .flags(ACK | PSH)
            .seq_ack(1019, 7001)
            .payload(b"X-More: 1\r\n")
    };
    // The first request owes; it is no evidence of its own.
    forward(&env, first(on_b[0].0));
    assert_ne!(pulse().turn_wait_ns, 0, "a request is owed an answer");
    assert_eq!(pulse().evidence, 0);
    let mut dated = 0;
    for (k, f) in on_b[1..=n].iter().enumerate() {
        forward(&env, first(f.0));
        let p = pulse();
        assert_eq!(p.evidence, k as u64 + 1, "{p:?}");
        assert!(p.evidence_ns >= dated, "{p:?}");
        dated = p.evidence_ns;
    }
    // Past the cap a request is counted and dated no more.
    forward(&env, first(on_b[n + 1].0));
    assert_eq!(
        (pulse().evidence, pulse().evidence_ns),
        (HUNG_EVIDENCE, dated)
    );
    // A new connection is no evidence.
    for sport in 40520..40523 {
        establish(&env, sport, &ring);
    }
    assert_eq!(
        (pulse().evidence, pulse().evidence_ns),
        (HUNG_EVIDENCE, dated)
    );
    // More of a request, owed or evidence, dates nothing.
    std::thread::sleep(std::time::Duration::from_millis(3));
    forward(&env, more(on_b[0].0));
    forward(&env, more(on_b[1].0));
    assert_eq!(
        (pulse().evidence, pulse().evidence_ns),
        (HUNG_EVIDENCE, dated)
    );
    // An answer settles what is owed; the next request owes afresh.
    forward(
        &env,
        Frame::tcp((b, 8080), (BALANCER_IP, on_b[2].1))
            .macs(mac_of(b), BALANCER_MAC)
            .flags(ACK | PSH)
            .seq_ack(7001, 1019)
            .payload(b"HTTP/1.1 200 OK\r\n"),
    );
    assert_eq!(pulse().turn_wait_ns, 0);
    let sport = (40524..40530)
        .find(|&sport| establish(&env, sport, &ring).0 == b)
        .expect("a new flow on the backend");
    forward(&env, first(sport));
    assert_ne!(pulse().turn_wait_ns, 0);
    assert_eq!(
        pulse().evidence,
        0,
        "a new owed answer's evidence starts at none"
    );
}

/// The tick's one read of every backend (`Dataplane::backend_snapshot`,
/// three batch lookups) gives what reading each alone gives.
#[test]
fn the_batch_read_of_every_backend_matches_reading_each() {
    let env = env("pr-snap");
    let ring = [backend(0), backend(1), backend(2)];
    for sport in 40400..40406 {
        let (_, _) = establish(&env, sport, &ring);
        forward(
            &env,
            client_frame(sport)
                .flags(ACK | PSH)
                .seq_ack(1001, 7001)
                .payload(b"GET / HTTP/1.1\r\n\r\n"),
        );
    }
    let snap = env.dp.backend_snapshot().unwrap();
    let ids = &env.dp.services[0].backend_ids;
    let mut turns = 0;
    for id in ids {
        let (st, pulse) = snap.get(*id).expect("every backend read");
        assert_eq!(st, env.dp.backend_stats(*id).unwrap(), "backend {id}");
        assert_eq!(pulse, env.dp.pulse(*id).unwrap(), "backend {id}");
        turns += st.turns;
    }
    assert_eq!(turns, 6, "six requests counted");
    let top = env
        .dp
        .services
        .iter()
        .flat_map(|s| s.backend_ids.iter().copied())
        .max()
        .unwrap();
    assert!(snap.get(top + 1).is_none());
}
