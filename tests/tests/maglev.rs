//! Maglev on the real program (BPF_PROG_TEST_RUN): two balancers loaded
//! separately, which number the same backends differently, send every
//! new flow to the same backend, the one the control plane's own table
//! predicts; one backend leaving the ring moves the flows it had and
//! barely any other.

use huddle_common::{addr_v4, FlowKey, FAMILY_V4, PROTO_TCP};
use huddle_user::{
    config::{PortRange, Proto, Selection, Service},
    maglev,
    packet::{endpoints, Frame},
    prog_run::{mac_of, ProgRun, BALANCER_MAC},
};
use std::net::{Ipv4Addr, SocketAddr};
use testbed::{require_root, unique};

const XDP_TX: u32 = 3;
const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);
const CLIENTS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 213, 0, 2), Ipv4Addr::new(10, 213, 0, 3)];
const BACKENDS: u8 = 6;
const FLOWS: u16 = 600;

fn backend(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 11 + i)
}

/// A balancer whose one service lists the backends in `order`.
fn balancer(tag: &str, order: &[u8]) -> ProgRun {
    require_root();
    let mut s = Service::plain(
        (VIP, 80).into(),
        Proto::Tcp,
        order
            .iter()
            .map(|i| SocketAddr::from((backend(*i), 8080)))
            .collect(),
    );
    s.selection = Selection::Maglev;
    let cfg = huddle_user::prog_run::config(
        vec![s],
        PortRange {
            min: 20000,
            max: 32767,
        },
        4096,
        4096,
    );
    let mut neigh: Vec<Ipv4Addr> = (0..BACKENDS).map(backend).collect();
    neigh.extend(CLIENTS);
    ProgRun::new(&unique(tag), &cfg, &neigh).expect("PROG_TEST_RUN namespace")
}

fn flow(n: u16) -> (Ipv4Addr, u16) {
    (CLIENTS[usize::from(n % 2)], 40000 + n)
}

/// The backend a SYN of flow `n` goes to.
fn pick(env: &ProgRun, n: u16) -> Ipv4Addr {
    let (client, port) = flow(n);
    let syn = Frame::tcp((client, port), (VIP, 80))
        .syn()
        .macs(mac_of(client), BALANCER_MAC)
        .build();
    let (verdict, out) = env.run(&syn).unwrap();
    assert_eq!(
        verdict,
        XDP_TX,
        "flow {n}: {:?} {:?}",
        env.dp.global_stats(),
        env.dp.service_stats(env.dp.services[0].id)
    );
    endpoints(&out).1 .0
}

/// What the control plane's table says flow `n` takes.
fn predicted(table: &[u32], env: &ProgRun, n: u16) -> Ipv4Addr {
    let (client, port) = flow(n);
    let key = FlowKey {
        client: addr_v4(client.octets()),
        vip: addr_v4(VIP.octets()),
        client_port_be: port.to_be(),
        vip_port_be: 80u16.to_be(),
        proto: PROTO_TCP,
        family: FAMILY_V4,
        _pad: [0; 2],
    };
    let id = table[maglev::slot_of(&key, table.len() as u32)];
    let slot = &env.dp.services[0];
    let j = slot.backend_ids.iter().position(|b| *b == id).unwrap();
    match slot.service.backends[j].ip() {
        std::net::IpAddr::V4(v4) => v4,
        ip => panic!("{ip}"),
    }
}

#[test]
fn two_balancers_send_every_new_flow_to_the_same_backend_and_one_leaving_moves_only_its_own() {
    let mut a = balancer("mg-a", &[0, 1, 2, 3, 4, 5]);
    let mut b = balancer("mg-b", &[5, 3, 1, 0, 2, 4]);
    let id_of = |env: &ProgRun, ip: Ipv4Addr| {
        let s = &env.dp.services[0];
        s.backend_ids[s
            .service
            .backends
            .iter()
            .position(|b| b.ip() == ip)
            .unwrap()]
    };
    assert_ne!(
        id_of(&a, backend(0)),
        id_of(&b, backend(0)),
        "the second balancer numbers its backends otherwise"
    );
    let table = a.dp.maglev_table(0).unwrap();
    assert_eq!(table.len(), huddle_common::DEFAULT_MAGLEV_SIZE as usize);
    let mut per_backend = std::collections::BTreeMap::<Ipv4Addr, u32>::new();
    for n in 0..FLOWS {
        let (pa, pb) = (pick(&a, n), pick(&b, n));
        assert_eq!(pa, pb, "flow {n}: balancer a picked {pa}, b {pb}");
        assert_eq!(
            pa,
            predicted(&table, &a, n),
            "flow {n}: not the table's pick"
        );
        *per_backend.entry(pa).or_default() += 1;
    }
    println!("{FLOWS} flows per backend: {per_backend:?}");
    assert_eq!(per_backend.len(), usize::from(BACKENDS));
    // Backend 2 leaves both rings. New flows (fresh tuples: the first
    // ones are half-open, and a SYN of theirs would be a retransmission)
    // go where the new table says, alike on both; against the old table,
    // only the flows backend 2 had move, and barely any other.
    for env in [&mut a, &mut b] {
        let slot = &env.dp.services[0];
        let ring: Vec<u32> = slot
            .backend_ids
            .iter()
            .zip(&slot.service.backends)
            .filter(|(_, addr)| addr.ip() != backend(2))
            .map(|(id, _)| *id)
            .collect();
        env.dp.swap_ring(0, &ring).unwrap();
    }
    let after = a.dp.maglev_table(0).unwrap();
    let (mut own, mut others) = (0, 0);
    for n in FLOWS..2 * FLOWS {
        let (pa, pb) = (pick(&a, n), pick(&b, n));
        assert_eq!(pa, pb, "after the change, flow {n}");
        assert_eq!(pa, predicted(&after, &a, n));
        let was = predicted(&table, &a, n);
        if was == backend(2) {
            own += 1;
        } else if pa != was {
            others += 1;
        }
    }
    println!(
        "backend 2 left: {own} of {FLOWS} new flows would have been its own and went elsewhere, {others} others moved"
    );
    assert!(own > 0);
    assert!(
        others * 100 <= u32::from(FLOWS),
        "{others} flows of staying backends moved"
    );
}
