//! RSTs and FINs that end a source-NAT flow only from within their
//! sender's sequence window: a spoofer who guessed the tuple (the NAT
//! ports are a known range) cannot close someone else's flow by it.

use super::fixture::*;

/// Far from anywhere a real sender is.
const FAR: u32 = 1 << 31;

fn stats(env: &ProgRun, ring: &[Ipv4Addr], b: Ipv4Addr) -> BackendStats {
    env.dp
        .backend_stats(backend_id_in(env, ring, b))
        .expect("backend stats")
}

fn backend_id_in(env: &ProgRun, ring: &[Ipv4Addr], b: Ipv4Addr) -> u32 {
    env.dp.services[0].backend_ids[ring.iter().position(|x| *x == b).unwrap()]
}

#[test]
fn a_spoofed_rst_or_fin_from_the_backend_side_leaves_the_flow_open() {
    let env = env("cl-backend");
    let ring = [backend(0), backend(1), backend(2)];
    // The backend's SYN-ACK was 7000: it is at 7001.
    let (b, port) = establish(&env, 47000, &ring);
    for flags in [RST, RST | ACK, FIN | ACK] {
        let spoofed = Frame::tcp((b, 8080), (BALANCER_IP, port))
            .flags(flags)
            .seq_ack(7001u32.wrapping_add(FAR), 1001)
            .macs(mac_of(b), BALANCER_MAC);
        // Passed on for the client's TCP to judge (it drops it too).
        assert_eq!(env.run(&spoofed.build()).unwrap().0, XDP_TX);
    }
    let s = stats(&env, &ring, b);
    assert_eq!(s.flows_closed, 0, "a spoofed close ended the flow");
    assert_eq!(s.closes_unproven, 3);
    // The real one, where the backend is.
    let rst = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(RST)
        .seq_ack(7001, 1001)
        .macs(mac_of(b), BALANCER_MAC);
    assert_eq!(env.run(&rst.build()).unwrap().0, XDP_TX);
    assert_eq!(stats(&env, &ring, b).flows_closed, 1);
}

#[test]
fn a_spoofed_rst_or_fin_from_the_client_side_leaves_the_flow_open() {
    let env = env("cl-client");
    let ring = [backend(0), backend(1), backend(2)];
    // The client's ACK of the handshake was at 1001.
    let (b, port) = establish(&env, 47001, &ring);
    // A request the backend owes an answer to.
    let request = client_frame(47001)
        .flags(ACK | PSH)
        .seq_ack(1001, 7001)
        .payload(b"GET");
    forward(&env, request);
    for flags in [RST, FIN | ACK] {
        let spoofed = client_frame(47001)
            .flags(flags)
            .seq_ack(1001u32.wrapping_add(FAR), 7001);
        let (v, out) = env.run(&spoofed.build()).unwrap();
        assert_eq!(v, XDP_TX);
        assert_eq!(endpoints(&out), ((BALANCER_IP, port), (b, 8080)));
    }
    let s = stats(&env, &ring, b);
    assert_eq!(s.flows_closed, 0, "a spoofed close ended the flow");
    assert_eq!(s.closes_unproven, 2);
    assert_eq!(
        (s.turns, s.abandoned),
        (1, 0),
        "a spoofed RST gave up the turn"
    );
    let fin = client_frame(47001).flags(FIN | ACK).seq_ack(1004, 7001);
    assert_eq!(env.run(&fin.build()).unwrap().0, XDP_TX);
    assert_eq!(stats(&env, &ring, b).flows_closed, 1);
}

/// A segment far off (a guess) does not move the window there, so a RST
/// sent after it at the same place is still outside; a sender that really
/// moves on (an upload of 12 MiB) takes the window with it.
#[test]
fn the_window_follows_the_sender_and_not_a_guess() {
    let env = env("cl-follow");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, _) = establish(&env, 47002, &ring);
    let guess = 1001u32.wrapping_add(FAR);
    forward(&env, client_frame(47002).flags(ACK).seq_ack(guess, 7001));
    forward(&env, client_frame(47002).flags(RST).seq_ack(guess, 7001));
    assert_eq!(stats(&env, &ring, b).flows_closed, 0, "the guess moved it");
    let mut seq = 1001u32;
    for _ in 0..200 {
        seq = seq.wrapping_add(64 << 10);
        forward(&env, client_frame(47002).flags(ACK).seq_ack(seq, 7001));
    }
    forward(&env, client_frame(47002).flags(RST).seq_ack(seq, 7001));
    let s = stats(&env, &ring, b);
    assert_eq!(s.flows_closed, 1, "the sender's own RST, 12 MiB on");
    assert_eq!(s.closes_unproven, 1);
}
