//! Slowloris beside ordinary traffic: clients hold request heads open on
//! every backend (5, then 50 a backend), each sending a header line a
//! second and never the blank line, while 4 ordinary requests a second
//! go through. The kernel then sees backends owing answers nobody will
//! give; the huddle asks each backend before calling it hung, so no
//! backend leaves, no ordinary request fails, and the suspicions are
//! cleared by the backends' own answers (issue 51).
//!
//! 10 s a phase; `HC_SLOWLORIS_SECS` sets another length (the issue's
//! run: 60).

use std::{path::Path, thread, time::Duration};
use testbed::{require_root, slowloris::Slowloris, tally, OpenLoop, Testbed, VIP};

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
    for per_backend in [5, 50] {
        phase(per_backend);
    }
}

fn phase(per_backend: usize) {
    let mut bed = Testbed::new(&format!("lor{per_backend}"), N).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    // The service as the README's first command gives it, defaults
    // throughout (an HTTP probe).
    bed.start_huddle_service(Path::new(HUDDLE), &[])
        .expect("start huddle");
    let vip = (VIP, 80).into();
    let lor = Slowloris::start(&bed.client, vip, per_backend * N, Duration::from_secs(1));
    let load = OpenLoop::start(&bed.client, vip, 4.0, Duration::from_secs(5));
    let run = Duration::from_secs(secs());
    thread::sleep(run);
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
    let log = bed.huddle_log();
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
