//! Frames whose TCP or UDP checksum was left to offload (a veth sender's
//! CHECKSUM_PARTIAL, or GRO's on a bridge port): the field holds only the
//! pseudo header's sum. Sent on as they are, every receiver drops them
//! (the real-stack issue's first flights never acknowledged); the program
//! must send them with full checksums, in both directions, for TCP and
//! UDP, whatever their length.

use super::fixture::*;
use huddle_user::kernel::packet::left_to_offload;

/// A payload of `n` bytes that is not all one value (so a wrong sum shows).
fn payload(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 256) as u8).collect()
}

#[test]
fn source_nat_segments_left_to_offload_leave_with_full_checksums() {
    let env = env("pr-offload");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, nat_port) = establish(&env, 40000, &ring);
    // Odd lengths pad the last chunk; 2,901 bytes span six 512-byte chunks
    // (toward the backend: a reply over the client's MTU is the kernel's).
    // A segment of `n` bytes from `from` to `to`, between those MACs.
    let seg = |from, to, macs: ([u8; 6], [u8; 6]), flags, seq_ack: (u32, u32), n| {
        Frame::tcp(from, to)
            .flags(flags)
            .seq_ack(seq_ack.0, seq_ack.1)
            .payload(&payload(n))
            .macs(macs.0, macs.1)
            .build()
    };
    for (n, m) in [(1, 1), (1001, 1001), (2901, 1448)] {
        let (at_b, at_c) = ((1001, 7001), (7001, 1001 + n as u32));
        let data = seg(
            (CLIENT, 40000),
            (VIP, 80),
            (mac_of(CLIENT), BALANCER_MAC),
            ACK | PSH,
            at_b,
            n,
        );
        let (verdict, out) = env.run(&left_to_offload(data)).unwrap();
        assert_eq!(verdict, XDP_TX, "client segment of {n} bytes");
        let want = seg(
            (BALANCER_IP, nat_port),
            (b, 8080),
            (BALANCER_MAC, mac_of(b)),
            ACK | PSH,
            at_b,
            n,
        );
        assert_eq!(
            out, want,
            "client segment of {n} bytes: checksum not finished"
        );

        let reply = seg(
            (b, 8080),
            (BALANCER_IP, nat_port),
            (mac_of(b), BALANCER_MAC),
            ACK,
            at_c,
            m,
        );
        let (verdict, out) = env.run(&left_to_offload(reply)).unwrap();
        assert_eq!(verdict, XDP_TX, "backend segment of {m} bytes");
        let want = seg(
            (VIP, 80),
            (CLIENT, 40000),
            (BALANCER_MAC, mac_of(CLIENT)),
            ACK,
            at_c,
            m,
        );
        assert_eq!(
            out, want,
            "backend segment of {m} bytes: checksum not finished"
        );
    }
    let g: GlobalStats = env.dp.global_stats().unwrap();
    assert_eq!((g.csum_finished, g.drop_csum), (6, 0));
    // A full checksum is updated as before, not summed again.
    let data = client_frame(40000)
        .flags(ACK)
        .seq_ack(1001, 7001)
        .payload(b"x");
    let (_, out) = env.run(&data.build()).unwrap();
    assert!(checksums_valid(&out));
    assert_eq!(env.dp.global_stats().unwrap().csum_finished, 6);
}

#[test]
fn udp_datagrams_left_to_offload_leave_with_full_checksums() {
    let env = env("pr-offload-udp");
    let dgram = Frame::udp((CLIENT, 41000), (VIP, 53))
        .macs(mac_of(CLIENT), BALANCER_MAC)
        .payload(&payload(777));
    let (verdict, out) = env.run(&left_to_offload(dgram.build())).unwrap();
    assert_eq!(verdict, XDP_TX);
    let ((src, nat_port), (b, port)) = endpoints(&out);
    assert_eq!((src, port), (BALANCER_IP, 5353));
    assert!(
        checksums_valid(&out),
        "datagram to {b}: checksum not finished"
    );
    let answer = Frame::udp((b, 5353), (BALANCER_IP, nat_port))
        .macs(mac_of(b), BALANCER_MAC)
        .payload(&payload(1400));
    let (verdict, out) = env.run(&left_to_offload(answer.build())).unwrap();
    assert_eq!(verdict, XDP_TX);
    let want = Frame::udp((VIP, 53), (CLIENT, 41000))
        .macs(BALANCER_MAC, mac_of(CLIENT))
        .payload(&payload(1400))
        .build();
    assert_eq!(out, want, "answer: checksum not finished");
}

/// A reply longer than the client's path (a GRO-coalesced frame, which
/// generic mode sees whole) goes to the kernel, which segments and
/// forwards it: addressed to this host as it came (with the next hop's
/// MAC the kernel dropped it as another host's), translated, and its
/// partial sum kept right for the new addresses (the kernel finishes it).
#[test]
fn a_reply_too_long_for_the_client_goes_to_the_kernel_addressed_to_this_host() {
    let env = env("pr-offload-big");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, nat_port) = establish(&env, 40000, &ring);
    let reply = Frame::tcp((b, 8080), (BALANCER_IP, nat_port))
        .flags(ACK)
        .seq_ack(7001, 1001)
        .payload(&payload(2901))
        .macs(mac_of(b), BALANCER_MAC);
    let (verdict, out) = env.run(&left_to_offload(reply.build())).unwrap();
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(out[..6], BALANCER_MAC, "not addressed to this host");
    assert_eq!(endpoints(&out), ((VIP, 80), (CLIENT, 40000)));
    let want = Frame::tcp((VIP, 80), (CLIENT, 40000))
        .flags(ACK)
        .seq_ack(7001, 1001)
        .payload(&payload(2901))
        .build();
    assert_eq!(
        out[14..],
        left_to_offload(want)[14..],
        "partial sum not kept"
    );
}
