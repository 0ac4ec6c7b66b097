//! The huddle with real traffic: four HTTP backends whose service time,
//! liveness and reported CPU change while an open-loop client opens about
//! 200 connections per second through the XDP path. Each test states the
//! bound it holds the balancer to and prints what it measured.
//!
//! The tests take turns (one lock): they time reactions in milliseconds
//! and must not compete for the machine's two cores.

use huddle_user::status::{BackendStatus, Status};
use std::{
    path::Path,
    sync::{Mutex, MutexGuard},
    thread,
    time::{Duration, Instant},
};
use testbed::{backend_ip, require_root, tally, OpenLoop, Testbed, HTTP_PORT, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const N: usize = 4;
/// New connections per second.
const RATE: f64 = 200.0;
/// Normal service time of a backend, and 5x that.
const BASE_MS: u32 = 10;
/// The acceptance bound: out of the inner ring this soon after the fault.
const BOUND: Duration = Duration::from_millis(500);
const AGENT_PORT: u16 = 9100;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn addr(i: usize) -> String {
    format!("{}:{HTTP_PORT}", backend_ip(i))
}

/// A testbed with four backends and the balancer, rotation on with default
/// settings except shorter rests (so a test sees a return), plus
/// `extra_huddle` lines in `[huddle]` and `backend_extra` in each backend
/// table.
fn bed(tag: &str, extra_huddle: &str, metrics: bool) -> Testbed {
    bed_in(tag, extra_huddle, metrics, "snat")
}

/// The VIP's address for a service in `mode`: DSR cannot change the port,
/// so its VIP listens on the backends' port.
fn vip(mode: &str) -> std::net::SocketAddr {
    if mode == "snat" {
        (VIP, 80).into()
    } else {
        (VIP, HTTP_PORT).into()
    }
}

/// As `bed`, with the service in `mode`. DSR backends are set up for it
/// (the VIP on their loopback, the agent's decap for dsr-ipip); with
/// `metrics` in DSR, every backend runs the agent with its request timing
/// and the balancer scrapes it.
fn bed_in(tag: &str, extra_huddle: &str, metrics: bool, mode: &str) -> Testbed {
    require_root();
    let mut bed = Testbed::new(tag, N).expect("build testbed");
    bed.start_backends_with(Path::new(BACKEND), &["--delay-ms", &BASE_MS.to_string()])
        .expect("start backends");
    let dsr = mode != "snat";
    if dsr {
        bed.dsr_backends(Path::new(HUDDLE), mode == "dsr-ipip" || metrics)
            .expect("DSR set-up");
    }
    let backends: Vec<String> = (0..N)
        .map(|i| {
            if metrics {
                // The last backend's host metrics come from `huddle agent`
                // (in DSR, every backend's).
                let url = if i == N - 1 || dsr {
                    format!("{}:{AGENT_PORT}", backend_ip(i))
                } else {
                    addr(i)
                };
                format!(
                    "{{ addr = \"{}\", metrics = \"http://{url}/metrics\" }}",
                    addr(i)
                )
            } else {
                format!("\"{}\"", addr(i))
            }
        })
        .collect();
    let text = format!(
        "[huddle]\nmin_rest_ms = 2000\ncooldown_ms = 1000\n{extra_huddle}\n\n[[service]]\nvip = \"{}\"\nmode = \"{mode}\"\nbackends = [{}]\n",
        vip(mode),
        backends.join(", ")
    );
    let config = bed.dir.join("huddle.toml");
    std::fs::write(&config, text).unwrap();
    let config = config.display().to_string();
    bed.start_huddle(Path::new(HUDDLE), &["--config", &config])
        .expect("start huddle");
    bed
}

fn backend(st: &Status, i: usize) -> &BackendStatus {
    let a = addr(i);
    st.services[0]
        .backends
        .iter()
        .find(|b| b.addr == a)
        .expect("backend in status")
}

/// `histogram_quantile(q, ...)` over cumulative (upper bound, count)
/// pairs sorted by bound, the last +Inf: linear inside the bucket.
fn quantile(q: f64, buckets: &[(f64, f64)]) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, n) in buckets {
        if n >= rank {
            if le.is_infinite() {
                return lower.0;
            }
            return lower.0 + (le - lower.0) * (rank - lower.1) / (n - lower.1).max(1e-9);
        }
        lower = (le, n);
    }
    f64::NAN
}

fn metric(page: &str, name: &str, i: usize) -> Option<f64> {
    let key = format!(
        "{name}{{service=\"{VIP}:80/tcp\",backend=\"{}\"}} ",
        addr(i)
    );
    page.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn a_backend_made_5x_slower_rests_within_the_bound_and_returns_when_fast() {
    let _turn = serial();
    let bed = bed("hslow", "", false);
    let load = OpenLoop::start(&bed.client, (VIP, 80).into(), RATE, Duration::from_secs(3));
    thread::sleep(Duration::from_secs(2));
    let st = bed.status().unwrap();
    assert_eq!(
        st.services[0].ring.len(),
        N,
        "all inner before the fault:\n{}",
        st.render()
    );

    let slow_at = load.start.elapsed();
    let t0 = Instant::now();
    bed.backend_admin(2, &format!("delay_ms={}", BASE_MS * 5))
        .unwrap();
    let out = bed
        .wait_place(&addr(2), "outer", t0, Duration::from_secs(5))
        .expect("rotation");
    let st = bed.status().unwrap();
    println!(
        "5x slow backend b2 left the inner ring {} ms after it became slow",
        out.as_millis()
    );
    print!("{}", st.render());
    assert!(
        !st.services[0].ring.contains(&addr(2)),
        "kernel ring still has b2"
    );
    let b2 = backend(&st, 2);
    assert!(b2.temperature >= 0.55, "evicted hot: {b2:?}");

    // Status and /metrics show it live.
    // The balancer's Prometheus page, fetched inside its namespace.
    let page = bed.metrics_page().expect("metrics page");
    assert_eq!(
        metric(&page, "huddle_backend_inner", 2),
        Some(0.0),
        "{page}"
    );
    assert_eq!(metric(&page, "huddle_backend_inner", 0), Some(1.0));
    assert!(metric(&page, "huddle_backend_temperature", 2).unwrap() >= 0.5);
    assert!(page.contains("huddle_backend_flows_new_total{"));
    assert!(
        page.contains("huddle_service_ttfb_seconds_count{"),
        "{page}"
    );
    assert!(page.contains("huddle_tick_seconds{"), "{page}");
    assert!(
        page.trim_end().ends_with("# EOF"),
        "OpenMetrics ends with EOF"
    );
    // Time to first byte as a real histogram: its +Inf bucket holds every
    // sample, as many as its count.
    let b0 = format!("backend=\"{}\"", addr(0));
    let value = |prefix: &str, also: &str| {
        page.lines()
            .find(|l| l.starts_with(prefix) && l.contains(&b0) && l.contains(also))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
    };
    let inf = value("huddle_backend_ttfb_seconds_bucket{", "le=\"+Inf\"")
        .unwrap_or_else(|| panic!("no +Inf bucket:\n{page}"));
    let count = value("huddle_backend_ttfb_seconds_count{", "")
        .unwrap_or_else(|| panic!("no count:\n{page}"));
    assert!(count > 0 && inf == count, "+Inf {inf}, count {count}");
    let inf = value("huddle_backend_connect_seconds_bucket{", "le=\"+Inf\"")
        .unwrap_or_else(|| panic!("no connect +Inf bucket:\n{page}"));
    let count = value("huddle_backend_connect_seconds_count{", "")
        .unwrap_or_else(|| panic!("no connect count:\n{page}"));
    assert!(
        count > 0 && inf == count,
        "connect: +Inf {inf}, count {count}"
    );
    // A kept parser (prometheus-parse) reads the page, histograms
    // included; summing two histograms' buckets by bound (as PromQL's
    // `sum by (le)` does across balancers; here two backends of one, with
    // the same bounds) and taking the median as `histogram_quantile` does
    // gives the backends' 10 ms service time.
    let scrape = prometheus_parse::Scrape::parse(page.lines().map(|l| Ok(l.to_string())))
        .expect("the page parses");
    let mut summed: std::collections::BTreeMap<u64, f64> = std::collections::BTreeMap::new();
    for i in [0, 1] {
        let a = addr(i);
        let h = scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == "huddle_backend_ttfb_seconds"
                    && s.labels.get("backend") == Some(a.as_str())
            })
            .unwrap_or_else(|| panic!("no parsed histogram for {a}"));
        let prometheus_parse::Value::Histogram(buckets) = &h.value else {
            panic!("{a}: not parsed as a histogram: {:?}", h.value);
        };
        for b in buckets {
            *summed.entry(b.less_than.to_bits()).or_default() += b.count;
        }
    }
    let cumulative: Vec<(f64, f64)> = summed
        .iter()
        .map(|(le, n)| (f64::from_bits(*le), *n))
        .collect();
    let p50 = quantile(0.5, &cumulative);
    println!("p50 of two histograms summed: {:.2} ms", p50 * 1e3);
    assert!((0.005..0.02).contains(&p50), "p50 {p50} s");
    // Every metric the Grafana dashboard queries is on the page.
    let dashboard = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../dashboards/huddle.json"),
    )
    .expect("dashboards/huddle.json");
    let mut queried: Vec<&str> = dashboard
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("huddle_"))
        .collect();
    queried.sort_unstable();
    queried.dedup();
    assert!(queried.len() >= 8, "{queried:?}");
    for m in queried {
        assert!(
            page.lines().any(|l| l.starts_with(&format!("{m}{{"))),
            "the dashboard queries {m}, which /metrics does not have"
        );
    }

    thread::sleep(Duration::from_secs(1));
    let evicted_at = slow_at + out;
    let fast_at = load.start.elapsed();
    let t1 = Instant::now();
    bed.backend_admin(2, &format!("delay_ms={BASE_MS}"))
        .unwrap();
    let back = bed
        .wait_place(&addr(2), "inner", t1, Duration::from_secs(15))
        .expect("rotation");
    println!(
        "b2 back in the inner ring {} ms after it was made fast again (min rest 2 s)",
        back.as_millis()
    );
    thread::sleep(Duration::from_millis(500));
    let outcomes = load.stop();

    let (before, f0) = tally(&outcomes, Duration::ZERO, slow_at);
    let (resting, f1) = tally(&outcomes, evicted_at + Duration::from_millis(50), fast_at);
    let (all, failed) = tally(&outcomes, Duration::ZERO, Duration::MAX);
    println!(
        "before: {before:?}\nwhile b2 rested: {resting:?}\nall {} requests: {all:?}, failed {}",
        outcomes.len(),
        failed.len()
    );
    assert!(
        failed.is_empty() && f0.is_empty() && f1.is_empty(),
        "failed requests: {failed:?}"
    );
    assert_eq!(
        resting.get("b2"),
        None,
        "new connections went to the resting backend"
    );
    assert!(
        resting.len() == 3,
        "the other three keep serving: {resting:?}"
    );
    assert!(
        out <= BOUND,
        "5x slow backend took {out:?} to leave (bound {BOUND:?})"
    );
}

/// What a fault run measured.
struct Fault {
    /// From the fault until the backend was seen outside the inner ring.
    out: Duration,
    /// The balancer's status a second after that.
    st: Status,
    requests: usize,
    failed: Vec<String>,
    by_backend: std::collections::BTreeMap<String, u32>,
}

/// Load at `RATE`, then signal backend `i` with `sig` and wait until it
/// leaves the inner ring; `then`, if given, is sent before the load stops
/// (SIGCONT for a stopped backend).
fn fault(tag: &str, i: usize, sig: i32, then: Option<i32>) -> Fault {
    fault_in(tag, i, sig, then, "snat", false)
}

fn fault_in(tag: &str, i: usize, sig: i32, then: Option<i32>, mode: &str, agent: bool) -> Fault {
    let _turn = serial();
    let bed = bed_in(tag, "", agent, mode);
    let load = OpenLoop::start(&bed.client, vip(mode), RATE, Duration::from_secs(2));
    thread::sleep(Duration::from_secs(2));
    let t0 = Instant::now();
    bed.signal_backend(i, sig);
    let out = bed
        .wait_place(&addr(i), "outer", t0, Duration::from_secs(5))
        .expect("rotation");
    thread::sleep(Duration::from_secs(1));
    let st = bed.status().unwrap();
    if let Some(s) = then {
        bed.signal_backend(i, s);
    }
    let outcomes = load.stop();
    let (by_backend, failed) = tally(&outcomes, Duration::ZERO, Duration::MAX);
    print!("{}", st.render());
    Fault {
        out,
        st,
        requests: outcomes.len(),
        failed,
        by_backend,
    }
}

#[test]
fn a_killed_backend_leaves_within_the_bound() {
    let f = fault("hkill", 1, libc::SIGKILL, None);
    println!(
        "killed backend b1 left the inner ring {} ms after SIGKILL; {} of {} requests failed (refused before it left): {:?}",
        f.out.as_millis(),
        f.failed.len(),
        f.requests,
        f.by_backend
    );
    let b1 = backend(&f.st, 1);
    assert!(
        b1.unhealthy.is_some(),
        "a refusing backend is unhealthy: {b1:?}"
    );
    let out = f.out;
    assert!(
        out <= BOUND,
        "killed backend took {out:?} to leave (bound {BOUND:?})"
    );
    // Only the window before it left may fail: about RATE/4 per second.
    assert!(f.failed.len() <= 40, "too many failures: {:?}", f.failed);
}

#[test]
fn a_hung_backend_leaves_within_the_bound() {
    hung_leaves("hhung", "snat", false);
}

/// Backend b3 stops (SIGSTOP: its kernel still completes handshakes,
/// nothing answers) under load; it must leave within the bound.
fn hung_leaves(tag: &str, mode: &str, agent: bool) {
    let f = fault_in(tag, 3, libc::SIGSTOP, Some(libc::SIGCONT), mode, agent);
    println!(
        "{mode}: hung backend b3 (SIGSTOP) left the inner ring {} ms after it stopped; {} of {} requests failed (stuck on it before it left): {:?}",
        f.out.as_millis(),
        f.failed.len(),
        f.requests,
        f.by_backend
    );
    let b3 = backend(&f.st, 3);
    assert!(
        b3.unhealthy
            .as_deref()
            .is_some_and(|u| u.contains("hung") || u.contains("probe")),
        "{b3:?}"
    );
    let out = f.out;
    assert!(
        out <= BOUND,
        "hung backend took {out:?} to leave (bound {BOUND:?})"
    );
    assert!(f.failed.len() <= 40, "too many failures: {:?}", f.failed);
}

/// DSR: the balancer never sees a reply; the client's ACKs alone must
/// show the slow backend (no agent: the backends run only the decap).
#[test]
fn dsr_a_backend_made_5x_slower_rests_within_the_bound_by_the_ack_clock() {
    dsr_slow("hdslow", false);
}

/// The same with every backend's agent timing requests exactly: its
/// figure calibrates the ACK clock, which still decides every tick.
#[test]
fn dsr_a_backend_made_5x_slower_rests_within_the_bound_with_the_agent() {
    dsr_slow("hdslowa", true);
}

fn dsr_slow(tag: &str, agent: bool) {
    let _turn = serial();
    let mode = "dsr-ipip";
    let bed = bed_in(tag, "", agent, mode);
    let load = OpenLoop::start(&bed.client, vip(mode), RATE, Duration::from_secs(3));
    thread::sleep(Duration::from_secs(3));
    let st = bed.status().unwrap();
    assert_eq!(st.services[0].ring.len(), N, "{}", st.render());
    let b0 = backend(&st, 0).clone();
    let want = if agent {
        "ack-clock, agent-calibrated"
    } else {
        "ack-clock"
    };
    assert_eq!(b0.latency_source, want, "{b0:?}");
    let fast = b0.p50_ms.expect("ACK-clock samples");
    println!(
        "{mode}, agent {agent}: b0 before the fault: ACK clock raw mean {:?} ms, agent's exact mean {:?} ms, taken off {:?} ms, p50 {fast:.2} ms",
        b0.ack_clock_ms, b0.agent_ttfb_ms, b0.rtt_ms
    );
    if agent {
        let exact = b0.agent_ttfb_ms.expect("the agent's figure");
        assert!((9.0..13.0).contains(&exact), "agent TTFB {exact} ms");
    }
    let t0 = Instant::now();
    bed.backend_admin(2, &format!("delay_ms={}", BASE_MS * 5))
        .unwrap();
    let out = bed
        .wait_place(&addr(2), "outer", t0, Duration::from_secs(5))
        .expect("rotation");
    let st = bed.status().unwrap();
    print!("{}", st.render());
    let b2 = backend(&st, 2);
    println!(
        "{mode}, agent {agent}: 5x slow backend b2 left the inner ring {} ms after it became slow: b2's p50 {:?} ms",
        out.as_millis(),
        b2.p50_ms,
    );
    let outcomes = load.stop();
    let (all, failed) = tally(&outcomes, Duration::ZERO, Duration::MAX);
    println!(
        "all {} requests: {all:?}, failed {}",
        outcomes.len(),
        failed.len()
    );
    // Service time 10 ms: the ACK clock, corrected, near it.
    assert!((8.0..16.0).contains(&fast), "p50 {fast} ms");
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(
        out <= BOUND,
        "5x slow backend took {out:?} to leave (bound {BOUND:?})"
    );
}

#[test]
fn dsr_a_hung_backend_leaves_within_the_bound() {
    hung_leaves("hdhung", "dsr-l2", false);
}

#[test]
fn dsr_a_hung_backend_leaves_within_the_bound_with_the_agent() {
    hung_leaves("hdhunga", "dsr-ipip", true);
}

#[test]
fn a_backend_reporting_high_cpu_warms_up() {
    let _turn = serial();
    let mut bed = bed("hcpu", "scrape_interval_ms = 200", true);
    let listen = format!("0.0.0.0:{AGENT_PORT}");
    let agent = testbed::spawn_in(
        &bed.backends[N - 1],
        Path::new(HUDDLE),
        &["agent", "--listen", &listen],
        None,
    )
    .expect("start huddle agent");
    bed.procs.push(agent);
    bed.backend_admin(0, "cpu=0.95").unwrap();
    let t0 = Instant::now();
    loop {
        let st = bed.status().unwrap();
        let hot = backend(&st, 0);
        let others = (1..N)
            .map(|i| backend(&st, i).temperature)
            .fold(0.0, f64::max);
        let by_agent = backend(&st, N - 1);
        if hot.cpu.is_some_and(|c| c > 0.9)
            && hot.temperature > others + 0.05
            && by_agent.cpu.is_some()
            && by_agent.memory.is_some()
        {
            println!(
                "b0 reports cpu {:.2}: temperature {:.3} (cpu term {:.2}) vs at most {others:.3} for the others, after {} ms",
                hot.cpu.unwrap(),
                hot.temperature,
                hot.components.cpu,
                t0.elapsed().as_millis()
            );
            assert!(
                backend(&st, 1).cpu.is_some_and(|c| c < 0.2),
                "{:?}",
                backend(&st, 1)
            );
            assert!(hot.host_note.is_none(), "{hot:?}");
            let (c, m) = (
                by_agent.cpu.unwrap_or(-1.0),
                by_agent.memory.unwrap_or(-1.0),
            );
            println!(
                "b{} via `huddle agent` (this host's /proc): cpu {c:.2}, memory {m:.2}",
                N - 1
            );
            assert!((0.0..=1.0).contains(&m) && m > 0.0);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "b0 never warmed up:\n{}",
            st.render()
        );
        thread::sleep(Duration::from_millis(100));
    }
}
