//! Ring swaps and backend churn under load: 2,000 keep-alive connections
//! stay up while the ring is swapped over 100 times a second for 10 s and
//! backends are removed and added by reloads, with new connections arriving
//! all along. No connection may be reset or stall, and no new flow may get
//! a backend outside the ring it was read from (the kernel counts that).

use huddle_user::status::control::Request;
use std::{
    net::SocketAddr,
    path::Path,
    sync::atomic::Ordering,
    thread,
    time::{Duration, Instant},
};
use testbed::{
    backend_ip, raise_nofile, require_root, HeldConnections, OpenLoop, Testbed, HTTP_PORT, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const N: usize = 4;
const CONNS: usize = 2000;
const THREADS: usize = 20;
const CHURN: Duration = Duration::from_secs(10);

fn config(ids: &[usize]) -> String {
    let list: Vec<String> = ids
        .iter()
        .map(|i| format!("\"{}:{HTTP_PORT}\"", backend_ip(*i)))
        .collect();
    format!(
        "[huddle]\nmin_inner = 1\n\n[[service]]\nvip = \"{VIP}:80\"\nbackends = [{}]\n",
        list.join(", ")
    )
}

#[test]
fn swaps_and_churn_under_2000_connections_break_nothing() {
    require_root();
    raise_nofile();
    let mut bed = Testbed::new("churn", N).expect("testbed");
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    let file = bed.dir.join("huddle.toml");
    std::fs::write(&file, config(&[0, 1, 2, 3])).unwrap();
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &file.display().to_string()],
    )
    .expect("huddle");
    let vip: SocketAddr = (VIP, 80).into();

    // 2,000 keep-alive connections in 20 threads, each asking about once a
    // second; a reset or a 5 s silence is a failure.
    let held = HeldConnections::start(
        &bed.client,
        vip,
        THREADS,
        CONNS / THREADS,
        Duration::from_secs(1),
    );
    held.wait_opened(CONNS as u64, Duration::from_secs(60))
        .expect("connections not up");
    let live_at_start = {
        let st = bed.status().unwrap();
        st.services[0]
            .backends
            .iter()
            .map(|b| b.active_flows)
            .sum::<u64>()
    };
    let gen_before = bed.status().unwrap().services[0].ring_generation;
    let new_conns = OpenLoop::start(&bed.client, vip, 100.0, Duration::from_secs(5));

    // Churn: drain/undrain every 8 ms, and a reload every 2 s that
    // removes or adds a backend.
    let started = Instant::now();
    let mut k = 0usize;
    let mut reloads = 0;
    let layouts: [&[usize]; 4] = [&[0, 1, 2], &[0, 1, 2, 3], &[1, 2, 3], &[0, 1, 2, 3]];
    let mut current: &[usize] = &[0, 1, 2, 3];
    let mut next_reload = Duration::from_secs(2);
    while started.elapsed() < CHURN {
        if started.elapsed() >= next_reload {
            current = layouts[reloads % layouts.len()];
            std::fs::write(&file, config(current)).unwrap();
            let r = bed.control(Request::Reload).expect("reload");
            assert!(r.ok, "reload: {:?}", r.error);
            reloads += 1;
            next_reload += Duration::from_secs(2);
        }
        let b = current[(k / 2) % current.len()];
        let backend = format!("{}:{HTTP_PORT}", backend_ip(b));
        let req = if k.is_multiple_of(2) {
            Request::Drain { backend, vip: None }
        } else {
            Request::Undrain { backend, vip: None }
        };
        let _ = bed.control(req);
        k += 1;
        // Paced by schedule (not by sleeps, which drift): 125 a second.
        let due = started + Duration::from_millis(8) * k as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }
    let churn_time = started.elapsed();
    let st = bed.status().unwrap();
    let swaps = st.services[0].ring_generation - gen_before;
    let retries = st.global.get("ring_retry").copied().unwrap_or(0);
    thread::sleep(Duration::from_millis(1500));
    let asked = held.asked.clone();
    let errors = held.stop();
    let outcomes = new_conns.stop();
    let failed_new: Vec<&String> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err())
        .collect();
    println!(
        "{CONNS} keep-alive connections ({live_at_start} active flows counted) made {} requests; \
         {swaps} ring swaps in {:.1} s ({:.0}/s) with {reloads} reloads; \
         {} new connections during the churn, {} failed; connection errors {}; ring_retry {retries}",
        asked.load(Ordering::Relaxed),
        churn_time.as_secs_f64(),
        swaps as f64 / churn_time.as_secs_f64(),
        outcomes.len(),
        failed_new.len(),
        errors.len()
    );
    if !errors.is_empty() {
        // What the data plane counted, for whoever finds why.
        let st = bed.status().unwrap();
        println!("service counters: {:?}", st.services[0].counters);
        println!("global counters: {:?}", st.global);
        println!("events: {:?}", st.services[0].recent);
    }
    assert!(
        errors.is_empty(),
        "connections reset or stalled: {:?}",
        &errors[..errors.len().min(10)]
    );
    assert!(
        failed_new.is_empty(),
        "new connections failed: {:?}",
        &failed_new[..failed_new.len().min(10)]
    );
    assert!(
        swaps as f64 >= 100.0 * CHURN.as_secs_f64(),
        "only {swaps} swaps"
    );
}
