//! UDP flows that end: a flow is established only by the client's datagram
//! after the backend's answer, one-shot flows (a query and its answer)
//! never take a flow-table entry or a NAT tuple past their half-open slot,
//! and an established flow silent for `udp_idle_ms` is removed with its
//! NAT entry. Real datagrams through the XDP path, a flow table of 1,024
//! entries, 10,000 one-shot flows, a 4 s idle timeout.

use aya::maps::{HashMap, MapData};
use huddle_common::{maps, FlowKey, FlowValue, NatKey, NatValue, PROTO_UDP};
use std::{
    net::{SocketAddr, UdpSocket},
    path::Path,
    thread,
    time::{Duration, Instant},
};
use testbed::{backend_ip, in_ns, require_root, wait_until, Testbed, UDP_PORT, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const TIMEOUT: Duration = Duration::from_secs(2);

/// UDP entries in the pinned flow and NAT tables.
fn udp_entries(bed: &Testbed) -> (usize, usize) {
    let flows: HashMap<MapData, FlowKey, FlowValue> =
        HashMap::try_from(aya::maps::Map::LruHashMap(
            MapData::from_pin(bed.pins.join(maps::FLOWS)).expect("pinned FLOWS"),
        ))
        .expect("FLOWS");
    let nat: HashMap<MapData, NatKey, NatValue> = HashMap::try_from(aya::maps::Map::LruHashMap(
        MapData::from_pin(bed.pins.join(maps::NAT)).expect("pinned NAT"),
    ))
    .expect("NAT");
    let f = flows
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.proto == PROTO_UDP)
        .count();
    let n = nat
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.proto == PROTO_UDP)
        .count();
    (f, n)
}

/// Established (active) flows over the service's backends, per status,
/// once two huddle ticks have read the counters.
fn active(bed: &Testbed) -> u64 {
    thread::sleep(Duration::from_millis(250));
    bed.status().expect("status").services[0]
        .backends
        .iter()
        .map(|b| b.active_flows)
        .sum()
}

#[test]
fn one_shot_udp_flows_hold_nothing_and_idle_ones_are_removed_with_their_nat_tuple() {
    require_root();
    let mut bed = Testbed::new("udp", 2).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    let config = bed.dir.join("huddle.toml");
    let backends: Vec<String> = (0..2)
        .map(|i| format!("\"{}:{UDP_PORT}\"", backend_ip(i)))
        .collect();
    std::fs::write(
        &config,
        format!(
            "flow_table_size = 1024\n\n[[service]]\nvip = \"{VIP}:53/udp\"\nudp_idle_ms = 4000\nbackends = [{}]\n",
            backends.join(", ")
        ),
    )
    .unwrap();
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &config.display().to_string()],
    )
    .expect("start huddle");
    let vip: SocketAddr = (VIP, 53).into();

    // 200 flows with two exchanges each: established, and kept open.
    let kept = in_ns(&bed.client, move || {
        (0..200)
            .map(|i| {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                s.set_read_timeout(Some(TIMEOUT)).unwrap();
                let mut answers = Vec::new();
                for _ in 0..2 {
                    s.send_to(format!("k{i}").as_bytes(), vip).unwrap();
                    let mut buf = [0u8; 512];
                    let (n, _) = s.recv_from(&mut buf).expect("answer");
                    answers.push(String::from_utf8_lossy(&buf[..n]).to_string());
                }
                assert_eq!(answers[0], answers[1], "one flow, one backend");
                (s, answers[0].clone())
            })
            .collect::<Vec<_>>()
    });
    let established = active(&bed);
    println!("200 two-exchange flows: {established} established");
    assert_eq!(established, 200);

    // 10,000 one-shot flows (a query from a port of its own, its answer):
    // ten times the flow table. None is established or keeps a NAT tuple.
    // (The kernel's random ephemeral ports would repeat a tuple now and
    // then, and a tuple that sends again after an answer is a two-way
    // flow: established, then removed when idle.)
    let t0 = Instant::now();
    let failed = in_ns(&bed.client, move || {
        (0..10_000u16)
            .filter(|i| {
                let s = UdpSocket::bind(("0.0.0.0", 20_000 + i)).unwrap();
                s.set_read_timeout(Some(TIMEOUT)).unwrap();
                s.send_to(b"q", vip).unwrap();
                s.recv_from(&mut [0u8; 512]).is_err()
            })
            .count()
    });
    println!(
        "10,000 one-shot flows in {:.1} s, {failed} unanswered",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(failed, 0);
    let (flows, nat) = udp_entries(&bed);
    println!("after them: {flows} UDP flows and {nat} UDP NAT entries in the tables");
    assert_eq!(active(&bed), 200, "one-shot flows are never established");
    assert_eq!((flows, nat), (200, 200));

    // The established flows were not evicted: each still reaches its
    // backend, on its own tuple, and is still the same flow.
    let still = in_ns(&bed.client, move || {
        kept.iter()
            .filter(|(s, backend)| {
                s.send_to(b"again", vip).unwrap();
                let mut buf = [0u8; 512];
                s.recv_from(&mut buf).is_ok_and(|(n, _)| {
                    let a = String::from_utf8_lossy(&buf[..n]).to_string();
                    a.split(':').next() == backend.split(':').next()
                })
            })
            .count()
    });
    assert_eq!(still, 200, "established flows survived the flood");
    assert_eq!(active(&bed), 200, "and were not established again");

    // Silent for udp_idle_ms (4 s: well past the steps above, so none was
    // removed before its time): removed within the next sweep (every
    // second), NAT entries with them.
    let t0 = Instant::now();
    wait_until(Duration::from_secs(10), || {
        active(&bed) == 0 && udp_entries(&bed) == (0, 0)
    })
    .unwrap_or_else(|_| {
        panic!(
            "idle flows still held: active {}, tables {:?}",
            active(&bed),
            udp_entries(&bed)
        )
    });
    println!(
        "idle flows removed {:.1} s after their last datagram",
        t0.elapsed().as_secs_f64()
    );
    let st = bed.status().unwrap();
    print!("{}", st.render());
    thread::sleep(Duration::from_millis(10));
}
