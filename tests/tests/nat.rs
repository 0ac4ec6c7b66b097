//! NAT tuples never meet a backend's TIME_WAIT while fresher ones exist.
//!
//! A backend that closes first keeps each connection's 4-tuple (SNAT
//! address and port, its own address and port) in TIME_WAIT for 60 s. A
//! new SYN on such a tuple is either taken over by that TIME_WAIT socket
//! or, when its timestamp or sequence number is older, answered with an
//! ACK of the old connection: the client resets and resends its SYN a
//! timer tick later (8 ms at HZ=250). A narrow port range (2,000 ports)
//! and 200 new connections a second make a random allocator meet dozens
//! of TIME_WAIT tuples in a few seconds; walking each CPU's slice in order
//! meets none. The backends' own counters say which happened.

use std::{net::SocketAddr, path::Path, time::Duration};
use testbed::{in_ns, require_root, OpenLoop, Testbed, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const N: usize = 4;

/// `TcpExt` counters of the calling thread's network namespace.
fn tcp_ext() -> std::collections::BTreeMap<String, u64> {
    let text = std::fs::read_to_string("/proc/thread-self/net/netstat").expect("netstat");
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("TcpExt:")).collect();
    let names = lines[0].split_whitespace().skip(1);
    let values = lines[1].split_whitespace().skip(1);
    names
        .zip(values)
        .map(|(n, v)| (n.to_string(), v.parse().unwrap_or(0)))
        .collect()
}

#[test]
fn a_narrow_nat_range_never_hands_out_a_tuple_in_time_wait() {
    require_root();
    let mut bed = Testbed::new("nat", N).expect("testbed");
    bed.start_backends_with(Path::new(BACKEND), &["--delay-ms", "5"])
        .expect("backends");
    // HC_HUDDLE=PATH runs another build of the balancer (an older one, to
    // see this test fail on it).
    let huddle = std::env::var("HC_HUDDLE").unwrap_or_else(|_| HUDDLE.to_string());
    bed.start_huddle_service(
        Path::new(&huddle),
        &["--nat-ports", "20000-21999", "--no-rotation"],
    )
    .expect("huddle");
    let before: Vec<_> = bed.backends.iter().map(|ns| in_ns(ns, tcp_ext)).collect();
    let client_before = in_ns(&bed.client, tcp_ext);
    let vip: SocketAddr = (VIP, 80).into();
    let load = OpenLoop::start(&bed.client, vip, 200.0, Duration::from_secs(2));
    std::thread::sleep(Duration::from_secs(7));
    let outcomes = load.stop();
    let failed = outcomes.iter().filter(|o| o.result.is_err()).count();
    let diff =
        |a: &std::collections::BTreeMap<String, u64>,
         b: &std::collections::BTreeMap<String, u64>,
         k: &str| a.get(k).copied().unwrap_or(0) - b.get(k).copied().unwrap_or(0);
    // SYNs a TIME_WAIT socket refused (its PAWS check), on the backends...
    let refused: u64 = bed
        .backends
        .iter()
        .zip(&before)
        .map(|(ns, b)| diff(&in_ns(ns, tcp_ext), b, "PAWSTimewait"))
        .sum();
    // ...and the SYNs the client had to send again.
    let resent = diff(
        &in_ns(&bed.client, tcp_ext),
        &client_before,
        "TCPSynRetrans",
    );
    let st = bed.status().expect("status");
    let early: u64 = st.services[0]
        .backends
        .iter()
        .map(|b| b.counters.get("nat_reuse_early").copied().unwrap_or(0))
        .sum();
    println!(
        "2,000 NAT ports, 200 new connections/s for 7 s: {} requests, {failed} failed; \
         {refused} SYNs refused by a backend's TIME_WAIT, {resent} SYNs the client sent again; \
         nat_reuse_early {early}",
        outcomes.len()
    );
    assert_eq!(failed, 0);
    assert_eq!(
        refused, 0,
        "new flows met tuples still in TIME_WAIT on their backend"
    );
    assert_eq!(resent, 0, "clients had to resend SYNs");
    assert_eq!(early, 0);
}
