//! Three balancers behind a router (ECMP by BGP, BFD), L2 DSR with Maglev:
//! under steady load one balancer's link is cut; the router stops using
//! it, the connections it moves to the other two keep working on their
//! backend; the balancer coming back breaks none.
//!
//! The balancers form a `[cluster]`: the first member that answers
//! decides the rings for all. Without it each balancer's huddle decided
//! alone from the third of the traffic it sees, and their rings (so their
//! Maglev tables) disagreed: measured, one rested a backend as hot that
//! the others kept, a cut-off one rested backends as unhealthy, and
//! 35-135 of about 330 moved connections broke on another backend.

use huddle_user::status::control::{self, Request};
use std::{
    path::Path,
    thread,
    time::{Duration, Instant},
};
use testbed::{
    scaleout::{balancer_ip, scale_backend_ip, scale_vip, ScaleOut},
    tally, wait_until, HeldConnections, OpenLoop,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

/// The timed test runs alone: beside another three-balancer testbed on
/// two cores (CI, 4 December), its rings disagreed for 261 ms and left
/// after 1.5-1.7 s, against 0.3-0.7 s and 133-202 ms alone (ten runs).
/// The others may share the machine with each other.
static TIMED: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    TIMED
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn taken_over(s: &ScaleOut, i: usize) -> u64 {
    s.status(i)
        .ok()
        .and_then(|st| st.services[0].counters.get("taken_over").copied())
        .unwrap_or(0)
}

/// The huddle rotating (as by default), the rings agreed through
/// `[cluster]`, flows handed off: measured, 0 broken in each of 10 runs,
/// among them runs where the leader rested a backend in the first second
/// and took it back after the cut. Before the hand-off, 1 run in 15 broke
/// 82 connections that way (a balancer taking a connection over picked by
/// the ring of now). The cut waits for 3 s of unchanged rings: a return
/// just before it broke 109 and 175 moved connections in 2 of 6 CI runs
/// while the hand-off ran once a second. A return during the cut (CI, 2
/// December: 1.1 s after it, 28 of 342 moved connections reset) now waits
/// for the rings' hold (`membership`; the slow twist below tests it).
#[test]
fn connections_a_lost_balancer_had_carry_on_through_the_others() {
    let _shared = shared();
    failover(true, Twist::None);
}

/// The rings change after the connections opened (backend 0 drained on
/// the leader: it keeps serving its connections, but the Maglev tables no
/// longer name it), then a balancer is lost. A balancer taking a
/// connection over cannot find its backend in its table; the flows the
/// lost one shared (`handoff`) give it. Without the sharing, every moved
/// connection on backend 0 would break (about a quarter of them).
#[test]
fn connections_keep_their_backend_across_a_ring_change_and_a_failover() {
    let _shared = shared();
    failover(false, Twist::DrainFirst);
}

/// A backend turns 5x slow (10 ms made 50 ms) as soon as the router has
/// dropped the lost balancer: the leader's huddle would rest it within about 0.3 s,
/// while the moved connections are still being taken over, and those on
/// it (explained by the ring before, so never shared) would be taken over
/// to another backend and reset. The leader, having lost a member, holds
/// the rings for `membership::HOLD` (5 s): the backend rests after that,
/// when every moved connection has its own flow entry. Measured in CI
/// before the hold: a backend's return 1 s after a cut broke 28 of 342
/// moved connections.
#[test]
fn a_backend_turning_slow_while_a_balancer_is_lost_rests_once_connections_moved() {
    let _shared = shared();
    failover(true, Twist::SlowDuringCut);
}

/// What happens around the cut besides it.
#[derive(PartialEq)]
enum Twist {
    None,
    /// Backend 0 drained on the leader before the cut.
    DrainFirst,
    /// Backend 2 made 5x slow once the router dropped the cut balancer.
    SlowDuringCut,
}

/// Waits (at most `limit`) until no balancer's ring generation has
/// moved for `quiet`; says how long that took, or the generations if
/// they never settled.
fn wait_rings_quiet(s: &ScaleOut, quiet: Duration, limit: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    let gens = || -> Vec<u64> {
        (0..3)
            .map(|i| s.status(i).map_or(0, |st| st.services[0].ring_generation))
            .collect()
    };
    let mut seen = gens();
    let mut since = Instant::now();
    while start.elapsed() < limit {
        thread::sleep(Duration::from_millis(100));
        let now = gens();
        if now != seen {
            seen = now;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            return Ok(start.elapsed());
        }
    }
    Err(format!("ring generations still moving: {seen:?}"))
}

fn failover(rotation: bool, twist: Twist) {
    testbed::require_root();
    let mut s = ScaleOut::build("so", 3, 4).expect("build");
    let t0 = Instant::now();
    // The slow twist needs backends with a time of their own (10 ms made
    // 50 ms is hot; 0 ms made 50 ms is hung, and the sick leave at once).
    let backend_args: &[&str] = if twist == Twist::SlowDuringCut {
        &["--delay-ms", "10"]
    } else {
        &[]
    };
    s.start_with(
        Path::new(HUDDLE),
        Path::new(BACKEND),
        rotation,
        backend_args,
    )
    .expect("start");
    println!(
        "the router spread the VIP over {:?} {:?} after the start",
        s.next_hops(),
        t0.elapsed()
    );
    if twist == Twist::SlowDuringCut {
        // The connections must spread over all four backends (a backend
        // rested at start-up would hold none of them, and its leave would
        // move none): every ring full and unchanged for 3 s first.
        let full = wait_until(Duration::from_secs(30), || {
            (0..3).all(|i| s.status(i).is_ok_and(|st| st.services[0].ring.len() == 4))
        });
        let quiet = wait_rings_quiet(&s, Duration::from_secs(3), Duration::from_secs(20));
        println!("rings full: {full:?}, then unchanged for 3 s: {quiet:?}");
    }
    // 1,000 keep-alive connections, a request each every second; and 100
    // new connections a second.
    let held = HeldConnections::start(&s.client, scale_vip(), 20, 50, Duration::from_secs(1));
    held.wait_opened(1000, Duration::from_secs(30))
        .expect("open the connections");
    let load = OpenLoop::start(&s.client, scale_vip(), 100.0, Duration::from_secs(16));
    if twist == Twist::DrainFirst {
        let b0 = format!("{}:{}", scale_backend_ip(0), scale_vip().port());
        let r = control::call(
            &s.socket(0),
            &Request::Drain {
                backend: b0.clone(),
                vip: None,
            },
        )
        .unwrap();
        assert!(r.ok, "drain: {:?}", r.error);
        let drained = Instant::now();
        // The followers take the leader's ring, then the balancers swap
        // their lists of flows.
        wait_until(Duration::from_secs(10), || {
            (0..3).all(|i| {
                s.status(i).is_ok_and(|st| {
                    !st.services[0].ring.contains(&b0)
                        && st.notes.iter().any(|n| {
                            n.starts_with("handoff: shares")
                                && !n.starts_with("handoff: shares 0 ")
                                && n.matches(": ").count() >= 3
                        })
                })
            })
        })
        .unwrap_or_else(|_| {
            panic!(
                "the rings or the shared flows never settled: {:?}",
                (0..3)
                    .map(|i| s.status(i).map(|st| st.notes).unwrap_or_default())
                    .collect::<Vec<_>>()
            )
        });
        println!(
            "rings and shared flows settled {:?} after the drain",
            drained.elapsed()
        );
        thread::sleep(Duration::from_secs(2));
        for i in 0..3 {
            let st = s.status(i).unwrap();
            println!(
                "balancer {i} after the drain: {:?}",
                st.notes
                    .iter()
                    .filter(|n| n.starts_with("handoff"))
                    .collect::<Vec<_>>()
            );
        }
    } else {
        thread::sleep(Duration::from_secs(3));
        // This test is about the failover, not about a ring change just
        // before it (a balancer lost within about 0.5 s of one may break
        // connections the change moved: see `handoff`). A backend rested
        // at the start (measured: the start-up of three daemons on two
        // cores makes probes slow for a tick or two) returns about 10 s
        // later, which is when the cut would come.
        let quiet = wait_rings_quiet(&s, Duration::from_secs(3), Duration::from_secs(20));
        println!("rings unchanged for 3 s before the cut: {quiet:?}");
    }
    let before: Vec<u64> = (0..3).map(|i| taken_over(&s, i)).collect();

    // New flows' balancers, from the router's FIB: 3,000 client ports.
    let sample = 20000..23000;
    let hops_before = s.balancer_of(sample.clone()).unwrap();
    let cut = Instant::now();
    let cut_at = cut - load.start;
    s.cut_link(1).unwrap();
    wait_until(Duration::from_secs(10), || {
        !s.next_hops().contains(&balancer_ip(1))
    })
    .expect("the router kept the cut balancer");
    let withdrawn = cut.elapsed();
    println!("next hops after the cut: {:?}", s.next_hops());
    let hops_cut = s.balancer_of(sample.clone()).unwrap();
    if twist == Twist::SlowDuringCut {
        let slow = Instant::now();
        s.backend_admin(2, "delay_ms=50").unwrap();
        let b2 = format!("{}:{}", scale_backend_ip(2), scale_vip().port());
        let rested = wait_until(Duration::from_secs(9), || {
            s.status(0)
                .is_ok_and(|st| !st.services[0].ring.contains(&b2))
        });
        let log = s.log(0);
        println!(
            "the slow backend left the leader's ring {:?} after it turned slow ({:?} after the cut); leader: {:?}",
            slow.elapsed(),
            cut.elapsed(),
            log.lines()
                .filter(|l| l.contains("rings hold"))
                .filter_map(|l| l[l.find("cluster:").unwrap_or(0)..].split('\u{1b}').next())
                .collect::<Vec<_>>()
        );
        assert!(rested.is_ok(), "the slow backend never rested");
        thread::sleep(Duration::from_secs(1));
    } else {
        thread::sleep(Duration::from_secs(5));
    }
    let moved: u64 = [0, 2].iter().map(|i| taken_over(&s, *i) - before[*i]).sum();

    let back = Instant::now();
    let back_at = back - load.start;
    s.restore_link(1).unwrap();
    if wait_until(Duration::from_secs(20), || s.next_hops().len() == 3).is_err() {
        panic!(
            "the balancer never came back: next hops {:?}\n{}\n{:?}\n{}",
            s.next_hops(),
            s.status(1).map(|st| st.render()).unwrap_or_default(),
            huddle_user::cluster::bgp::bird(
                &s.dir.join("lb1-bird.ctl"),
                "show protocols all uplink"
            ),
            s.log(1)
        );
    }
    let returned = back.elapsed();
    let hops_back = s.balancer_of(sample.clone()).unwrap();
    let share = |a: &[Option<std::net::Ipv4Addr>], b: &[Option<std::net::Ipv4Addr>]| {
        a.iter().zip(b).filter(|(x, y)| x != y).count() as f64 / a.len() as f64
    };
    let (by_cut, by_return) = (share(&hops_before, &hops_cut), share(&hops_cut, &hops_back));
    println!(
        "new flows whose balancer changed ({} sampled client ports): {:.1}% when balancer 1 left, {:.1}% when it came back; {:.1}% back where they were before",
        sample.len(),
        100.0 * by_cut,
        100.0 * by_return,
        100.0 * (1.0 - share(&hops_before, &hops_back))
    );
    thread::sleep(Duration::from_secs(5));
    let moved_back = taken_over(&s, 1) - before[1];
    let held_slowest = held.slowest_us.load(std::sync::atomic::Ordering::Relaxed);

    let errors = held.stop();
    let slowest = Duration::from_micros(held_slowest);
    let outcomes = load.stop();
    let (by_backend, failed) = tally(&outcomes, Duration::ZERO, Duration::MAX);
    println!(
        "new connections failed (times since the load began; the link was cut at {:?}, restored at {:?}): {:?}",
        cut_at,
        back_at,
        failed.iter().take(10).collect::<Vec<_>>()
    );
    println!(
        "link of balancer 1 cut: the router dropped it after {withdrawn:?}; {moved} connections moved to the other two; back after {returned:?}, {moved_back} moved to it"
    );
    println!(
        "keep-alive connections broken: {} of 1000 ({:?}), slowest request {slowest:?}; new connections: {} of {} failed; answered by {by_backend:?}",
        errors.len(),
        errors.iter().take(5).collect::<Vec<_>>(),
        failed.len(),
        outcomes.len()
    );
    for i in 0..3 {
        if let Ok(st) = s.status(i) {
            println!("balancer {i}: {:?}", st.services[0].counters);
            println!(
                "balancer {i}: ring generation {}, ring {:?}, rotations {:?}",
                st.services[0].ring_generation,
                st.services[0].ring,
                st.services[0]
                    .recent
                    .iter()
                    .map(|e| format!(
                        "{:.1}s {} {} {}",
                        e.at_s,
                        e.backend,
                        e.to.as_str(),
                        e.reason
                    ))
                    .collect::<Vec<_>>()
            );
            let skipped: Vec<u64> = st.services[0]
                .backends
                .iter()
                .map(|b| b.counters.get("skipped_owing").copied().unwrap_or(0))
                .collect();
            println!(
                "balancer {i}: new flows passed over an owing backend, per backend: {skipped:?}"
            );
        }
    }
    for line in s.log(1).lines().filter(|l| {
        l.contains("moving") || l.contains("panic") || l.contains("cluster") || l.contains("bgp")
    }) {
        println!(
            "lb1: {}",
            &line[line.find("Z").map_or(0, |z| z + 1)..]
                .chars()
                .take(200)
                .collect::<String>()
        );
    }
    // The leader's rotations and why (a ring change near the cut is what
    // breaks moved connections).
    for line in s.log(0).lines().filter(|l| l.contains("rotation:")) {
        println!(
            "lb0: {}",
            &line[line.find("rotation:").unwrap_or(0)..]
                .chars()
                .take(300)
                .collect::<String>()
        );
    }
    assert!(moved > 0, "nothing moved");
    // About 1/3: Linux ECMP is hash-threshold, and balancer 1 is the
    // middle next hop (an edge one also moves a quarter of the others').
    assert!(
        by_return <= 0.40,
        "the return moved {by_return:.3} of new flows"
    );
    assert!(
        errors.len() as f64 <= 0.01 * moved as f64,
        "{} broken of {moved} moved",
        errors.len()
    );
}

/// A 5x slow backend leaves the ring of all three balancers. The leader
/// decides from every balancer's readings (`pooled`): measured over 8
/// runs, its ring lost the backend after 246-366 ms and the last
/// follower's after 310-436 ms, the rings disagreeing for 62-74 ms. When
/// the leader decided from its own third of the traffic: 321-449 ms and
/// 384-531 ms. Asserted (with room for a loaded CI machine): all within
/// 1 s, rings disagreeing at most 500 ms (five ticks: a follower takes
/// the leader's ring once a tick; a CI run of 4 December disagreed 252
/// ms, the leader out after 645 ms), no failed request, every balancer
/// pooling both peers' readings.
#[test]
fn a_slow_backend_leaves_every_balancers_ring_together() {
    testbed::require_root();
    let _alone = TIMED
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut s = ScaleOut::build("sos", 3, 4).expect("build");
    s.start_with(
        Path::new(HUDDLE),
        Path::new(BACKEND),
        true,
        &["--delay-ms", "10"],
    )
    .expect("start");
    let load = OpenLoop::start(&s.client, scale_vip(), 200.0, Duration::from_secs(5));
    thread::sleep(Duration::from_secs(3));
    let slow = format!("{}", testbed::scaleout::scale_backend_ip(2));
    let holds = |i: usize| {
        s.status(i)
            .map(|st| st.services[0].ring.iter().any(|b| b.starts_with(&slow)))
            .unwrap_or(true)
    };
    // The leader may rest a backend as hot in its first seconds (a
    // start-up artefact of the temperature under the first connects, seen
    // here in two debug-build CI runs of 1 December) and takes it back
    // once it has rested (10 s); then no hot eviction for the rotation's
    // cooldown (5 s). The test times a leave, so it waits for both.
    let all_hold = Instant::now();
    let rested = !(0..3).all(holds);
    while !(0..3).all(holds) && all_hold.elapsed() < Duration::from_secs(15) {
        thread::sleep(Duration::from_millis(100));
    }
    assert!((0..3).all(holds), "every ring holds the backend before");
    if rested {
        println!(
            "a ring had rested the backend at start-up; back after {:?}",
            all_hold.elapsed()
        );
        thread::sleep(Duration::from_millis(5_500));
    }
    let t0 = Instant::now();
    s.backend_admin(2, "delay_ms=50").unwrap();
    let mut out: [Option<Duration>; 3] = [None; 3];
    while t0.elapsed() < Duration::from_secs(5) && out.iter().any(Option::is_none) {
        for (i, o) in out.iter_mut().enumerate() {
            if o.is_none() && !holds(i) {
                *o = Some(t0.elapsed());
            }
        }
        thread::sleep(Duration::from_millis(10));
    }
    thread::sleep(Duration::from_secs(1));
    let outcomes = load.stop();
    let (_, failed) = tally(&outcomes, Duration::ZERO, Duration::MAX);
    println!(
        "5x slow backend out of the rings of balancers 0, 1, 2 after {out:?}; {} of {} requests failed",
        failed.len(),
        outcomes.len()
    );
    let times: Vec<Duration> = out
        .iter()
        .map(|o| o.expect("a ring kept the slow backend"))
        .collect();
    let (first, last) = (times.iter().min().unwrap(), times.iter().max().unwrap());
    println!("the rings disagreed for {:?}", *last - *first);
    for i in 0..3 {
        let notes = s.status(i).map(|st| st.notes).unwrap_or_default();
        let readings: Vec<&String> = notes
            .iter()
            .filter(|n| n.starts_with("readings:"))
            .collect();
        println!("balancer {i}: {readings:?}");
        if let Ok(st) = s.status(i) {
            for e in &st.services[0].recent {
                println!(
                    "  at {:.2} s: {} to {:?} ({}, {:.2})",
                    e.at_s, e.backend, e.to, e.reason, e.temperature
                );
            }
        }
        assert!(
            readings.iter().any(|n| n.matches(":9477").count() == 2),
            "balancer {i} did not pool both peers' readings: {notes:?}"
        );
    }
    assert!(*last <= Duration::from_secs(1), "{times:?}");
    assert!(*last - *first <= Duration::from_millis(500), "{times:?}");
    assert!(failed.is_empty(), "{failed:?}");
}
