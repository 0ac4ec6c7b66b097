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
use testbed::{backends_total, in_ns, require_root, OpenLoop, Testbed, VIP};

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

/// What one load phase cost: requests, failed, SYNs refused by a
/// backend's TIME_WAIT (`PAWSTimewait` on the backends), SYNs the client
/// sent again.
struct Phase {
    requests: usize,
    failed: usize,
    refused: u64,
    resent: u64,
}

/// 200 new connections a second for `secs`, then waits for them.
fn phase(bed: &Testbed, secs: u64) -> Phase {
    let before: Vec<_> = bed.backends.iter().map(|ns| in_ns(ns, tcp_ext)).collect();
    let client_before = in_ns(&bed.client, tcp_ext);
    let vip: SocketAddr = (VIP, 80).into();
    // 4 s: a client's SYN resent once waits out its first retransmission
    // timeout (1 s), and one resent twice its second (3 s). With 2 s, one
    // request of 1,602 failed in a loaded CI run (4 December) whose client
    // resent 16 SYNs: the client's patience, not a lost flow.
    let load = OpenLoop::start(&bed.client, vip, 200.0, Duration::from_secs(4));
    std::thread::sleep(Duration::from_secs(secs));
    let outcomes = load.stop();
    for o in outcomes.iter().filter(|o| o.result.is_err()) {
        println!(
            "  failed at {:?} after {:?}: {:?}",
            o.at, o.latency, o.result
        );
    }
    let diff =
        |a: &std::collections::BTreeMap<String, u64>,
         b: &std::collections::BTreeMap<String, u64>,
         k: &str| a.get(k).copied().unwrap_or(0) - b.get(k).copied().unwrap_or(0);
    Phase {
        requests: outcomes.len(),
        failed: outcomes.iter().filter(|o| o.result.is_err()).count(),
        refused: bed
            .backends
            .iter()
            .zip(&before)
            .map(|(ns, b)| diff(&in_ns(ns, tcp_ext), b, "PAWSTimewait"))
            .sum(),
        resent: diff(
            &in_ns(&bed.client, tcp_ext),
            &client_before,
            "TCPSynRetrans",
        ),
    }
}

/// A testbed of `N` backends answering in 5 ms behind a balancer with
/// `ports` NAT ports from 20000 (HC_HUDDLE=PATH runs another build of the
/// balancer, an older one, to see these tests fail on it).
fn narrow(tag: &str, ports: u16) -> Testbed {
    require_root();
    let mut bed = Testbed::new(tag, N).expect("testbed");
    bed.start_backends_with(Path::new(BACKEND), &["--delay-ms", "5"])
        .expect("backends");
    let huddle = std::env::var("HC_HUDDLE").unwrap_or_else(|_| HUDDLE.to_string());
    let range = format!("20000-{}", 20000 + ports - 1);
    bed.start_huddle_service(
        Path::new(&huddle),
        &["--nat-ports", &range, "--no-rotation"],
    )
    .expect("huddle");
    bed
}

/// Two load phases of 4 s with a stop (the data plane removed) and a
/// fresh start between them; prints both.
fn stop_and_start(bed: &mut Testbed) -> (Phase, Phase) {
    let first = phase(bed, 4);
    bed.stop_huddle();
    bed.restart_huddle().expect("start again");
    let second = phase(bed, 4);
    for (run, p) in [("first", &first), ("second", &second)] {
        println!(
            "{run} run: {} requests, {} failed; {} SYNs refused by a backend's TIME_WAIT, {} sent again",
            p.requests, p.failed, p.refused, p.resent
        );
    }
    (first, second)
}

#[test]
fn a_narrow_nat_range_never_hands_out_a_tuple_in_time_wait() {
    let bed = narrow("nat", 2000);
    let p = phase(&bed, 7);
    let st = bed.status().expect("status");
    let early = backends_total(&st, "nat_reuse_early");
    println!(
        "2,000 NAT ports, 200 new connections/s for 7 s: {} requests, {} failed; \
         {} SYNs refused by a backend's TIME_WAIT, {} SYNs the client sent again; \
         nat_reuse_early {early}",
        p.requests, p.failed, p.refused, p.resent
    );
    assert_eq!(p.failed, 0);
    assert_eq!(
        p.refused, 0,
        "new flows met tuples still in TIME_WAIT on their backend"
    );
    assert_eq!(p.resent, 0, "clients had to resend SYNs");
    assert_eq!(early, 0);
}

/// The balancer stopped (its data plane removed) and started afresh at
/// once: the backends still hold the last run's tuples in TIME_WAIT. The
/// new run carries on the walk where the last one stood (the NAT walk
/// file), so it meets none of them. Measured with the clock-based start
/// alone (build 0f05770): 138 of the second run's 802 SYNs were refused by
/// a TIME_WAIT and sent again; with the walk file, 0.
#[test]
fn a_fresh_start_carries_on_the_nat_walk_of_the_last_run() {
    let mut bed = narrow("natre", 2000);
    let (first, second) = stop_and_start(&mut bed);
    assert_eq!(first.failed + second.failed, 0);
    assert_eq!(
        (first.refused, second.refused),
        (0, 0),
        "new flows met tuples still in TIME_WAIT on their backend"
    );
    assert_eq!((first.resent, second.resent), (0, 0));
}

/// Past the capacity across a fresh start: 400 NAT ports (200 per CPU
/// slice), so the second run must reuse the first run's tuples seconds
/// after their close, while the backends hold them in TIME_WAIT. The
/// first run leaves the client's last timestamps of those tuples in the
/// NAT walk file; the second passes over a tuple whose TIME_WAIT would
/// refuse its SYN. Measured: 0, 0 and 9 of 801-802 SYNs of the second run
/// refused (196-288 tuples passed over; the 9 in a debug-build CI run,
/// the remainder the README's NAT section could not yet explain); with
/// build 0f05770 (the check within a run only), 277 of 802. Asserted: at
/// most 5%.
#[test]
fn past_the_capacity_a_fresh_start_passes_over_the_last_runs_time_waits() {
    let mut bed = narrow("nattw", 400);
    let (first, second) = stop_and_start(&mut bed);
    let st = bed.status().expect("status");
    let early = backends_total(&st, "nat_reuse_early");
    let skipped = backends_total(&st, "nat_tw_skipped");
    // `nat_reuse_early` counts from a walk's second round after a start,
    // so the resumed walk's first wrap here is not counted.
    println!("second run: nat_reuse_early {early}, nat_tw_skipped {skipped}");
    assert_eq!(first.failed + second.failed, 0);
    assert!(skipped > 0, "no tuple was passed over");
    assert!(
        second.refused * 20 <= second.requests as u64,
        "{} of {} SYNs refused by a TIME_WAIT",
        second.refused,
        second.requests
    );
}

/// Past the capacity within one run, with a client that sends no TCP
/// timestamps (Windows' default): a backend's TIME_WAIT then takes or
/// refuses a new SYN by its sequence number alone, a coin toss the
/// balancer cannot foresee. It sees the refusal (an ACK of the old
/// connection on a half-open tuple) and sends the client's SYN again
/// itself from another tuple, up to `MAX_TUPLE_RETRIES` times; the client
/// resends only when every one of them was refused. Measured: 307-388
/// SYNs resent by the balancer, 8-10 by the client (each 8 ms late), none
/// lost; build 5d40ef6 passed every refusal on, and the client resent 87.
/// 400 ports, not
/// fewer: at 256 (128 per CPU slice) the 2 s linger of closed flows held
/// whole slices and SYNs were dropped for want of a tuple.
#[test]
fn a_syn_a_time_wait_refuses_is_resent_by_the_balancer_not_the_client() {
    let bed = narrow("nattwack", 400);
    in_ns(&bed.client, || {
        std::fs::write("/proc/sys/net/ipv4/tcp_timestamps", "0").expect("client sysctl")
    });
    let p = phase(&bed, 8);
    let st = bed.status().expect("status");
    let balancer = backends_total(&st, "retried_time_wait");
    let early = backends_total(&st, "nat_reuse_early");
    println!(
        "400 NAT ports, no client timestamps, 200 new connections/s for 8 s: {} requests, \
         {} failed; {balancer} SYNs a TIME_WAIT refused resent by the balancer, {} by the \
         client; nat_reuse_early {early}",
        p.requests, p.failed, p.resent
    );
    assert_eq!(p.failed, 0);
    // (`nat_reuse_early` counts from the walk's second round only: a
    // debug build's run reused tuples, 208 were refused, and counted 0.)
    assert!(balancer > 0, "no refusal was resent by the balancer");
    // How many SYNs meet a TIME_WAIT depends on which end closed first
    // (the backend's FIN races the client's): 4, 35 and 364 resent by the
    // balancer in three runs here. With a handful the tenth is under one.
    assert!(
        p.resent <= (balancer / 10).max(2),
        "the client resent {} SYNs, the balancer {balancer}",
        p.resent
    );
}
