//! No client sees a dead backend: four HTTP backends behind the balancer
//! with rotation off (plain round robin, so the faulty backend stays in the
//! ring for the whole run and every fourth new connection meets it), an
//! open-loop client opening 200 connections a second. A backend that
//! refuses connections (its server killed) and one whose firewall drops
//! SYNs must cost no request: the kernel retries the first at once and the
//! second on the client's own retransmission, and new flows avoid a
//! backend that owes SYN-ACKs.

use std::{
    path::Path,
    sync::{Mutex, MutexGuard},
    thread,
    time::Duration,
};
use testbed::{require_root, tally, OpenLoop, Testbed, HTTP_PORT, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
/// New connections per second.
const RATE: f64 = 200.0;
const LOAD: Duration = Duration::from_secs(4);

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Four backends, backend `faulty` broken by `brake`, then the balancer
/// with rotation off; returns the testbed, the outcomes and the status
/// text after the load.
fn run(tag: &str, faulty: usize, brake: impl FnOnce(&Testbed)) -> (Testbed, usize, Vec<String>) {
    require_root();
    let _turn = serial();
    let mut bed = Testbed::new(tag, 4).expect("build testbed");
    bed.start_backends_with(Path::new(BACKEND), &["--delay-ms", "10"])
        .expect("start backends");
    brake(&bed);
    bed.start_huddle_service(Path::new(HUDDLE), &["--no-rotation"])
        .expect("start huddle");
    // The client's timeout is above its SYN retransmission time (1 s).
    let load = OpenLoop::start(&bed.client, (VIP, 80).into(), RATE, Duration::from_secs(3));
    thread::sleep(LOAD);
    let outcomes = load.stop();
    let (by_backend, failed) = tally(&outcomes, Duration::ZERO, Duration::MAX);
    let st = bed.status().expect("status");
    println!("{}", st.render());
    println!(
        "{} requests, {} failed; answered by {by_backend:?}",
        outcomes.len(),
        failed.len()
    );
    let faulty_addr = format!("{}:{HTTP_PORT}", testbed::backend_ip(faulty));
    assert!(
        !by_backend.keys().any(|b| b.contains(&faulty_addr)),
        "the broken backend answered: {by_backend:?}"
    );
    let n = outcomes.len();
    (bed, n, failed)
}

fn counter(bed: &Testbed, i: usize, name: &str) -> u64 {
    let st = bed.status().expect("status");
    st.services[0].backends[i]
        .counters
        .get(name)
        .copied()
        .unwrap_or(0)
}

#[test]
fn connections_a_killed_backend_refuses_are_retried_on_another_without_a_failure() {
    let (bed, n, failed) = run("rkill", 1, |bed| bed.signal_backend(1, libc::SIGKILL));
    assert!(n as f64 >= RATE * LOAD.as_secs_f64() * 0.9, "{n} requests");
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());
    let refused = counter(&bed, 1, "refused");
    let retried = counter(&bed, 1, "retried_refused");
    println!("backend 1: {refused} SYNs refused, {retried} retried on another backend");
    // About a quarter of the connections met it (fewer once it is passed
    // over: a refusal leaves no SYN owed, so it rarely is).
    assert!(retried >= n as u64 / 8, "only {retried} retries of {n}");
    assert_eq!(retried, refused, "every refusal is retried");
    assert!(bed.status().unwrap().render().contains("refused and"));
}

#[test]
fn syns_a_firewall_drops_go_to_another_backend_and_new_flows_pass_it_over() {
    let (bed, n, failed) = run("rdrop", 2, |bed| {
        let rule = format!("add rule inet f in tcp dport {HTTP_PORT} tcp flags syn drop");
        for cmd in [
            "add table inet f",
            "add chain inet f in { type filter hook input priority 0; }",
            rule.as_str(),
        ] {
            let args: Vec<&str> = cmd.split(' ').collect();
            bed.backends[2].exec("nft", &args).expect("nft rule");
        }
    });
    assert!(n as f64 >= RATE * LOAD.as_secs_f64() * 0.9, "{n} requests");
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());
    let silent = counter(&bed, 2, "retried_silent");
    let passed = counter(&bed, 2, "skipped_owing");
    let syns = counter(&bed, 2, "syns");
    println!(
        "backend 2: {syns} SYNs sent to it, {silent} of them retried on another backend; passed over by {passed} new flows past the limit"
    );
    assert!(silent >= 1, "no SYN was retried");
    // Once it owes a SYN-ACK, new flows prefer the other choice, and past
    // the limit never take it: far fewer than a quarter of them went there.
    assert!(syns <= n as u64 / 16, "{syns} of {n} SYNs sent to it");
}
