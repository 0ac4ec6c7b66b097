//! Source NAT: a SYN rewritten to a backend and its reply back, what is not ours, truncated frames, a client port reused at once.

use super::fixture::*;

#[test]
fn syn_is_rewritten_to_a_ring_backend_and_the_reply_translated_back() {
    let env = env("pr-syn");
    let ring = [backend(0), backend(1), backend(2)];
    let (b, nat_port) = open_flow(&env, 40000, &ring);

    // Data from the client on the same flow goes to the same backend.
    let data = client_frame(40000)
        .flags(ACK | PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n")
        .build();
    let (verdict, out) = env.run(&data).unwrap();
    assert_eq!(verdict, XDP_TX);
    let expected = Frame::tcp((BALANCER_IP, nat_port), (b, 8080))
        .flags(ACK | PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n")
        .macs(BALANCER_MAC, mac_of(b))
        .build();
    assert_eq!(out, expected);

    // The backend's reply is translated back to VIP -> client.
    let reply = Frame::tcp((b, 8080), (BALANCER_IP, nat_port))
        .flags(SYN | ACK)
        .macs(mac_of(b), BALANCER_MAC)
        .build();
    let (verdict, out) = env.run(&reply).unwrap();
    assert_eq!(verdict, XDP_TX);
    let expected = Frame::tcp((VIP, 80), (CLIENT, 40000))
        .flags(SYN | ACK)
        .macs(BALANCER_MAC, mac_of(CLIENT))
        .build();
    assert_eq!(
        out, expected,
        "translated reply differs from the expected bytes"
    );

    let id = env.dp.services[0].backend_ids[ring.iter().position(|x| *x == b).unwrap()];
    let st: BackendStats = env.dp.backend_stats(id).unwrap();
    assert_eq!(
        (st.pkts_to, st.pkts_from, st.syns, st.flows_new),
        (2, 1, 1, 0),
        "half-open until the client acknowledges the SYN-ACK: {st:?}"
    );
    // An ACK of the wrong sequence number does not establish it...
    forward(&env, client_frame(40000).flags(ACK).seq_ack(1001, 555));
    assert_eq!(env.dp.backend_stats(id).unwrap().flows_new, 0);
    // ...the right one does (the SYN-ACK above carried seq 1000).
    forward(&env, client_frame(40000).flags(ACK).seq_ack(1001, 1001));
    assert_eq!(env.dp.backend_stats(id).unwrap().flows_new, 1);
    let sv = env.dp.service_stats(0).unwrap();
    assert_eq!((sv.half_open, sv.promoted), (1, 1));
}

/// Frames that must come back unchanged with XDP_PASS.
#[test]
fn traffic_that_is_not_ours_passes_untouched_or_is_dropped_if_to_the_vip() {
    let mut env = env("pr-pass");
    let syn = client_frame(40000).syn().build();
    let mut arp = vec![0xffu8; 6];
    arp.extend_from_slice(&mac_of(CLIENT));
    arp.extend_from_slice(&[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 1]);
    arp.extend_from_slice(&mac_of(CLIENT));
    arp.extend_from_slice(&CLIENT.octets());
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&BALANCER_IP.octets());
    let mut ipv6 = syn.clone();
    ipv6[12..14].copy_from_slice(&[0x86, 0xdd]);
    let mut vlan = syn[..12].to_vec();
    vlan.extend_from_slice(&[0x81, 0x00, 0x00, 0x05]);
    vlan.extend_from_slice(&syn[12..]);
    let mut options = syn.clone();
    options[ETH_LEN] = 0x46;
    let mut frag_mf = syn.clone();
    frag_mf[ETH_LEN + 6] = 0x20;
    let mut frag_off = syn.clone();
    frag_off[ETH_LEN + 7] = 0x10;
    let mut ihl_small = syn.clone();
    ihl_small[ETH_LEN] = 0x44;
    let mut v6_in_v4 = syn.clone();
    v6_in_v4[ETH_LEN] = 0x65;
    let mut long_total = syn.clone();
    long_total[ETH_LEN + 2..ETH_LEN + 4].copy_from_slice(&200u16.to_be_bytes());
    let mut short_total = syn.clone();
    short_total[ETH_LEN + 2..ETH_LEN + 4].copy_from_slice(&30u16.to_be_bytes());
    let mut bad_doff = syn.clone();
    bad_doff[ETH_LEN + 20 + 12] = 0x40;
    let mut big_doff = syn.clone();
    big_doff[ETH_LEN + 20 + 12] = 0xf0;
    let mut icmp = syn.clone();
    icmp[ETH_LEN + 9] = 1;
    let fixtures: Vec<(&str, Vec<u8>)> = vec![
        (
            "TCP to a non-VIP address",
            Frame::tcp((CLIENT, 40000), (Ipv4Addr::new(10, 213, 0, 99), 80))
                .syn()
                .build(),
        ),
        (
            "TCP to the VIP on another port",
            Frame::tcp((CLIENT, 40000), (VIP, 81)).syn().build(),
        ),
        (
            "UDP to the VIP's TCP port",
            Frame::udp((CLIENT, 40000), (VIP, 80)).build(),
        ),
        ("ARP request", arp),
        ("IPv6 ethertype", ipv6),
        ("VLAN-tagged frame", vlan),
        ("IPv4 with options", options),
        ("fragment with MF", frag_mf),
        ("fragment with an offset", frag_off),
        ("IHL below 5", ihl_small),
        ("version 6 in an IPv4 frame", v6_in_v4),
        ("total length beyond the frame", long_total),
        ("total length shorter than the headers", short_total),
        ("TCP data offset below 5", bad_doff),
        ("TCP data offset beyond the packet", big_doff),
        ("ICMP to the VIP", icmp),
        (
            "TCP ACK of an unknown flow to the VIP",
            client_frame(40001).flags(ACK).build(),
        ),
        (
            "reply to the NAT range without a NAT entry (the host's own traffic)",
            Frame::tcp((backend(0), 8080), (BALANCER_IP, 25000))
                .flags(SYN | ACK)
                .build(),
        ),
        (
            "SSH to the balancer",
            Frame::tcp((CLIENT, 50000), (BALANCER_IP, 22)).syn().build(),
        ),
    ];
    // Addressed to the VIP (IPv4, the VIP in the header's destination):
    // dropped, not left to a kernel that forwards it (`GUARDED`).
    let to_vip = |f: &[u8]| {
        f.len() >= ETH_LEN + 20
            && f[12..14] == [8, 0]
            && f[ETH_LEN + 16..ETH_LEN + 20] == VIP.octets()
    };
    let guarded = fixtures.iter().filter(|(_, f)| to_vip(f)).count() as u64;
    for (what, frame) in &fixtures {
        let want = if to_vip(frame) { XDP_DROP } else { XDP_PASS };
        let (verdict, out) = env.run(frame).unwrap();
        assert_eq!(verdict, want, "{what}: verdict");
        assert_eq!(&out, frame, "{what}: the frame was changed");
    }
    let g: GlobalStats = env.dp.global_stats().unwrap();
    println!("{guarded} of {} frames to the VIP: {g:?}", fixtures.len());
    assert_eq!(g.drop_guarded, guarded, "{g:?}");
    // ARP and VLAN are neither family; the IPv6 frame goes to the IPv6
    // program, which finds it malformed or with extension headers.
    assert!(
        g.pass_malformed + g.pass_v6_ext >= 1 && g.pass_not_ipv4 >= 2,
        "{g:?}"
    );
    // The VIP made an address of the host: the kernel delivers what is
    // sent to it, never forwards it, so all of it is the kernel's again.
    env.ns
        .ip(&["addr", "add", &format!("{VIP}/32"), "dev", "lo"])
        .unwrap();
    env.dp
        .reconcile(&config(&[backend(0), backend(1), backend(2)], true))
        .unwrap();
    for (what, frame) in &fixtures {
        let (verdict, out) = env.run(frame).unwrap();
        assert_eq!(verdict, XDP_PASS, "{what}, to a local VIP: verdict");
        assert_eq!(&out, frame, "{what}: the frame was changed");
    }
    let g: GlobalStats = env.dp.global_stats().unwrap();
    assert_eq!(g.drop_guarded, guarded, "{g:?}");
    assert!(
        g.pass_ip_options >= 1 && g.pass_fragment >= 2 && g.pass_malformed >= 6,
        "{g:?}"
    );
}

/// While a migration copies the old program's last flows
/// (`config_flags::MIGRATING`), a backend's packet to the SNAT address and
/// NAT port range that no NAT entry explains is dropped and counted, not
/// handed to the kernel, whose RST would close the backend's side of a
/// connection copied a moment later; otherwise it is passed.
#[test]
fn while_migrating_a_backend_packet_no_nat_entry_explains_is_dropped() {
    let mut env = env("pr-nonat");
    let frames = [
        Frame::tcp((backend(0), 8080), (BALANCER_IP, 25000))
            .flags(SYN | ACK)
            .build(),
        Frame::tcp((backend(1), 8080), (BALANCER_IP, 20001))
            .flags(ACK)
            .payload(b"HTTP/1.1 200 OK\r\n")
            .build(),
        Frame::udp((backend(0), 8080), (BALANCER_IP, 25001)).build(),
    ];
    env.dp.set_migrating(true).unwrap();
    for f in &frames {
        assert_eq!(env.run(f).unwrap().0, XDP_DROP);
    }
    env.dp.set_migrating(false).unwrap();
    for f in &frames {
        assert_eq!(env.run(f).unwrap().0, XDP_PASS);
    }
    let g: GlobalStats = env.dp.global_stats().unwrap();
    assert_eq!((g.drop_no_nat, g.pass_no_nat), (3, 3), "{g:?}");
}

#[test]
fn truncated_frames_are_never_rewritten() {
    let env = env("pr-trunc");
    for frame in [
        client_frame(40000).syn().payload(b"xyz").build(),
        Frame::udp((CLIENT, 41000), (VIP, 53)).payload(b"q").build(),
    ] {
        for len in 0..frame.len() {
            let cut = &frame[..len];
            if cut.len() < ETH_LEN {
                // The kernel refuses frames shorter than an Ethernet header.
                continue;
            }
            let (verdict, out) = env.run(cut).unwrap();
            // With its IPv4 destination (the VIP) in the frame, dropped:
            // not balanced, and not the kernel's to forward.
            let want = if len >= ETH_LEN + 20 {
                XDP_DROP
            } else {
                XDP_PASS
            };
            assert_eq!(verdict, want, "frame cut at {len} bytes: verdict");
            assert_eq!(out, cut, "frame cut at {len} bytes was changed");
        }
    }
}

#[test]
fn a_client_port_reused_right_after_a_close_reaches_its_new_connection() {
    let env = env("pr-reopen");
    let ring = [backend(0), backend(1), backend(2)];
    pin_to(0);
    let (b, port) = establish(&env, 48000, &ring);
    // The backend closes; the client's port is free again at once.
    let fin = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(FIN | ACK)
        .macs(mac_of(b), BALANCER_MAC);
    assert_eq!(env.run(&fin.build()).unwrap().0, XDP_TX);
    // A new connection from the same port: SYN, SYN-ACK, ACK.
    let (b2, port2) = establish(&env, 48000, &ring);
    assert_ne!((b2, port2), (b, port), "a new connection gets a new tuple");
    // Its data goes to the new backend and tuple, not the closed flow's.
    let data = client_frame(48000).flags(ACK | PSH).payload(b"GET /");
    let (v, out) = env.run(&data.build()).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(endpoints(&out), ((BALANCER_IP, port2), (b2, 8080)));
    // And the closed flow's tuple no longer translates anything.
    let stale = Frame::tcp((b, 8080), (BALANCER_IP, port))
        .flags(ACK)
        .build();
    assert_eq!(env.run(&stale).unwrap(), (XDP_PASS, stale));
}
