//! The data plane outlives its daemon: killed with SIGKILL ten times under
//! steady traffic and restarted each time, the balancer loses no request
//! and resets no connection; counters and the huddle's state carry on.

use std::{
    net::SocketAddr,
    path::Path,
    sync::atomic::Ordering,
    thread,
    time::{Duration, Instant},
};
use testbed::{
    backend_ip, require_root, xdp_attached, HeldConnections, OpenLoop, Testbed, HTTP_PORT, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const N: usize = 4;
const KILLS: usize = 10;
const KEEPALIVE: usize = 20;

fn total_flows(bed: &Testbed) -> u64 {
    let st = bed.status().expect("status");
    st.services[0]
        .backends
        .iter()
        .map(|b| b.counters["flows_new"])
        .sum()
}

fn place(bed: &Testbed, i: usize) -> String {
    let a = format!("{}:{HTTP_PORT}", backend_ip(i));
    let st = bed.status().expect("status");
    st.services[0]
        .backends
        .iter()
        .find(|b| b.addr == a)
        .expect("backend")
        .place
        .clone()
}

#[test]
fn sigkill_restarts_lose_no_request_and_reset_no_connection() {
    require_root();
    let mut bed = Testbed::new("restart", N).expect("testbed");
    bed.start_backends_with(Path::new(BACKEND), &["--delay-ms", "5"])
        .expect("backends");
    let config = bed.dir.join("huddle.toml");
    // Long rests, so the backend evicted below must still be resting
    // after every restart (its state comes from the state file).
    std::fs::write(&config, "[huddle]\nmin_rest_ms = 120000\n").unwrap();
    let backends: Vec<String> = (0..N)
        .map(|i| format!("{}:{HTTP_PORT}", backend_ip(i)))
        .collect();
    let mut args = vec![
        "--config".to_string(),
        config.display().to_string(),
        "--vip".into(),
        format!("{VIP}:80"),
    ];
    for b in &backends {
        args.push("--backend".into());
        args.push(b.clone());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    bed.start_huddle(Path::new(HUDDLE), &args).expect("huddle");

    let vip: SocketAddr = (VIP, 80).into();
    let load = OpenLoop::start(&bed.client, vip, 200.0, Duration::from_secs(3));
    // Long-lived keep-alive connections, each asking every 20 ms.
    let held = HeldConnections::start(&bed.client, vip, KEEPALIVE, 1, Duration::from_millis(20));
    thread::sleep(Duration::from_secs(1));

    // One backend slow and resting, so the state file has something to
    // carry: it must stay out across every restart.
    bed.backend_admin(2, "delay_ms=25").unwrap();
    let t = Instant::now();
    while place(&bed, 2) != "outer" {
        assert!(t.elapsed() < Duration::from_secs(5), "b2 never rested");
        thread::sleep(Duration::from_millis(20));
    }
    let evicted_at = load.start.elapsed();

    let mut flows = total_flows(&bed);
    let mut downtime = Duration::ZERO;
    for k in 0..KILLS {
        thread::sleep(Duration::from_millis(400));
        bed.kill_huddle(libc::SIGKILL);
        let killed = Instant::now();
        assert!(
            xdp_attached(&bed.lb),
            "kill {k}: XDP detached with the daemon"
        );
        // Traffic goes on with no daemon at all for a while.
        thread::sleep(Duration::from_millis(300));
        bed.restart_huddle()
            .unwrap_or_else(|e| panic!("restart {k}: {e:#}\n{}", bed.huddle_log()));
        downtime += killed.elapsed();
        let now = total_flows(&bed);
        assert!(
            now >= flows,
            "kill {k}: counters went back from {flows} to {now}"
        );
        flows = now;
        assert_eq!(
            place(&bed, 2),
            "outer",
            "kill {k}: the resting backend came back"
        );
        let st = bed.status().unwrap();
        assert_eq!(st.xdp_mode, "adopted", "kill {k}");
    }
    thread::sleep(Duration::from_millis(500));
    let asked = held.asked.clone();
    let reset = held.stop();
    let outcomes = load.stop();
    let failed: Vec<String> = outcomes
        .iter()
        .filter_map(|o| {
            o.result
                .as_ref()
                .err()
                .map(|e| format!("at {:?}: {e}", o.at))
        })
        .collect();
    let to_resting = outcomes
        .iter()
        .filter(|o| o.at > evicted_at + Duration::from_millis(100))
        .filter(|o| o.result.as_deref() == Ok("b2"))
        .count();
    println!(
        "{KILLS} SIGKILLs and restarts (daemon down {} ms in all): {} new-connection requests, {} failed; \
         {KEEPALIVE} keep-alive connections made {} requests, {} reset; flows counted {flows}; \
         new connections to the resting backend after it left: {to_resting}",
        downtime.as_millis(),
        outcomes.len(),
        failed.len(),
        asked.load(Ordering::Relaxed),
        reset.len()
    );
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(reset.is_empty(), "keep-alive connections broken: {reset:?}");
    assert_eq!(to_resting, 0, "a restart put the resting backend back");
    let log = bed.huddle_log();
    assert_eq!(
        log.matches("took over the running data plane").count(),
        KILLS,
        "{log}"
    );
}

/// As a user starts it: `ip netns exec` gives every run a fresh /sys, so
/// the pins must go to the host's bpffs or they die with the daemon. A
/// SIGKILL and a restart the same way, under keep-alive load, break no
/// connection.
#[test]
fn ip_netns_exec_restart_keeps_every_connection() {
    require_root();
    let mut bed = Testbed::plain("nsexec", 2).expect("testbed");
    bed.ip_netns_exec = true;
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    bed.start_huddle_service(Path::new(HUDDLE), &[])
        .expect("huddle");
    let vip: SocketAddr = (VIP, 80).into();
    let held = HeldConnections::start(&bed.client, vip, KEEPALIVE, 1, Duration::from_millis(20));
    held.wait_opened(KEEPALIVE as u64, Duration::from_secs(10))
        .expect("connections open");
    thread::sleep(Duration::from_millis(500));
    bed.kill_huddle(libc::SIGKILL);
    thread::sleep(Duration::from_millis(100));
    let attached = xdp_attached(&bed.lb);
    thread::sleep(Duration::from_millis(400));
    bed.restart_huddle()
        .unwrap_or_else(|e| panic!("restart: {e:#}\n{}", bed.huddle_log()));
    thread::sleep(Duration::from_millis(1000));
    let asked = held.asked.load(Ordering::Relaxed);
    let broken = held.stop();
    let st = bed.status().expect("status");
    println!(
        "ip netns exec, SIGKILL and restart: XDP attached while down {attached}; {KEEPALIVE} keep-alive connections made {asked} requests, {} broke; mode after restart {}",
        broken.len(),
        st.xdp_mode
    );
    assert!(
        attached,
        "the program left with the daemon\n{}",
        bed.huddle_log()
    );
    assert!(
        broken.is_empty(),
        "connections broke: {broken:?}\n{}",
        bed.huddle_log()
    );
    assert_eq!(st.xdp_mode, "adopted");
    let log = bed.huddle_log();
    assert!(log.contains("pinning into the host's bpffs"), "{log}");
    assert!(log.contains("took over the running data plane"), "{log}");
}

/// A restart with another half-open table size makes those tables afresh
/// (the program finds slots by masking a hash with the size) and new
/// connections keep coming in; established ones are untouched.
#[test]
fn a_restart_with_another_half_open_size_remakes_those_tables() {
    require_root();
    let mut bed = Testbed::new("hosize", 2).expect("testbed");
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    let config = bed.dir.join("huddle.toml");
    std::fs::write(&config, "half_open_table_size = 1024\n").unwrap();
    let config_arg = config.display().to_string();
    bed.start_huddle_service(Path::new(HUDDLE), &["--config", &config_arg])
        .expect("huddle");
    let vip: SocketAddr = (VIP, 80).into();
    let held = HeldConnections::start(&bed.client, vip, 4, 1, Duration::from_millis(20));
    held.wait_opened(4, Duration::from_secs(10))
        .expect("connections open");
    bed.kill_huddle(libc::SIGKILL);
    std::fs::write(&config, "half_open_table_size = 4096\n").unwrap();
    bed.restart_huddle()
        .unwrap_or_else(|e| panic!("restart: {e:#}\n{}", bed.huddle_log()));
    let failed = testbed::in_ns(&bed.client, move || {
        (0..100)
            .filter(|_| testbed::http_get(vip, Duration::from_secs(2)).is_err())
            .count()
    });
    let broken = held.stop();
    println!("half-open tables resized across a restart: {failed} of 100 new requests failed, {} of 4 held connections broke", broken.len());
    assert_eq!(failed, 0, "{}", bed.huddle_log());
    assert!(broken.is_empty(), "{broken:?}");
    assert!(bed
        .huddle_log()
        .contains("HALF_OPEN has another layout or size"));
}
