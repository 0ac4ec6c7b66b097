//! `hc-scale`: what the balancer's control plane costs as services and
//! backends grow. For each size N x M it starts `hc-huddle` with N
//! services of M backends each on a namespace testbed (four backend
//! servers, each answering on many addresses and ports), and prints: start time to
//! forwarding, daemon RSS, CPU idle and under 200 new connections a
//! second (half of them to the service that later gets the slow
//! backend), tick p50/p99, probes a second, the `/metrics` page's size and
//! fetch time, reload time for one changed backend and for every backend
//! changed (weights), and how long a 5x slow backend of one service takes
//! to leave its ring.
//!
//! `cargo xtask bench-scale [-- --sizes 1x4,16x16,64x16]` (as root).

use anyhow::{bail, Context, Result};
use clap::Parser;
use huddle_user::status::control::Request;
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};
use testbed::{backend_ip, http_get, http_get_path, in_ns, Testbed, VIP};

#[derive(Parser)]
struct Cli {
    /// Sizes to run, services x backends each.
    #[arg(long, default_value = "1x4,16x16,64x16")]
    sizes: String,
    /// Seconds of each idle and loaded measurement.
    #[arg(long, default_value_t = 10)]
    secs: u64,
    /// The daemon (default: `hc-huddle` beside this binary).
    #[arg(long)]
    huddle: Option<PathBuf>,
    /// Exit non-zero when a request failed, a VIP went unanswered or the
    /// slow backend never left its ring (the scale test).
    #[arg(long)]
    check: bool,
    /// A line for the config's `[huddle]` table, e.g. `probe = {
    /// max_per_second = 1000000, active_interval_ms = 250 }` (every backend
    /// every round, as before the budget).
    #[arg(long)]
    huddle_toml: Option<String>,
    /// Scrape `/metrics` in a loop, one after another, while the load
    /// and the slow backend are measured (issue 51: a scrape must cost
    /// the tick nothing).
    #[arg(long)]
    scrape: bool,
}

/// Backend servers; every backend address sits on one of them.
const SERVERS: usize = 4;

/// First service port on the VIP.
const BASE_PORT: u16 = 10_000;

/// The service time of every backend (a 5x slow one answers in 5x this).
const BASE_MS: u32 = 2;

/// Ports each address serves: backends share addresses, because the
/// kernel's neighbour table (`gc_thresh3`, 1,024 by default, shared by
/// every namespace of the host) cannot hold an entry per backend. Seen:
/// 1,024 backends on their own addresses filled it, and the balancer
/// could no longer answer the client's ARP.
static PORTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(64);

/// Ports of each address for this size: 64, or 256 past 16,384 backends
/// (4,096 x 16 on 64 a address took 1,024 addresses, the whole neighbour
/// table: 397 of 2,860 requests failed).
fn ports() -> usize {
    PORTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// First backend port.
const FIRST_PORT: u16 = 9000;

/// Backend `g` (0-based over all services): an address of
/// 10.213.128.0/17 on server `(g / PORTS) % SERVERS`, and a port.
fn backend(g: usize) -> SocketAddr {
    let a = g / ports();
    let ip = Ipv4Addr::new(10, 213, 128 + (a / 254) as u8, 1 + (a % 254) as u8);
    SocketAddr::from((ip, FIRST_PORT + (g % ports()) as u16))
}

fn vip(s: usize) -> SocketAddr {
    SocketAddr::from((VIP, BASE_PORT + s as u16))
}

/// The config for `n` services of `m` backends; `moved` names one
/// backend (service 1's first) at a fresh address, `weight` sets every
/// backend's weight.
fn config(n: usize, m: usize, moved: bool, weight: f64) -> String {
    let mut c = String::from("[huddle]\nlisten = \"127.0.0.1:9477\"\n");
    if let Some(extra) = EXTRA.get() {
        c.push_str(extra);
        c.push('\n');
    }
    for s in 0..n {
        let _ = write!(c, "\n[[service]]\nvip = \"{}\"\nbackends = [", vip(s));
        for j in 0..m {
            let mut g = s * m + j;
            if moved && s == 1.min(n - 1) && j == 0 {
                g = n * m;
            }
            let sep = if j == 0 { "" } else { ", " };
            let _ = write!(
                c,
                "{sep}{{ addr = \"{}\", weight = {weight:.1} }}",
                backend(g)
            );
        }
        c.push_str("]\n");
    }
    c
}

/// `--huddle-toml`, set once at start.
static EXTRA: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// `--scrape`.
static SCRAPE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `/metrics` fetched in a loop from the balancer's namespace until
/// stopped: how many pages it got.
struct Scraper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: thread::JoinHandle<(u64, u64)>,
}

impl Scraper {
    fn start(ns: &huddle_user::sys::netns::Netns) -> Scraper {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (name, flag) = (ns.name.clone(), stop.clone());
        let thread = thread::spawn(move || {
            huddle_user::sys::netns::enter(&name).expect("enter namespace");
            // Pages, and other answers (429: too many).
            let (mut pages, mut refused) = (0, 0);
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let addr = "127.0.0.1:9477".parse().expect("address");
                match http_get_path(addr, "/metrics", Duration::from_secs(30)) {
                    Ok(_) => pages += 1,
                    Err(_) => refused += 1,
                }
            }
            (pages, refused)
        });
        Scraper { stop, thread }
    }

    fn stop(self) -> (u64, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or((0, 0))
    }
}

/// One row of figures.
#[derive(Default)]
struct Row {
    size: String,
    start_s: f64,
    rss_mib: f64,
    maps_mib: f64,
    cpu_idle: f64,
    cpu_load: f64,
    tick_p50: f64,
    tick_p99: f64,
    probes_s: f64,
    metrics_kib: f64,
    metrics_ms: f64,
    reload_one_ms: f64,
    reload_all_ms: f64,
    slow_leave_ms: Option<f64>,
    failed: usize,
    asked: usize,
    /// Of twenty VIPs picked at random, those that did not answer.
    unanswered: Vec<String>,
}

/// utime + stime of `pid`, in seconds.
fn cpu_s(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat.rsplit_once(") ").context("stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    Ok(ticks / 100.0)
}

fn rss_mib(pid: u32) -> Result<f64> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = st
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("VmRSS")?
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()?;
    Ok(kb / 1024.0)
}

/// The daemon's share of a core over `secs`.
fn cpu_share(pid: u32, secs: u64) -> Result<f64> {
    let (c0, t0) = (cpu_s(pid)?, Instant::now());
    thread::sleep(Duration::from_secs(secs));
    Ok((cpu_s(pid)? - c0) / t0.elapsed().as_secs_f64())
}

fn run_size(bin: &Path, server_bin: &Path, n: usize, m: usize, secs: u64) -> Result<Row> {
    let mut row = Row {
        size: format!("{n} x {m}"),
        ..Row::default()
    };
    let per_addr = if n * m > 16_384 { 256 } else { 64 };
    PORTS.store(per_addr, std::sync::atomic::Ordering::Relaxed);
    let mut bed = Testbed::new(&format!("sc{n}"), SERVERS)?;
    let port_range = format!("{FIRST_PORT}-{}", FIRST_PORT + per_addr as u16 - 1);
    bed.start_backends_with(
        server_bin,
        &[
            "--delay-ms",
            &BASE_MS.to_string(),
            "--more-ports",
            &port_range,
        ],
    )?;
    // Every backend address (and one spare for the reload) on its server;
    // the balancer reaches them on its segment.
    let mut batches = vec![String::new(); SERVERS];
    for a in 0..=(n * m) / ports() {
        let ip = backend(a * ports()).ip();
        let _ = writeln!(batches[a % SERVERS], "addr add {ip}/32 dev eth0");
    }
    for (k, b) in batches.iter().enumerate() {
        let path = bed.dir.join(format!("addrs{k}"));
        std::fs::write(&path, b)?;
        bed.backends[k].ip(&["-batch", &path.display().to_string()])?;
    }
    bed.lb
        .ip(&["route", "add", "10.213.128.0/17", "dev", "eth0"])?;
    let cfg = bed.dir.join("scale.toml");
    std::fs::write(&cfg, config(n, m, false, 1.0))?;
    let t0 = Instant::now();
    bed.start_huddle(bin, &["--config", &cfg.display().to_string()])?;
    let pid = bed.huddle.as_ref().context("no daemon")?.child.id();
    let probe = [vip(0), vip(n - 1), vip(n / 2)];
    let forwarding = in_ns(&bed.client, move || {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(120) {
            if probe
                .iter()
                .all(|v| http_get(*v, Duration::from_millis(500)).is_ok())
            {
                return true;
            }
            thread::sleep(Duration::from_millis(50));
        }
        false
    });
    if !forwarding {
        let st = bed.status().map(|s| s.render()).unwrap_or_default();
        let log = bed.huddle_log();
        let tail: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .take(20)
            .collect();
        bail!(
            "{n} x {m}: no answer through the VIPs in 120 s\n{}\n{}",
            st.lines()
                .filter(|l| l.starts_with("global")
                    || l.starts_with("control")
                    || l.starts_with("note"))
                .collect::<Vec<_>>()
                .join("\n"),
            tail.join("\n")
        );
    }
    row.start_s = t0.elapsed().as_secs_f64();
    thread::sleep(Duration::from_secs(2));
    // Twenty services picked at random answer through their VIP.
    let mut x = 0x9e37_79b9_u64 ^ (n * m) as u64;
    let picked: Vec<SocketAddr> = (0..20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            vip((x % n as u64) as usize)
        })
        .collect();
    row.unanswered = in_ns(&bed.client, move || {
        picked
            .iter()
            .filter(|v| http_get(**v, Duration::from_secs(2)).is_err())
            .map(ToString::to_string)
            .collect()
    });

    // Idle.
    let p0 = bed.status()?.control.probes_sent;
    let t = Instant::now();
    row.cpu_idle = cpu_share(pid, secs)?;
    row.probes_s = (bed.status()?.control.probes_sent - p0) as f64 / t.elapsed().as_secs_f64();
    row.rss_mib = rss_mib(pid)?;
    let st = bed.status()?;
    row.maps_mib = st.control.map_bytes as f64 / f64::from(1 << 20);
    eprintln!(
        "[hc-scale] idle: the last tick passed by {} of {} services at rest",
        st.control.services_at_rest,
        st.services.len()
    );
    let (kib, ms) = in_ns(&bed.lb, || {
        let t = Instant::now();
        let page = http_get_path(
            "127.0.0.1:9477".parse().unwrap(),
            "/metrics",
            Duration::from_secs(30),
        );
        (
            page.map_or(0.0, |p| p.len() as f64 / 1024.0),
            t.elapsed().as_secs_f64() * 1e3,
        )
    });
    (row.metrics_kib, row.metrics_ms) = (kib, ms);

    // 200 new connections a second: half to the service that gets a slow
    // backend, the rest over three others.
    let slow_s = n / 2;
    let targets = [
        (slow_s, 100.0),
        (0, 100.0 / 3.0),
        (n / 3, 100.0 / 3.0),
        (n - 1, 100.0 / 3.0),
    ];
    let scraper = SCRAPE
        .load(std::sync::atomic::Ordering::Relaxed)
        .then(|| Scraper::start(&bed.lb));
    let loads: Vec<testbed::OpenLoop> = targets
        .iter()
        .map(|(s, r)| testbed::OpenLoop::start(&bed.client, vip(*s), *r, Duration::from_secs(2)))
        .collect();
    thread::sleep(Duration::from_secs(2));
    row.cpu_load = cpu_share(pid, secs)?;
    let st = bed.status()?;
    row.tick_p50 = st.control.tick_p50_ms;
    row.tick_p99 = st.control.tick_p99_ms;
    let victim = backend(slow_s * m);
    let server = (slow_s * m / ports()) % SERVERS;
    // Only the slow service's status: the whole is megabytes a call.
    let service = vec![st.services[slow_s].name.clone()];
    let t = Instant::now();
    testbed::backend_admin(
        &bed.backends[server],
        backend_ip(server),
        &format!("slow_for={}:{}:{}", victim.ip(), victim.port(), BASE_MS * 4),
    )?;
    let name = victim.to_string();
    while t.elapsed() < Duration::from_secs(10) {
        let st = bed.status_of(&service)?;
        let me = st.services.iter().find(|s| s.name == service[0]);
        if std::env::var_os("HC_SCALE_TRACE").is_some() {
            if let Some(b) = me.and_then(|s| s.backends.iter().find(|b| b.addr == name)) {
                eprintln!(
                    "[hc-scale] {:5} ms: t={:.2} {} {:?} samples={} probe={:?}",
                    t.elapsed().as_millis(),
                    b.temperature,
                    b.latency_source,
                    b.p50_ms,
                    b.samples,
                    b.probe_ms
                );
            }
        }
        let ring = me.map(|s| &s.ring);
        if !ring.is_some_and(|r| r.contains(&name)) {
            row.slow_leave_ms = Some(t.elapsed().as_secs_f64() * 1e3);
            // Why it left: the rotation line names the rule and figures.
            for l in bed.huddle_log().lines().filter(|l| {
                l.contains("-> outer ring")
                    || l.contains("lock was held")
                    || l.contains("a snapshot for")
            }) {
                eprintln!("[hc-scale]   {}", l.split(" event=").next().unwrap_or(l));
            }
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    if let Some(s) = scraper {
        let (pages, refused) = s.stop();
        eprintln!("[hc-scale] /metrics in a loop under load: {pages} pages, {refused} refused");
    }
    for l in loads {
        let out = l.stop();
        row.asked += out.len();
        row.failed += testbed::tally(&out, Duration::ZERO, Duration::MAX).1.len();
    }

    // Reloads: one backend moved, then every backend's weight changed.
    let reload = |text: String| -> Result<f64> {
        std::fs::write(&cfg, text)?;
        let t = Instant::now();
        let r = bed.control(Request::Reload)?;
        if !r.ok {
            bail!("reload refused: {:?}", r.error);
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    row.reload_one_ms = reload(config(n, m, true, 1.0))?;
    let moved = backend(n * m).to_string();
    let shown = bed.status()?.services[1.min(n - 1)]
        .backends
        .iter()
        .any(|b| b.addr == moved);
    if !shown {
        bail!(
            "after the reload, service {} does not show its new backend {moved}",
            1.min(n - 1)
        );
    }
    row.reload_all_ms = reload(config(n, m, true, 2.0))?;
    bed.stop_huddle();
    Ok(row)
}

fn main() -> Result<()> {
    testbed::require_root();
    testbed::remove_on_signal();
    testbed::raise_nofile();
    let cli = Cli::parse();
    if let Some(t) = &cli.huddle_toml {
        let _ = EXTRA.set(t.clone());
    }
    SCRAPE.store(cli.scrape, std::sync::atomic::Ordering::Relaxed);
    let here = std::env::current_exe()?;
    let dir = here.parent().context("binary folder")?;
    let bin = cli.huddle.unwrap_or_else(|| dir.join("hc-huddle"));
    let backend = dir.join("hc-backend");
    let mut rows = Vec::new();
    for size in cli.sizes.split(',') {
        let (n, m) = size
            .split_once('x')
            .and_then(|(a, b)| Some((a.trim().parse().ok()?, b.trim().parse().ok()?)))
            .with_context(|| format!("--sizes: {size:?} is not NxM"))?;
        if n == 0 || m == 0 || n * m + 1 > 254 * 128 * 64 {
            bail!("--sizes: {size} is outside 1x1..2,000,000 backends");
        }
        eprintln!("[hc-scale] {n} x {m} ...");
        let row = run_size(&bin, &backend, n, m, cli.secs)?;
        rows.push(row);
    }
    let mut wrong = Vec::new();
    println!(
        "| services x backends | start to forwarding s | RSS MiB | kernel maps MiB | CPU idle | CPU at 200 conn/s | tick p50 / p99 ms | probes/s | /metrics KiB, ms | reload one / all ms | 5x slow leaves ms | failed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {:.1} | {:.0} | {:.0} | {:.1}% | {:.1}% | {:.2} / {:.2} | {:.0} | {:.0}, {:.0} | {:.0} / {:.0} | {} | {} of {} |",
            r.size,
            r.start_s,
            r.rss_mib,
            r.maps_mib,
            100.0 * r.cpu_idle,
            100.0 * r.cpu_load,
            r.tick_p50,
            r.tick_p99,
            r.probes_s,
            r.metrics_kib,
            r.metrics_ms,
            r.reload_one_ms,
            r.reload_all_ms,
            r.slow_leave_ms
                .map_or("never (10 s)".to_string(), |v| format!("{v:.0}")),
            r.failed,
            r.asked
        );
        if r.failed > 0 || !r.unanswered.is_empty() || r.slow_leave_ms.is_none() {
            wrong.push(format!(
                "{}: {} of {} requests failed, VIPs unanswered {:?}, slow backend left: {}",
                r.size,
                r.failed,
                r.asked,
                r.unanswered,
                r.slow_leave_ms.is_some()
            ));
        }
    }
    for w in &wrong {
        eprintln!("[hc-scale] {w}");
    }
    if cli.check && !wrong.is_empty() {
        bail!("{} size(s) went wrong", wrong.len());
    }
    Ok(())
}
