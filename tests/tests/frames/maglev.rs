//! Maglev on the real program (BPF_PROG_TEST_RUN): two balancers loaded
//! separately, which number the same backends differently, send every
//! new flow to the same backend, the one the control plane's own table
//! predicts; one backend leaving the ring moves the flows it had and
//! barely any other; in DSR, a connection opened through one balancer
//! carries on through another that never saw it open (as when the router
//! moves it), on the same backend.

use huddle_common::{addr_v4, FlowKey, FAMILY_V4, PROTO_TCP};
use huddle_user::{
    cluster::handoff::FlowBook,
    config::{key::ClusterKey, Mode, PortRange, Proto, Selection, Service},
    kernel::maglev,
    kernel::packet::{endpoints, Frame, ACK, PSH},
    kernel::prog_run::{mac_of, ProgRun, BALANCER_MAC},
};
use std::net::{Ipv4Addr, SocketAddr};
use testbed::{require_root, unique};

use huddle_common::verdict::XDP_TX;
const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);
const CLIENTS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 213, 0, 2), Ipv4Addr::new(10, 213, 0, 3)];
const BACKENDS: u8 = 6;
const FLOWS: u16 = 600;

fn backend(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 11 + i)
}

/// VIP ports of the L2 DSR services, Maglev and round robin (backends
/// listen on the same).
const DSR_MAGLEV: u16 = 8080;
const DSR_RR: u16 = 9090;

/// A balancer whose services list the backends in `order`: source NAT on
/// port 80 and L2 DSR on `DSR_MAGLEV` by Maglev, L2 DSR on `DSR_RR` round
/// robin; its Maglev seed drawn from the cluster's key.
fn balancer(tag: &str, order: &[u8]) -> ProgRun {
    keyed(tag, order, 0x11)
}

/// `balancer`, its Maglev key `key` repeated.
fn keyed(tag: &str, order: &[u8], key: u8) -> ProgRun {
    require_root();
    let service = |port: u16, to: u16, mode: Mode, selection: Selection| {
        let mut s = Service::plain(
            (VIP, port).into(),
            Proto::Tcp,
            order
                .iter()
                .map(|i| SocketAddr::from((backend(*i), to)))
                .collect(),
        );
        s.mode = mode;
        s.selection = selection;
        s
    };
    let mut cfg = huddle_user::kernel::prog_run::config(
        vec![
            service(80, 8080, Mode::Snat, Selection::Maglev),
            service(DSR_MAGLEV, DSR_MAGLEV, Mode::DsrL2, Selection::Maglev),
            service(DSR_RR, DSR_RR, Mode::DsrL2, Selection::RoundRobin),
        ],
        PortRange {
            min: 20000,
            max: 32767,
        },
        4096,
        4096,
    );
    cfg.maglev_key = Some(ClusterKey::from_hex(&format!("{key:02x}").repeat(32)).unwrap());
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
    let id = table[maglev::slot_of(&key, table.len() as u32, env.dp.maglev_seed())];
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
    // A balancer with another key (a client guessing the seed) builds the
    // same table but hashes flows elsewhere: about 5 in 6 differ.
    let stranger = keyed("mg-c", &[0, 1, 2, 3, 4, 5], 0x22);
    assert_eq!(
        stranger.dp.maglev_table(0).unwrap(),
        table,
        "the same table"
    );
    let alike = (0..FLOWS)
        .filter(|n| pick(&stranger, *n) == predicted(&table, &a, *n))
        .count();
    println!("another seed: {alike} of {FLOWS} flows on the same backend");
    assert!(alike < usize::from(FLOWS) / 3, "{alike} alike");
    drop(stranger);
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

/// The backend an L2 DSR frame went to, by its destination MAC.
fn by_mac(out: &[u8]) -> Ipv4Addr {
    (0..BACKENDS)
        .map(backend)
        .find(|b| out[..6] == mac_of(*b))
        .unwrap_or_else(|| panic!("no backend has MAC {:02x?}", &out[..6]))
}

/// A client segment of a DSR connection from `CLIENTS[0]`'s `port` to
/// the VIP's `dport`.
fn segment(port: u16, dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    Frame::tcp((CLIENTS[0], port), (VIP, dport))
        .flags(flags)
        .seq_ack(1001, 5001)
        .payload(payload)
        .macs(mac_of(CLIENTS[0]), BALANCER_MAC)
        .build()
}

/// Its SYN.
fn syn(port: u16, dport: u16) -> Vec<u8> {
    Frame::tcp((CLIENTS[0], port), (VIP, dport))
        .syn()
        .macs(mac_of(CLIENTS[0]), BALANCER_MAC)
        .build()
}

#[test]
fn a_dsr_connection_moved_to_another_balancer_keeps_its_backend() {
    let a = balancer("mg-move-a", &[0, 1, 2, 3, 4, 5]);
    let b = balancer("mg-move-b", &[3, 4, 5, 0, 1, 2]);
    let port = 45000;
    let frame = |dport: u16, flags: u8, payload: &[u8]| segment(port, dport, flags, payload);
    for dport in [DSR_MAGLEV, DSR_RR] {
        // Opened through balancer a: SYN, then the handshake's ACK.
        let (v, out) = a.run(&syn(port, dport)).unwrap();
        assert_eq!(v, XDP_TX);
        let first = by_mac(&out);
        assert_eq!(a.run(&frame(dport, ACK, b"")).unwrap().0, XDP_TX);
        // The router moves it: b gets a request of a connection it never
        // saw open.
        let request = frame(dport, ACK | PSH, b"GET / HTTP/1.1\r\n\r\n");
        let (v, out) = b.run(&request).unwrap();
        let sid = b.dp.services[if dport == DSR_MAGLEV { 1 } else { 2 }].id;
        let st = b.dp.service_stats(sid).unwrap();
        if dport == DSR_MAGLEV {
            assert_eq!(v, XDP_TX, "Maglev: b takes the connection over");
            assert_eq!(by_mac(&out), first, "on the backend a chose");
            assert_eq!(out[12..], request[12..], "the frame otherwise untouched");
            // Its next segment finds the flow b made.
            let (v, out) = b.run(&frame(dport, ACK, b"")).unwrap();
            assert_eq!((v, by_mac(&out)), (XDP_TX, first));
            let st = b.dp.service_stats(sid).unwrap();
            assert_eq!((st.taken_over, st.flows_new), (1, 1), "{st:?}");
        } else {
            // Round robin cannot know a's choice: not b's to guess, nor
            // the kernel's to forward (to the VIP: `GUARDED`).
            assert_eq!((v, out), (1, request), "round robin drops it");
            assert_eq!((st.taken_over, st.pass_no_flow), (0, 1), "{st:?}");
        }
    }
}

/// The rings changed after a connection opened (its backend left them:
/// resting or drained, it still serves what it has), then the router
/// moves the connection. Its table entry now names another backend; the
/// flow the first balancer shares (`handoff`) keeps it where it was. A
/// flow never shared goes by the table; a new connection on a shared
/// tuple is a new flow.
#[test]
fn a_connection_a_peer_shared_keeps_its_backend_after_the_ring_changed() {
    let mut a = balancer("mg-share-a", &[0, 1, 2, 3, 4, 5]);
    let mut b = balancer("mg-share-b", &[3, 4, 5, 0, 1, 2]);
    let client = CLIENTS[0];
    let frame = |port: u16, flags: u8, payload: &[u8]| segment(port, DSR_MAGLEV, flags, payload);
    let open = |env: &ProgRun, port: u16| {
        let (v, out) = env.run(&syn(port, DSR_MAGLEV)).unwrap();
        assert_eq!(v, XDP_TX);
        assert_eq!(env.run(&frame(port, ACK, b"")).unwrap().0, XDP_TX);
        by_mac(&out)
    };
    // Connections through a until two share a backend.
    let mut seen = std::collections::HashMap::new();
    let (shared, other, first) = (46000..46100)
        .find_map(|p| {
            let to = open(&a, p);
            let pair = seen
                .iter()
                .find(|(_, b)| **b == to)
                .map(|(q, _)| (*q, p, to));
            seen.insert(p, to);
            pair
        })
        .unwrap();
    // That backend leaves the rings of both.
    for env in [&mut a, &mut b] {
        let slot = &env.dp.services[1];
        let ring: Vec<u32> = slot
            .backend_ids
            .iter()
            .zip(&slot.service.backends)
            .filter(|(_, addr)| addr.ip() != first)
            .map(|(id, _)| *id)
            .collect();
        env.dp.swap_ring(1, &ring).unwrap();
    }
    // a lists both flows; b takes only the first one's.
    let (list, truncated) = FlowBook::new(a.dp.flow_map().unwrap()).scan(&a.dp.maglev_tables());
    assert!(!truncated);
    assert_eq!(list.len(), 2, "{list:?}");
    let mut book = FlowBook::new(b.dp.flow_map().unwrap());
    let one: Vec<_> = list
        .iter()
        .filter(|f| f.client_port == shared)
        .cloned()
        .collect();
    let got = book.adopt(
        "10.0.0.1:9477".parse().unwrap(),
        &one,
        &b.dp.maglev_tables(),
        1,
    );
    assert_eq!((got.added, got.held, got.foreign), (1, 1, 0));
    let sid = b.dp.services[1].id;
    // Moved to b: the shared one stays on its backend, the other goes by
    // the table (elsewhere: it breaks, as it would without sharing).
    let request = frame(shared, ACK | PSH, b"GET / HTTP/1.1\r\n\r\n");
    let (v, out) = b.run(&request).unwrap();
    assert_eq!((v, by_mac(&out)), (XDP_TX, first));
    assert_eq!(out[12..], request[12..]);
    let (v, out) = b.run(&frame(shared, ACK, b"")).unwrap();
    assert_eq!((v, by_mac(&out)), (XDP_TX, first));
    let (v, out) = b.run(&frame(other, ACK, b"")).unwrap();
    assert_eq!(v, XDP_TX);
    assert_ne!(
        by_mac(&out),
        first,
        "an unshared flow goes by the new table"
    );
    let st = b.dp.service_stats(sid).unwrap();
    assert_eq!((st.taken_over, st.flows_new), (2, 2), "{st:?}");
    // b's own list now names the flow it took over (its table would send
    // it elsewhere too), for the next balancer to lose.
    let (mine, _) = FlowBook::new(b.dp.flow_map().unwrap()).scan(&b.dp.maglev_tables());
    assert_eq!(mine, one);
    // a's next answer no longer lists it: b forgets only what it did not
    // use.
    let got = book.adopt(
        "10.0.0.1:9477".parse().unwrap(),
        &[],
        &b.dp.maglev_tables(),
        2,
    );
    assert_eq!(got.held, 0);
    let (v, out) = b.run(&frame(shared, ACK, b"")).unwrap();
    assert_eq!((v, by_mac(&out)), (XDP_TX, first), "a used flow stays");
    // A new connection on a shared tuple that was never used: its SYN
    // opens a new flow by the table, and its ACK follows the SYN.
    let fresh = 47001;
    let f = huddle_user::cluster::handoff::SharedFlow {
        client: client.into(),
        client_port: fresh,
        vip: (VIP, DSR_MAGLEV).into(),
        proto: PROTO_TCP,
        backend: (first, DSR_MAGLEV).into(),
    };
    let got = book.adopt(
        "10.0.0.2:9477".parse().unwrap(),
        &[f],
        &b.dp.maglev_tables(),
        3,
    );
    assert_eq!(got.added, 1);
    let to = by_mac(&b.run(&syn(fresh, DSR_MAGLEV)).unwrap().1);
    assert_ne!(to, first);
    let (v, out) = b.run(&frame(fresh, ACK, b"")).unwrap();
    assert_eq!(
        (v, by_mac(&out)),
        (XDP_TX, to),
        "the handshake, not the shared flow"
    );
}
