//! Rings: swaps steer new flows, take turns, move flows off dead backends.

use super::fixture::*;

#[test]
fn ring_swap_steers_new_flows_and_keeps_established_ones() {
    let env = env("pr-swap");
    let mut env = env;
    let ids = env.dp.services[0].backend_ids.clone();
    env.dp.swap_ring(0, &ids[..1]).unwrap();
    // Established (handshake complete): a half-open one could lose its
    // slot to one of the SYNs below when they hash to it (1,024 slots,
    // a fresh random seed each run: about one run in fifty).
    let (b, nat_port) = establish(&env, 42000, &[backend(0)]);
    assert_eq!(b, backend(0));
    for round in 0..20 {
        // Alternate the ring between backend 1 and backend 2 only.
        let only = if round % 2 == 0 { 1 } else { 2 };
        env.dp.swap_ring(0, &ids[only..=only]).unwrap();
        let (nb, _) = open_flow(&env, 43000 + round, &[backend(only as u8)]);
        assert_eq!(nb, backend(only as u8));
        // The established flow stays on backend 0.
        let (verdict, out) = env.run(&client_frame(42000).flags(ACK).build()).unwrap();
        assert_eq!(verdict, XDP_TX);
        assert_eq!(
            endpoints(&out),
            ((BALANCER_IP, nat_port), (backend(0), 8080))
        );
    }
    // An empty ring drops new flows (counted) but not established ones.
    env.dp.swap_ring(0, &[]).unwrap();
    let (verdict, _) = env.run(&client_frame(44000).syn().build()).unwrap();
    assert_eq!(verdict, XDP_DROP);
    assert_eq!(env.dp.service_stats(0).unwrap().drop_no_backend, 1);
    let (verdict, _) = env.run(&client_frame(42000).flags(ACK).build()).unwrap();
    assert_eq!(verdict, XDP_TX);
}

/// Round robin, a cursor per CPU: consecutive SYNs take the ring's
/// entries in order and go round; after a swap to a shorter ring, the
/// cursor, now past its end, wraps into it (here to its first entry).
#[test]
fn new_flows_take_the_ring_in_turn_and_a_shorter_ring_from_its_start() {
    let mut env = env("pr-turns");
    pin_to(0);
    let all = [backend(0), backend(1), backend(2)];
    let got: Vec<Ipv4Addr> = (0..7).map(|i| open_flow(&env, 46000 + i, &all).0).collect();
    let first = all.iter().position(|b| *b == got[0]).unwrap();
    let want: Vec<_> = (0..7).map(|i| all[(first + i) % 3]).collect();
    assert_eq!(got, want, "in turn");
    // Up to the ring's last entry, so the cursor stands at 2.
    let next = (first + 7) % 3;
    for i in 0..(5 - next) % 3 {
        open_flow(&env, 46100 + i as u16, &all);
    }
    let ids = env.dp.services[0].backend_ids.clone();
    env.dp.swap_ring(0, &ids[..2]).unwrap();
    let two = [backend(0), backend(1)];
    let got: Vec<Ipv4Addr> = (0..3).map(|i| open_flow(&env, 46200 + i, &two).0).collect();
    assert_eq!(
        got,
        [two[0], two[1], two[0]],
        "the shorter ring from its start"
    );
}

#[test]
fn flows_of_a_backend_marked_dead_move_to_the_ring() {
    let mut env = env("pr-move");
    let ids = env.dp.services[0].backend_ids.clone();
    env.dp.swap_ring(0, &ids[..1]).unwrap();
    let (b, _) = establish(&env, 42500, &[backend(0)]);
    assert_eq!(b, backend(0));
    // Backend 0 dies: out of the ring, and marked so its flows move.
    env.dp.swap_ring(0, &ids[1..2]).unwrap();
    env.dp
        .set_backend_flags(
            ids[0],
            (backend(0), 8080).into(),
            huddle_common::backend_flags::MOVE_FLOWS,
        )
        .unwrap();
    let data = client_frame(42500).flags(ACK | PSH).payload(b"more");
    let (verdict, out) = env.run(&data.build()).unwrap();
    assert_eq!(verdict, XDP_TX);
    let ((src, port), (dst, _)) = endpoints(&out);
    assert_eq!(
        (src, dst),
        (BALANCER_IP, backend(1)),
        "the flow moved to the ring"
    );
    assert!(checksums_valid(&out));
    assert_eq!(env.dp.backend_stats(ids[0]).unwrap().flows_moved, 1);
    // The new backend's answer (a RST, for TCP) reaches the client.
    let rst = Frame::tcp((backend(1), 8080), (BALANCER_IP, port))
        .flags(RST | ACK)
        .macs(mac_of(backend(1)), BALANCER_MAC)
        .build();
    let (verdict, out) = env.run(&rst).unwrap();
    assert_eq!(verdict, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 42500)));
    // It stays there: the next packet does not move again.
    let (_, out) = env.run(&data.build()).unwrap();
    assert_eq!(endpoints(&out).1 .0, backend(1));
    assert_eq!(env.dp.backend_stats(ids[0]).unwrap().flows_moved, 1);
    // Without the mark, an established flow stays on a backend out of the ring.
    env.dp
        .set_backend_flags(ids[0], (backend(0), 8080).into(), 0)
        .unwrap();
    let (b2, _) = {
        env.dp.swap_ring(0, &ids[..1]).unwrap();
        establish(&env, 42501, &[backend(0)])
    };
    env.dp.swap_ring(0, &ids[1..2]).unwrap();
    let (_, out) = env.run(&client_frame(42501).flags(ACK).build()).unwrap();
    assert_eq!(endpoints(&out).1 .0, b2);
}
