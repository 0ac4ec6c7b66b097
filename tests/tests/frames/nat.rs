//! NAT tuples: the ordered walk, reuse of finished tuples, TIME_WAIT, a second SNAT address.

use super::fixture::*;

#[test]
fn a_closed_flow_reused_by_a_new_syn_gets_a_new_nat_entry() {
    let env = env("pr-reuse");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, port) = open_flow(&env, 45000, &ring);
    let (v, _) = env
        .run(&client_frame(45000).flags(FIN | ACK).build())
        .unwrap();
    assert_eq!(v, XDP_TX);
    let (b2, port2) = open_flow(&env, 45000, &ring);
    // The old NAT entry is gone: a late reply to it is not translated.
    if (b2, port2) != (b, port) {
        let stale = Frame::tcp((b, 8080), (BALANCER_IP, port))
            .flags(ACK)
            .build();
        let (v, out) = env.run(&stale).unwrap();
        assert_eq!((v, out), (XDP_PASS, stale));
    }
    // RST from the backend is counted against it.
    let rst = Frame::tcp((b2, 8080), (BALANCER_IP, port2))
        .flags(RST)
        .build();
    assert_eq!(env.run(&rst).unwrap().0, XDP_TX);
    let id = env.dp.services[0].backend_ids[ring.iter().position(|x| *x == b2).unwrap()];
    assert_eq!(env.dp.backend_stats(id).unwrap().rsts_from, 1);
}

#[test]
fn nat_ports_of_finished_flows_are_reused_but_live_ones_never_stolen() {
    require_root();
    let mut cfg = config(&[backend(0)], false);
    cfg.nat_ports = PortRange {
        min: 20000,
        max: 20000,
    };
    let env = ProgRun::new(&unique("pr-nat"), &cfg, &[backend(0), CLIENT]).unwrap();
    let (_, port) = establish(&env, 46000, &[backend(0)]);
    assert_eq!(port, 20000);
    // The only port is held by a live flow: a second flow is refused.
    let (v, _) = env.run(&client_frame(46001).syn().build()).unwrap();
    assert_eq!(v, XDP_DROP);
    assert_eq!(env.dp.service_stats(0).unwrap().drop_nat_ports, 1);
    // Once the first flow closes and lingers for its last segments, its port
    // serves the next flow.
    assert_eq!(
        env.run(&client_frame(46000).flags(FIN | ACK).build())
            .unwrap()
            .0,
        XDP_TX
    );
    let (v, _) = env.run(&client_frame(46001).syn().build()).unwrap();
    assert_eq!(v, XDP_DROP, "a just-closed flow's port must linger");
    std::thread::sleep(std::time::Duration::from_nanos(
        huddle_common::NAT_LINGER_NS + 100_000_000,
    ));
    let (_, port) = open_flow(&env, 46001, &[backend(0)]);
    assert_eq!(port, 20000);
    // Replies on that port now belong to the new flow.
    let reply = Frame::tcp((backend(0), 8080), (BALANCER_IP, 20000))
        .flags(SYN | ACK)
        .build();
    let (v, out) = env.run(&reply).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).1, (CLIENT, 46001));
}

#[test]
fn nat_tuples_walk_each_cpus_own_slice_in_order() {
    let env = nat_env("pr-slice", 1000, &[BALANCER_IP]);
    let n = cpus();
    let slice = 1000 / n as u16;
    for cpu in 0..n.min(2) {
        pin_to(cpu);
        let base = 20000 + cpu as u16 * slice;
        let ports: Vec<u16> = (0..5)
            .map(|i| syn_tuple(&env, 41000 + cpu as u16 * 100 + i).1)
            .collect();
        // Where the walk starts moves with the clock; from there it takes
        // one port after the other, within this CPU's slice only.
        let first = ports[0];
        let want: Vec<u16> = (0..5).map(|i| base + (first - base + i) % slice).collect();
        assert!(
            (base..base + slice).contains(&first),
            "CPU {cpu}: {first} is outside its slice {base}..{}",
            base + slice
        );
        assert_eq!(ports, want, "CPU {cpu} walks its slice in order");
    }
}

#[test]
fn a_slice_gone_round_hands_out_its_oldest_tuple_and_counts_the_early_reuse() {
    // Two ports per CPU: the third SYN comes back to the first tuple.
    let n = cpus() as u16;
    let env = nat_env("pr-wrap", 2 * n, &[BALANCER_IP]);
    pin_to(0);
    let got: Vec<u16> = (0..7).map(|i| syn_tuple(&env, 42000 + i).1).collect();
    let (x, y) = (got[0], got[1]);
    assert_eq!(
        [x.min(y), x.max(y)],
        [20000, 20001],
        "CPU 0's slice is 20000-20001: {got:?}"
    );
    assert_eq!(
        got,
        vec![x, y, x, y, x, y, x],
        "the oldest tuple goes first"
    );
    let id = env.dp.services[0].backend_ids[0];
    let st = env.dp.backend_stats(id).unwrap();
    // Rounds of two SYNs take far less than TIME_WAIT. Counting starts
    // once a whole round of this run is over: from the fifth SYN when the
    // walk began at the slice's start, the fourth when it began mid-slice.
    let want = if x == 20000 { 3 } else { 4 };
    assert_eq!(st.nat_reuse_early, want, "{st:?}");
}

#[test]
fn a_tuple_an_established_flow_holds_is_skipped_when_the_slice_comes_round() {
    let n = cpus() as u16;
    let env = nat_env("pr-skip", 2 * n, &[BALANCER_IP]);
    pin_to(0);
    let (_, held) = establish(&env, 43000, &[backend(0)]);
    let other = if held == 20000 { 20001 } else { 20000 };
    // The other port, then round: the first is a live flow's, so the
    // other again.
    assert_eq!(syn_tuple(&env, 43001).1, other);
    assert_eq!(syn_tuple(&env, 43002).1, other);
    // The established flow still owns its tuple both ways.
    let reply = Frame::tcp((backend(0), 8080), (BALANCER_IP, held))
        .flags(ACK | PSH)
        .payload(b"ok")
        .macs(mac_of(backend(0)), BALANCER_MAC);
    let (v, out) = env.run(&reply.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).1, (CLIENT, 43000));
}

/// The backend closed first, so it holds the tuple in TIME_WAIT with the
/// client's last timestamp: when the slice comes round, a SYN whose own
/// timestamp is older (the backend would answer it with an ACK of the old
/// connection, and the client wait a retransmission) is given another
/// tuple; a newer one takes it.
#[test]
fn a_tuple_whose_time_wait_would_refuse_the_syn_is_passed_over() {
    let n = cpus() as u16;
    let env = nat_env("pr-tw", 2 * n, &[BALANCER_IP]);
    pin_to(0);
    let (_, held) = establish(&env, 48000, &[backend(0)]);
    let other = if held == 20000 { 20001 } else { 20000 };
    let last = 3_000_000_000u32;
    closed_by_backend(&env, 48000, held, last);
    let syn = |sport: u16, ts: Option<u32>| syn_ts(&env, sport, ts);
    let id = env.dp.services[0].backend_ids[0];
    let skipped = || env.dp.backend_stats(id).unwrap().nat_tw_skipped;
    assert_eq!(syn(48001, None), other);
    // Round again: older by the wrapping comparison TCP uses.
    assert_eq!(syn(48002, Some(last.wrapping_add(1u32 << 31))), other);
    assert_eq!(skipped(), 1);
    assert_eq!(syn(48003, Some(last - 5)), other);
    assert_eq!(skipped(), 2);
    assert_eq!(syn(48004, Some(last.wrapping_add(1000))), held);
    assert_eq!(skipped(), 2);
}

/// The same TIME_WAIT after the client reused its port: the new
/// connection on that client tuple takes the flow entry that held the
/// old one's timestamp (wrk does this within ~1.2 s at 24,000 new
/// connections a second), and the tuple must still be passed over.
#[test]
fn a_time_wait_is_remembered_after_the_client_reuses_its_port() {
    let n = cpus() as u16;
    let env = nat_env("pr-twr", 3 * n, &[BALANCER_IP]);
    pin_to(0);
    let (_, held) = establish(&env, 48100, &[backend(0)]);
    let last = 3_000_000_000u32;
    closed_by_backend(&env, 48100, held, last);
    // The client's next connection from the same port: the next tuple.
    let (_, second) = establish(&env, 48100, &[backend(0)]);
    assert_ne!(second, held);
    let syn = |sport: u16, ts: Option<u32>| syn_ts(&env, sport, ts);
    let third = syn(48101, None);
    assert!(third != held && third != second, "{held} {second} {third}");
    let id = env.dp.services[0].backend_ids[0];
    let skipped = || env.dp.backend_stats(id).unwrap().nat_tw_skipped;
    // Round: `held` would be refused, `second` is live.
    assert_eq!(syn(48102, Some(last - 5)), third);
    assert_eq!(skipped(), 1);
    assert_eq!(syn(48103, Some(last.wrapping_add(1000))), held);
    assert_eq!(skipped(), 1);
}

/// Closes the flow from client port `sport` on NAT port `held` backend
/// first: the backend's FIN, then the client's with timestamp `last`;
/// returns once the tuple's linger is over.
fn closed_by_backend(env: &ProgRun, sport: u16, held: u16, last: u32) {
    let fin = Frame::tcp((backend(0), 8080), (BALANCER_IP, held))
        .flags(FIN | ACK)
        .seq_ack(7001, 1001)
        .macs(mac_of(backend(0)), BALANCER_MAC);
    assert_eq!(env.run(&fin.build()).unwrap().0, XDP_TX);
    let client_fin = client_frame(sport)
        .flags(FIN | ACK)
        .seq_ack(1001, 7002)
        .options(&ts_options(false, last));
    let (v, out) = env.run(&client_fin.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).0, (BALANCER_IP, held));
    std::thread::sleep(std::time::Duration::from_nanos(
        huddle_common::NAT_LINGER_NS + 100_000_000,
    ));
}

/// The NAT port a SYN from `sport` (with timestamp `ts`, if any) gets.
fn syn_ts(env: &ProgRun, sport: u16, ts: Option<u32>) -> u16 {
    let f = client_frame(sport).syn();
    let f = match ts {
        Some(t) => f.options(&ts_options(true, t)),
        None => f,
    };
    let (v, out) = env.run(&f.build()).unwrap();
    assert_eq!(v, XDP_TX);
    endpoints(&out).0 .1
}

#[test]
fn a_second_snat_address_doubles_the_tuples_and_its_replies_come_back() {
    let second = Ipv4Addr::new(10, 213, 0, 3);
    let n = cpus() as u16;
    // One port per CPU, two addresses: two tuples before the round ends.
    let env = nat_env("pr-snat2", n, &[BALANCER_IP, second]);
    pin_to(0);
    let got: Vec<(Ipv4Addr, u16)> = (0..3).map(|i| syn_tuple(&env, 44000 + i)).collect();
    assert!(got.iter().all(|t| t.1 == 20000), "{got:?}");
    assert_ne!(got[0].0, got[1].0, "both addresses are used: {got:?}");
    assert_eq!(got[2], got[0], "then the oldest again: {got:?}");
    // The SYN-ACK to the second SYN's address reaches the client of port
    // 44001.
    let addr = got[1].0;
    let synack = Frame::tcp((backend(0), 8080), (addr, 20000))
        .flags(SYN | ACK)
        .seq_ack(9000, 1001)
        .macs(mac_of(backend(0)), BALANCER_MAC);
    let (v, out) = env.run(&synack.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 44001)));
    assert!(checksums_valid(&out));
    // Its handshake completes and the flow keeps that address.
    let ack = client_frame(44001).flags(ACK).seq_ack(1001, 9001);
    let (v, out) = env.run(&ack.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((addr, 20000), (backend(0), 8080)));
}

/// Both sides finished (the client's FIN, the backend's, the last ACK):
/// once the flow has been quiet a while, the walk hands its tuple to a SYN
/// without asking the NAT table, and the old flow's entries, left in
/// place, stay out of the new flow's way: a late segment of the old
/// connection still goes to its own client, the SYN-ACK to the new one,
/// the old client's late ACK is not translated, and the old client's next
/// connection does not take the new flow's NAT entry with it.
#[test]
fn a_tuple_both_sides_finished_with_is_taken_at_once_and_the_old_flow_stays_clear() {
    let n = cpus() as u16;
    let env = nat_env("pr-done", 2 * n, &[BALANCER_IP]);
    pin_to(0);
    let b = backend(0);
    let from_backend = |port: u16, flags: u8, seq: u32, ack: u32| {
        Frame::tcp((b, 8080), (BALANCER_IP, port))
            .flags(flags)
            .seq_ack(seq, ack)
            .macs(mac_of(b), BALANCER_MAC)
    };
    let (_, old) = establish(&env, 49000, &[b]);
    forward(
        &env,
        client_frame(49000).flags(FIN | ACK).seq_ack(1001, 7001),
    );
    forward(&env, from_backend(old, FIN | ACK, 7001, 1002));
    forward(&env, client_frame(49000).flags(ACK).seq_ack(1002, 7002));
    // The slice's other tuple, then round to the finished one once quiet.
    let other = syn_tuple(&env, 49001).1;
    assert_ne!(other, old);
    std::thread::sleep(std::time::Duration::from_nanos(
        huddle_common::nat_used::QUIET_NS + 100_000_000,
    ));
    assert_eq!(syn_tuple(&env, 49002).1, old);
    // A late segment of the old connection: its own client (a lookup on
    // the SYN would have removed its NAT entry, and sent it to 49002).
    let late = from_backend(old, ACK | PSH, 7001, 1002).payload(b"late");
    let (v, out) = env.run(&late.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).1, (CLIENT, 49000));
    // The new connection's SYN-ACK reaches the new client, whose ACK
    // promotes it onto the tuple.
    let (v, out) = env
        .run(&from_backend(old, SYN | ACK, 9000, 1001).build())
        .unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).1, (CLIENT, 49002));
    let (v, out) = env
        .run(&client_frame(49002).flags(ACK).seq_ack(1001, 9001).build())
        .unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).0, (BALANCER_IP, old));
    // The old client's late ACK is not put on the tuple.
    let (v, _) = env
        .run(&client_frame(49000).flags(ACK).seq_ack(1002, 7002).build())
        .unwrap();
    assert_ne!(
        v, XDP_TX,
        "a finished flow's segment went out on a tuple another flow holds"
    );
    // The old client's next connection (its port again) takes the other
    // tuple and leaves the new flow's NAT entry alone.
    let (_, again) = establish(&env, 49000, &[b]);
    assert_eq!(again, other);
    let reply = from_backend(old, ACK | PSH, 9001, 1001).payload(b"ok");
    let (v, out) = env.run(&reply.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out).1, (CLIENT, 49002));
}
