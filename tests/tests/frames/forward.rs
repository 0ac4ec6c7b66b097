//! Next hops: unresolved neighbours and clients sharing a next-hop slot.

use super::fixture::*;

#[test]
fn unresolved_neighbour_hands_the_rewritten_packet_to_the_kernel() {
    require_root();
    // Backend with no neighbour entry.
    let env = ProgRun::new(
        &unique("pr-neigh"),
        &config(&[backend(5)], false),
        &[CLIENT],
    )
    .unwrap();
    let input = client_frame(40000).syn().build();
    let (verdict, out) = env.run(&input).unwrap();
    assert_eq!(verdict, XDP_PASS, "must go to the kernel, not be dropped");
    let ((src, nat_port), (dst, _)) = endpoints(&out);
    assert_eq!((src, dst), (BALANCER_IP, backend(5)));
    // Addresses rewritten and checksums valid; MACs left for the kernel.
    let expected = Frame::tcp((BALANCER_IP, nat_port), (backend(5), 8080))
        .syn()
        .macs(mac_of(CLIENT), BALANCER_MAC)
        .build();
    assert_eq!(out, expected);
    assert_eq!(env.dp.global_stats().unwrap().pass_no_neigh, 1);
}

#[test]
fn replies_to_clients_sharing_a_next_hop_slot_each_get_their_own_neighbour() {
    require_root();
    // One CPU: the cache is per CPU, and the clients must meet in one.
    pin_to(0);
    let others = clients_sharing_a_hop_slot(2);
    let (b_client, unresolved) = (others[0], others[1]);
    let backends = [backend(0)];
    let env = ProgRun::new(
        &unique("pr-hop"),
        &config(&backends, false),
        &[backend(0), CLIENT, b_client],
    )
    .unwrap();
    // A flow from each client; the third has no neighbour entry.
    let open = |client: Ipv4Addr| {
        let syn = Frame::tcp((client, 40000), (VIP, 80))
            .syn()
            .macs(mac_of(client), BALANCER_MAC);
        let (v, out) = env.run(&syn.build()).unwrap();
        assert_eq!(v, XDP_TX);
        endpoints(&out).0 .1
    };
    let ports: Vec<(Ipv4Addr, u16)> = [CLIENT, b_client, unresolved, CLIENT]
        .into_iter()
        .map(|c| (c, open(c)))
        .collect();
    let reply = |nat_port: u16| {
        Frame::tcp((backend(0), 8080), (BALANCER_IP, nat_port))
            .flags(SYN | ACK)
            .macs(mac_of(backend(0)), BALANCER_MAC)
            .build()
    };
    // Alternating clients in one slot: each reply takes its own client's
    // neighbour, never the one the slot held before.
    for (client, port) in ports.iter().chain(ports.iter()) {
        let (v, out) = env.run(&reply(*port)).unwrap();
        if *client == unresolved {
            assert_eq!(v, XDP_PASS, "no neighbour for {client}: the kernel's");
            continue;
        }
        assert_eq!(v, XDP_TX, "reply to {client}");
        let expected = Frame::tcp((VIP, 80), (*client, 40000))
            .flags(SYN | ACK)
            .macs(BALANCER_MAC, mac_of(*client))
            .build();
        assert_eq!(out, expected, "reply to {client}");
    }
    assert_eq!(env.dp.global_stats().unwrap().pass_no_neigh, 2);
}
