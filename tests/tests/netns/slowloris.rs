//! Slowloris beside ordinary traffic: clients hold request heads open on
//! every backend (5, then 50 a backend), each sending a header line a
//! second and never the blank line, while 4 ordinary requests a second
//! go through. The kernel then sees backends owing answers nobody will
//! give; the huddle asks each backend before calling it hung, so no
//! backend leaves, no ordinary request fails, and the suspicions are
//! cleared by the backends' own answers (issue 51).
//!
//! The second phase runs with `[bgp]` on, the VIP announced to a router
//! (bird on both sides): it stays announced throughout (a service with
//! no healthy backend is withdrawn, so twenty slow clients could have
//! taken a VIP off the internet).
//!
//! 10 s a phase; `HC_SLOWLORIS_SECS` sets another length (the issue's
//! run: 60).

use std::{path::Path, thread, time::Duration};
use testbed::{
    backend_ip, require_root, slowloris::Slowloris, tally, uplink::Uplink, wait_until, OpenLoop,
    Testbed, HTTP_PORT, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const N: usize = 4;

fn secs() -> u64 {
    std::env::var("HC_SLOWLORIS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

#[test]
fn slowloris_clients_move_no_backend_and_fail_no_request() {
    require_root();
    phase(5, false);
    phase(50, true);
}

fn phase(per_backend: usize, bgp: bool) {
    let mut bed = Testbed::new(&format!("lor{per_backend}"), N).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    let up = if bgp {
        // The same service from a file, with `[bgp]`.
        let up = Uplink::start(&bed).expect("bird");
        let backends: Vec<String> = (0..N)
            .map(|i| format!("\"{}:{HTTP_PORT}\"", backend_ip(i)))
            .collect();
        let config = bed.dir.join("huddle.toml");
        let text = format!(
            "{}\n[[service]]\nvip = \"{VIP}:80\"\nbackends = [{}]\n",
            up.bgp_table(),
            backends.join(", ")
        );
        std::fs::write(&config, text).expect("config");
        bed.start_huddle(
            Path::new(HUDDLE),
            &["--config", &config.display().to_string()],
        )
        .expect("start huddle");
        wait_until(Duration::from_secs(15), || up.router_has_vip())
            .unwrap_or_else(|_| panic!("the router never got the VIP\n{}", bed.huddle_log()));
        Some(up)
    } else {
        // The service as the README's first command gives it, defaults
        // throughout (an HTTP probe).
        bed.start_huddle_service(Path::new(HUDDLE), &[])
            .expect("start huddle");
        None
    };
    let vip = (VIP, 80).into();
    let lor = Slowloris::start(&bed.client, vip, per_backend * N, Duration::from_secs(1));
    let load = OpenLoop::start(&bed.client, vip, 4.0, Duration::from_secs(5));
    let run = Duration::from_secs(secs());
    // The router is asked every half second whether it still has the VIP.
    let (mut looks, mut missing) = (0, 0);
    let t = std::time::Instant::now();
    while t.elapsed() < run {
        thread::sleep(Duration::from_millis(500));
        if let Some(up) = &up {
            looks += 1;
            missing += usize::from(!up.router_has_vip());
        }
    }
    let outcomes = load.stop();
    let opened = lor.opened.load(std::sync::atomic::Ordering::Relaxed);
    let st = bed.status().expect("status");
    let page = bed.metrics_page().expect("metrics page");
    lor.stop();
    let (by, failed) = tally(&outcomes, Duration::ZERO, run);
    let moves = &st.services[0].recent;
    let c = &st.control;
    println!(
        "{per_backend} slowloris connections a backend ({opened} opened), {} ordinary requests in {} s: \
         answered by {by:?}, {} failed; {} moves; suspected hangs {} cleared, {} confirmed",
        outcomes.len(),
        run.as_secs(),
        failed.len(),
        moves.len(),
        c.hangs_cleared,
        c.hangs_confirmed
    );
    if bgp {
        println!(
            "[bgp]: the router had the VIP at {} of {looks} looks",
            looks - missing
        );
    }
    let log = bed.huddle_log();
    assert_eq!(
        missing, 0,
        "the VIP was withdrawn at {missing} of {looks} looks\n{log}"
    );
    assert!(failed.is_empty(), "ordinary requests failed: {failed:?}");
    assert!(moves.is_empty(), "backends moved: {moves:?}\n{log}");
    assert_eq!(c.hangs_confirmed, 0, "{log}");
    assert!(
        c.hangs_cleared >= 1,
        "the slowloris clients raised no suspicion: this test tests nothing\n{log}"
    );
    let counted = page
        .lines()
        .find_map(|l| l.strip_prefix("huddle_hang_suspicions_cleared_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(counted, Some(c.hangs_cleared as f64), "{page}");
}
