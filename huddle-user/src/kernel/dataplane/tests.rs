//! Unit tests of the data plane's pure parts and of the object it loads.

use super::nat::cursor_at;
use super::*;
use crate::config::Proto;
use crate::kernel::object;
use huddle_common::{addr_v4, maps, FAMILY_V6, PROGRAM_NAME, SERVICE_KIND_SNAT, SERVICE_KIND_VIP};

#[test]
fn encap_sources_vary_only_in_the_host_bits_of_the_prefix() {
    let own = Ipv4Addr::new(10, 0, 0, 1);
    assert_eq!(encap_source(None, own), (addr_v4([10, 0, 0, 1]), 0));
    let p: crate::config::Prefix = "172.16.4.0/22".parse().unwrap();
    let (src, vary) = encap_source(Some(p), own);
    assert_eq!(&src[..4], &[172, 16, 4, 0]);
    // As the bytes lie in memory: the last 10 bits of the address.
    assert_eq!(vary.to_ne_bytes(), [0, 0, 0x03, 0xff]);
}

#[test]
fn keys_hold_network_order_ports() {
    let SvcKey::V4(k) = service_key("10.1.2.3:8080".parse().unwrap(), Proto::Tcp) else {
        panic!("an IPv4 VIP takes an IPv4 key");
    };
    assert_eq!(k.addr, [10, 1, 2, 3]);
    assert_eq!(k.kind, SERVICE_KIND_VIP);
    assert_eq!(k.port_be.to_ne_bytes(), 8080u16.to_be_bytes());
    assert_eq!(k.proto, 6);
    let SvcKey::V4(s) = snat_key(Ipv4Addr::new(10, 0, 0, 1).into()) else {
        panic!("an IPv4 SNAT address takes an IPv4 key");
    };
    assert_eq!(s.kind, SERVICE_KIND_SNAT);
    let SvcKey::V6(k6) = service_key("[fd00::5]:443".parse().unwrap(), Proto::Udp) else {
        panic!("an IPv6 VIP takes an IPv6 key");
    };
    assert_eq!(k6.addr[..2], [0xfd, 0]);
    assert_eq!(
        (k6.port_be.to_ne_bytes(), k6.proto),
        (443u16.to_be_bytes(), 17)
    );
    let b = backend_value("10.9.9.9:53".parse().unwrap());
    assert_eq!(b.port_be.to_ne_bytes(), 53u16.to_be_bytes());
    let b6 = backend_value("[fd00::9]:53".parse().unwrap());
    assert_eq!(b6.family, FAMILY_V6);
    assert_eq!(backend_addr(&b6), "[fd00::9]:53".parse().unwrap());
}

#[test]
fn cursors_start_where_a_walk_of_one_round_per_time_wait_stands() {
    let tw = huddle_common::TIME_WAIT_NS;
    // 1,000 tuples: one every 60 ms. 30 s into a round: tuple 500.
    let c = cursor_at(10 * tw + tw / 2, 500, 2);
    assert_eq!((c.port, c.addr), (0, 1));
    assert_eq!(c.round_ns, 9 * tw + tw / 2);
    let c = cursor_at(tw / 4, 1000, 1);
    assert_eq!((c.port, c.addr), (250, 0));
    assert_eq!(c.round_ns, 1, "never 0: the program would restart it");
    // A later start is further on: a run that took fewer tuples than
    // that in between is behind it.
    let (a, b) = (
        cursor_at(tw, 6384, 1),
        cursor_at(tw + 20 * tw / 60, 6384, 1),
    );
    assert_eq!(b.port - a.port, 2128);
}

#[test]
fn object_declares_every_map_and_the_program() {
    let obj = aya_obj::Object::parse(object::HUDDLE).expect("parse the embedded object");
    for name in maps::ALL {
        assert!(
            obj.maps.contains_key(name),
            "map {name} missing from the object"
        );
    }
    assert!(obj.maps.contains_key(maps::NAT_USED));
    assert!(obj.maps.contains_key(maps::CLIENT_HOP));
    assert!(obj.maps.contains_key(maps::TW_REUSED));
    assert!(obj.programs.contains_key(PROGRAM_NAME));
}
