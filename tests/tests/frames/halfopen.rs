//! Half-open flows: floods never evict an established flow; short tags and losses.

use super::fixture::*;

#[test]
fn a_syn_flood_never_evicts_an_established_flow() {
    let env = env("pr-flood");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, port) = establish(&env, 47000, &ring);
    // 20,000 SYNs from spoofed sources: twenty times the half-open table
    // (1,024 here) and five times the flow table (4,096).
    for i in 0..20_000u32 {
        let src = Ipv4Addr::new(10, 213, 128 + (i >> 14) as u8, (i >> 6) as u8);
        let syn = Frame::tcp((src, 1024 + (i & 0x3fff) as u16), (VIP, 80))
            .syn()
            .macs(mac_of(CLIENT), BALANCER_MAC);
        let (v, _) = env.run(&syn.build()).unwrap();
        assert!(v == XDP_TX || v == XDP_PASS, "SYN {i}: verdict {v}");
    }
    let sv = env.dp.service_stats(0).unwrap();
    assert_eq!(sv.half_open, 20_001);
    assert_eq!(sv.promoted, 1);
    // The established flow still goes to its backend, and its replies
    // still find their NAT entry.
    let data = client_frame(47000).flags(ACK | PSH).payload(b"GET /");
    let (v, out) = env.run(&data.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 8080)));
    let reply = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(ACK | PSH)
        .payload(b"200")
        .macs(mac_of(b), BALANCER_MAC);
    let (v, out) = env.run(&reply.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 47000)));
    // And a real client still gets in during the flood.
    establish(&env, 47001, &ring);
}

/// A SYN reads its slots' short tags (`HALF_OPEN_TAGS`, `HALF_OPEN_NAT_TAGS`),
/// not the slots: they must say what the slots hold. A retransmitted SYN
/// is known as one (same tuple, nothing lost); a SYN on the slot of a
/// handshake under way takes it (one lost); one on the slot of a promoted
/// flow loses nothing.
#[test]
fn short_tags_tell_a_retransmission_a_handshake_under_way_and_a_free_slot_apart() {
    let env = nat_env("pr-tags", 1000, &[BALANCER_IP]);
    pin_to(0);
    let p0 = 44000;
    let s0 = client_slot(&env, p0);
    let first = syn_tuple(&env, p0);
    assert_eq!(
        syn_tuple(&env, p0),
        first,
        "a retransmission keeps its tuple"
    );
    assert_eq!(half_open_lost(&env), 0, "a retransmission takes nothing");

    let p1 = ports_where(&env, p0 + 1, |s| s == s0).next().unwrap();
    let second = syn_tuple(&env, p1);
    assert_ne!(second, first);
    assert_eq!(half_open_lost(&env), 1, "p1 took p0's handshake's slot");
    // p0's handshake is gone: its next SYN is a new flow, on a new tuple
    // (and takes the slot back from p1's).
    assert_ne!(syn_tuple(&env, p0), first);
    assert_eq!(half_open_lost(&env), 2);

    let p2 = ports_where(&env, p1 + 1, |s| s != s0).next().unwrap();
    let s2 = client_slot(&env, p2);
    establish(&env, p2, &[backend(0)]);
    let p3 = ports_where(&env, p2 + 1, |s| s == s2).next().unwrap();
    syn_tuple(&env, p3);
    assert_eq!(
        half_open_lost(&env),
        2,
        "a promoted flow's slot is free: its short tag was cleared"
    );
}

/// Both half-open tables modelled: 3,000 SYNs from distinct client ports
/// toward three backends, never answered, so both tables of 1,024 slots
/// fill and wrap. A SYN loses the handshake whose slot it takes when that
/// slot holds another tuple, on either side; the kernel counts this from
/// the short tags alone, and must count what the model does.
#[test]
fn half_open_losses_counted_from_short_tags_match_a_model_of_both_tables() {
    let env = env("pr-lost");
    losses_match_a_model(&env);
}

/// As above, all toward one backend: its NAT walk goes more than a table
/// of ports round, so tuples a table apart share a NAT slot (and, but for
/// the lap in the tag, a short tag: such losses went uncounted whenever a
/// walk happened to wrap).
#[test]
fn half_open_losses_of_nat_tuples_a_table_apart_are_counted() {
    let env = nat_env("pr-laps", 8000, &[BALANCER_IP]);
    losses_match_a_model(&env);
}
