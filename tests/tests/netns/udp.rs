//! UDP flows that end: a flow is established only by the client's datagram
//! after the backend's answer, one-shot flows (a query and its answer)
//! never take a flow-table entry or a NAT tuple past their half-open slot,
//! and an established flow silent for `udp_idle_ms` is removed with its
//! NAT entry. Real datagrams through the XDP path, a flow table of 1,024
//! entries, 10,000 one-shot flows, a 4 s idle timeout. And a flood of new
//! flows refused for want of a NAT tuple writes a kernel log line at most
//! once a second per CPU, not one a packet; spoofed pairs at 1 kpps for
//! 40 s (each flow promoted on one exchange) leave a real client answered.

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
            MapData::from_pin(bed.pins.join(maps::UDP_FLOWS)).expect("pinned UDP_FLOWS"),
        ))
        .expect("UDP_FLOWS");
    let nat: HashMap<MapData, NatKey, NatValue> = HashMap::try_from(aya::maps::Map::LruHashMap(
        MapData::from_pin(bed.pins.join(maps::UDP_NAT)).expect("pinned UDP_NAT"),
    ))
    .expect("UDP_NAT");
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

/// Starts the balancer with config `text` (the UDP service VIP:53); the VIP.
fn start(bed: &mut Testbed, text: &str) -> SocketAddr {
    let config = bed.dir.join("huddle.toml");
    std::fs::write(&config, text).unwrap();
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &config.display().to_string()],
    )
    .expect("start huddle");
    (VIP, 53).into()
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
    let backends: Vec<String> = (0..2)
        .map(|i| format!("\"{}:{UDP_PORT}\"", backend_ip(i)))
        .collect();
    let vip = start(
        &mut bed,
        &format!(
            "flow_table_size = 1024\n\n[[service]]\nvip = \"{VIP}:53/udp\"\nudp_idle_ms = 4000\nbackends = [{}]\n",
            backends.join(", ")
        ),
    );

    // 200 flows with three exchanges each: established (the second),
    // confirmed (the third: a source-NAT flow of one exchange after its
    // promotion is removed after 2 s of silence, not `udp_idle_ms`) and
    // kept open.
    let kept = in_ns(&bed.client, move || {
        (0..200)
            .map(|i| {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                s.set_read_timeout(Some(TIMEOUT)).unwrap();
                let mut answers = Vec::new();
                for _ in 0..3 {
                    s.send_to(format!("k{i}").as_bytes(), vip).unwrap();
                    let mut buf = [0u8; 512];
                    let (n, _) = s.recv_from(&mut buf).expect("answer");
                    answers.push(String::from_utf8_lossy(&buf[..n]).to_string());
                }
                assert!(
                    answers.iter().all(|a| *a == answers[0]),
                    "one flow, one backend"
                );
                (s, answers[0].clone())
            })
            .collect::<Vec<_>>()
    });
    let established = active(&bed);
    println!("200 three-exchange flows: {established} established");
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

#[test]
fn a_flood_of_flows_no_nat_tuple_is_left_for_writes_a_bounded_number_of_log_lines() {
    require_root();
    let mut bed = Testbed::new("udplog", 1).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    // 256 NAT ports, one SNAT address, one backend: 256 tuples.
    let vip = start(
        &mut bed,
        &format!(
            "nat_ports = \"20000-20255\"\n\n[[service]]\nvip = \"{VIP}:53/udp\"\nbackends = [\"{}:{UDP_PORT}\"]\n",
            backend_ip(0)
        ),
    );
    // Confirmed flows (three exchanges: an unconfirmed one's tuple is free
    // again after 2 s of silence) until no tuple is left: each holds one.
    // On one CPU (the veth runs the program on the sender's): every flow
    // below meets the same slice of tuples, as a flood from one queue does.
    let held = in_ns(&bed.client, move || {
        on_cpu(0);
        let mut held = Vec::new();
        for i in 0..400 {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            let ok = (0..3).all(|_| {
                s.send_to(format!("h{i}").as_bytes(), vip).unwrap();
                s.recv_from(&mut [0u8; 512]).is_ok()
            });
            if !ok {
                break;
            }
            held.push(s);
        }
        held
    });
    println!("{} flows established before the tuples ran out", held.len());
    // Each CPU walks a slice of the tuples: the first flow to find its
    // slice full ends this.
    assert!((64..=256).contains(&held.len()), "{}", held.len());
    // 2,000 new flows: each that reaches the program is refused for want
    // of a tuple (a busy machine's veth drops some before it: counted).
    let lost_before = veth_dropped(&bed.client);
    let t0 = Instant::now();
    in_ns(&bed.client, move || {
        on_cpu(0);
        // Paced (10 kpps or less): a burst overflows the veth's backlog
        // before the program sees it.
        for i in 0..2_000 {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.send_to(b"q", vip).unwrap();
            if i % 20 == 19 {
                thread::sleep(Duration::from_millis(2));
            }
        }
    });
    let took = t0.elapsed();
    thread::sleep(Duration::from_secs(2));
    let refused = bed.status().unwrap().services[0].counters["drop_nat_ports"];
    let lost = veth_dropped(&bed.client) - lost_before;
    let log = bed.huddle_log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("no free NAT tuple"))
        .collect();
    println!(
        "2,000 new flows in {:.2} s, {lost} dropped by the veth before the program, {refused} refused for want of a tuple: {} kernel log lines\n{}",
        took.as_secs_f64(),
        lines.len(),
        lines.join("\n")
    );
    // At most one a second per CPU over the flood and the wait.
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let bound = cpus * (took.as_secs() as usize + 3);
    assert!(
        lines.len() <= bound,
        "{} lines, more than {bound}",
        lines.len()
    );
    // Every flow that reached the program met a full slice.
    assert!(refused >= 1_000, "most were refused: {refused}");
    assert!(
        refused + lost >= 1_990,
        "each flow that reached the program was refused: {refused} + {lost} lost"
    );
    assert!(!lines.is_empty(), "the refusals are said");
    drop(held);
}

/// Keeps the calling thread on `cpu`.
fn on_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is empty; valid pointers.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Frames `ns`'s eth0 dropped on the way out: a veth whose peer runs XDP
/// drops them when the peer's ring is full, before the program runs.
fn veth_dropped(ns: &huddle_user::sys::netns::Netns) -> u64 {
    let out = ns
        .output("ip", &["-s", "-j", "link", "show", "eth0"])
        .expect("ip -s link");
    let v: serde_json::Value = serde_json::from_str(&out).expect("ip's JSON");
    v[0]["stats64"]["tx"]["dropped"].as_u64().unwrap_or(0)
}

/// Sends spoofed UDP pairs (a datagram, then another 20 ms later, after
/// the backend's answer has gone to the made-up client) from
/// 10.213.128.0/17 at `pps` pairs a second for `run`, moving between the
/// CPUs each second (each CPU has its own NAT tuples); returns the pairs.
fn spoof_pairs(ns: &str, pps: u64, run: Duration) -> u64 {
    use huddle_common::headers::ETH_LEN;
    use huddle_user::kernel::packet::Frame;
    huddle_user::sys::netns::enter(ns).expect("client namespace");
    // SAFETY: plain socket call; the descriptor is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    let datagram = |i: u64| {
        let src = std::net::Ipv4Addr::new(10, 213, 128 | ((i >> 8) & 0x7f) as u8, i as u8);
        Frame::udp((src, 2000 + (i >> 15) as u16), (VIP, 53))
            .payload(b"spoofed")
            .build()[ETH_LEN..]
            .to_vec()
    };
    let dst = libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(VIP.octets()),
        },
        sin_zero: [0; 8],
    };
    let send = |p: &[u8]| {
        // SAFETY: valid buffer and address for the call.
        unsafe {
            libc::sendto(
                fd,
                p.as_ptr().cast(),
                p.len(),
                0,
                std::ptr::from_ref(&dst).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as u32,
            )
        };
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let lag = pps / 50; // the second datagram, 20 ms after the first
    let start = Instant::now();
    let mut i = 0u64;
    while start.elapsed() < run {
        if i.is_multiple_of(pps) {
            on_cpu((i / pps) as usize % cpus);
        }
        send(&datagram(i));
        if i >= lag {
            send(&datagram(i - lag));
        }
        i += 1;
        let due = start + Duration::from_secs_f64(i as f64 / pps as f64);
        if let Some(w) = due.checked_duration_since(Instant::now()) {
            thread::sleep(w);
        }
    }
    // SAFETY: closing our own descriptor.
    unsafe { libc::close(fd) };
    i
}

/// Asks `vip` on `s` up to three times (500 ms each); whether it answered.
fn asked(s: &UdpSocket, vip: SocketAddr, what: &[u8]) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    (0..3).any(|_| {
        s.send_to(what, vip).unwrap();
        s.recv_from(&mut [0u8; 512]).is_ok()
    })
}

/// Spoofed UDP pairs at 1,000 a second for 40 s, each promoted on one
/// exchange, over 10,000 NAT tuples (5,000 a CPU): held for `udp_idle`
/// (30 s) they would take every tuple within about 10 s. Beside them a
/// real client keeps one flow (a datagram every 250 ms) and opens a new
/// one every 500 ms: every one is answered, and the kernel log stays
/// within one line a second per CPU.
#[test]
fn spoofed_udp_pairs_at_1_kpps_for_40_s_leave_a_real_clients_flows_answered() {
    require_root();
    let mut bed = Testbed::new("udpspoof", 1).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    let vip = start(
        &mut bed,
        &format!(
            "nat_ports = \"20000-29999\"\n\n[[service]]\nvip = \"{VIP}:53/udp\"\nbackends = [\"{}:{UDP_PORT}\"]\n",
            backend_ip(0)
        ),
    );
    const RUN: Duration = Duration::from_secs(40);
    let ns = bed.client.name.clone();
    let spoofer = thread::spawn(move || spoof_pairs(&ns, 1_000, RUN));
    let (kept, new) = in_ns(&bed.client, move || {
        let keep = UdpSocket::bind("0.0.0.0:0").unwrap();
        let (mut kept, mut new) = ((0, 0), (0, 0));
        let t0 = Instant::now();
        let mut n = 0u32;
        while t0.elapsed() < RUN {
            kept.0 += 1;
            kept.1 += u32::from(asked(&keep, vip, format!("keep{n}").as_bytes()));
            if n.is_multiple_of(2) {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                new.0 += 1;
                new.1 += u32::from(asked(&s, vip, format!("new{n}").as_bytes()));
            }
            n += 1;
            thread::sleep(Duration::from_millis(250));
        }
        (kept, new)
    });
    let pairs = spoofer.join().unwrap();
    let st = bed.status().unwrap();
    let c = &st.services[0].counters;
    let lines = bed
        .huddle_log()
        .lines()
        .filter(|l| l.contains("no free NAT tuple"))
        .count();
    println!(
        "{pairs} spoofed pairs in {RUN:?}; kept flow {}/{} answered, new flows {}/{}; promoted {}, drop_nat_ports {}; {lines} kernel log lines",
        kept.1, kept.0, new.1, new.0, c["promoted"], c["drop_nat_ports"]
    );
    assert!(pairs >= 30_000, "the flood ran: {pairs}");
    assert_eq!(kept.1, kept.0, "the kept flow went unanswered");
    assert_eq!(new.1, new.0, "a new flow went unanswered");
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    assert!(
        lines <= cpus * (RUN.as_secs() as usize + 3),
        "{lines} log lines"
    );
}
