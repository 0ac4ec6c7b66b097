//! `hc-compare`: HuddleCluster next to round robin, NGINX and HAProxy on
//! one namespace testbed, under the same open-loop load, in the scenarios
//! of the original's published table and one of ours. Prints markdown
//! tables (mean +/- stdev over trials), writes them with the raw figures
//! (`results.json`) and one SVG plot per scenario to `--out`.
//!
//! `hc-compare [--quick] [--trials N] [--secs S] [--rate R] [--out DIR]
//!   [--per-conn K] [--closed-secs S] [--huddle PATH] [--only SLUG,...]
//!   [--scenarios SLUG,...] [--nat-ports MIN-MAX]`

mod closed;
mod peers;
mod plot;
mod scenario;
mod stats;

use anyhow::{bail, Context, Result};
use peers::Balancer;
use scenario::{Scenario, DEGRADED};
use serde::Serialize;
use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};
use testbed::{backend_ip, sibling, OpenLoop, Testbed, HTTP_PORT};

const BACKENDS: usize = 4;

struct Opts {
    trials: usize,
    secs: f64,
    rate: f64,
    base_ms: f64,
    timeout: Duration,
    warmup: Duration,
    out: PathBuf,
    huddle: PathBuf,
    balancers: Vec<Balancer>,
    scenarios: Vec<Scenario>,
    quick: bool,
    /// Seconds of each closed-loop run (0 skips them).
    closed_secs: f64,
    /// Requests per (keep-alive) connection in the open-loop runs.
    per_conn: usize,
    /// More arguments for the XDP balancer (`--nat-ports RANGE`).
    huddle_extra: Vec<String>,
}

/// HuddleCluster next to round robin, NGINX and HAProxy on one namespace
/// testbed, under the same open-loop load (root).
#[derive(clap::Parser)]
#[command(name = "hc-compare")]
struct Cli {
    /// Every cell once, briefly (under two minutes).
    #[arg(long)]
    quick: bool,
    /// Trials per cell (default 5; 1 with --quick).
    #[arg(long)]
    trials: Option<usize>,
    /// Seconds of load per run (default 16; 2.5 with --quick).
    #[arg(long)]
    secs: Option<f64>,
    /// New requests per second.
    #[arg(long, default_value_t = 200.0)]
    rate: f64,
    /// Folder for results.md, results.json and the plots.
    #[arg(long, default_value = "target/huddle-bench")]
    out: PathBuf,
    /// Requests per (keep-alive) connection in the open-loop runs.
    #[arg(long, default_value_t = 1)]
    per_conn: usize,
    /// Seconds of each closed-loop run, 0 to skip them (default 10; 1.5
    /// with --quick).
    #[arg(long)]
    closed_secs: Option<f64>,
    /// The `huddle` binary (default: the one beside this one).
    #[arg(long)]
    huddle: Option<PathBuf>,
    /// Only these balancers (comma-separated slugs).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Only these scenarios (comma-separated slugs).
    #[arg(long, value_delimiter = ',')]
    scenarios: Option<Vec<String>>,
    /// NAT port range for the XDP balancer, MIN-MAX.
    #[arg(long)]
    nat_ports: Option<String>,
}

fn opts() -> Result<Opts> {
    let cli = <Cli as clap::Parser>::parse();
    let quick = cli.quick;
    let balancers = match &cli.only {
        None => peers::ALL.to_vec(),
        Some(want) => peers::ALL
            .iter()
            .copied()
            .filter(|b| want.iter().any(|w| w == b.slug()))
            .collect(),
    };
    let scenarios = match &cli.scenarios {
        None => scenario::ALL.to_vec(),
        Some(want) => scenario::ALL
            .iter()
            .chain(&scenario::EXTRA)
            .copied()
            .filter(|s| want.iter().any(|w| w == s.slug()))
            .collect(),
    };
    if balancers.is_empty() || scenarios.is_empty() {
        bail!("nothing to run: check --only and --scenarios");
    }
    Ok(Opts {
        trials: cli.trials.unwrap_or(if quick { 1 } else { 5 }),
        secs: cli.secs.unwrap_or(if quick { 2.5 } else { 16.0 }),
        rate: cli.rate,
        base_ms: 10.0,
        timeout: Duration::from_millis(if quick { 1000 } else { 2000 }),
        warmup: Duration::from_millis(if quick { 300 } else { 1500 }),
        out: cli.out,
        huddle: cli.huddle.map_or_else(|| sibling("huddle"), Ok)?,
        balancers,
        scenarios,
        quick,
        closed_secs: cli.closed_secs.unwrap_or(if quick { 1.5 } else { 10.0 }),
        per_conn: cli.per_conn.max(1),
        huddle_extra: cli
            .nat_ports
            .map(|r| vec!["--nat-ports".to_string(), r])
            .unwrap_or_default(),
    })
}

#[derive(Serialize)]
struct Cell {
    scenario: &'static str,
    balancer: &'static str,
    load: String,
    trials: Vec<stats::Trial>,
    /// (seconds since the load started, what happened), first trial.
    rotations: Vec<(f64, String)>,
}

#[derive(Serialize)]
struct Results {
    rate: f64,
    secs: f64,
    trials: usize,
    base_ms: f64,
    timeout_ms: u128,
    backends: usize,
    cells: Vec<Cell>,
    closed_loop: Vec<closed::Throughput>,
}

fn main() {
    testbed::remove_on_signal();
    if let Err(e) = run() {
        eprintln!("hc-compare failed: {e:#}");
        std::process::exit(1);
    }
}

/// (seconds since the load started, what happened).
type Marker = (f64, String);

/// One run of one balancer in one scenario: outcomes, and the huddle's
/// rotations relative to the load's start.
fn one(
    bed: &mut Testbed,
    o: &Opts,
    b: Balancer,
    s: Scenario,
) -> Result<(Vec<testbed::Outcome>, Vec<Marker>)> {
    for i in 0..BACKENDS {
        bed.reset_backend(i)?;
        bed.backend_admin(i, &format!("delay_ms={}", o.base_ms))?;
    }
    let running = peers::start(b, bed, &o.huddle, BACKENDS, &o.huddle_extra)?;
    thread::sleep(o.warmup);
    let uptime_at_start = if b.is_xdp() {
        bed.status()?.uptime_s
    } else {
        0.0
    };
    let kinds = (s == Scenario::Mixed)
        .then(|| testbed::kinds::Kinds::start(&bed.client, b.vip(), &testbed::kinds::Kind::ALL));
    let load = OpenLoop::sessions(&bed.client, b.vip(), o.rate, o.timeout, o.per_conn);
    let total = Duration::from_secs_f64(o.secs);
    let mut done = false;
    while load.start.elapsed() < total {
        let frac = load.start.elapsed().as_secs_f64() / o.secs;
        if let Err(e) = s.drive(bed, o.base_ms, frac, &mut done) {
            eprintln!("  (driving the scenario: {e:#})");
        }
        thread::sleep(scenario::STEP);
    }
    let outcomes = load.stop();
    if let Some(k) = kinds {
        let failed: u64 = k.stop().values().map(|(_, f)| f).sum();
        if failed > 0 {
            println!("      other kinds of traffic: {failed} exchanges failed");
        }
    }
    let mut rotations = Vec::new();
    if b.is_xdp() {
        let st = bed.status()?;
        let sum = |k: &str| testbed::backends_total(&st, k);
        let (early, skipped, resent) = (
            sum("nat_reuse_early"),
            sum("nat_tw_skipped"),
            sum("retried_time_wait"),
        );
        if early + skipped + resent > 0 {
            println!(
                "      NAT tuples: {early} reused within 60 s, {skipped} passed over for a TIME_WAIT, {resent} SYNs a TIME_WAIT refused resent from another tuple"
            );
        }
        for e in &st.services[0].recent {
            let who = (0..BACKENDS)
                .find(|i| e.backend == format!("{}:{HTTP_PORT}", backend_ip(*i)))
                .map_or(e.backend.clone(), |i| format!("b{i}"));
            let short = e.reason.split(':').next().unwrap_or("");
            rotations.push((
                e.at_s - uptime_at_start,
                format!(
                    "{who} {} ({short})",
                    if e.to.as_str() == "inner" {
                        "in"
                    } else {
                        "out"
                    }
                ),
            ));
        }
    }
    peers::stop(running, bed)?;
    Ok((outcomes, rotations))
}

fn run() -> Result<()> {
    let o = opts()?;
    testbed::require_root();
    testbed::raise_nofile();
    for p in ["/usr/sbin/nginx", peers::STREAM_MODULE, "/usr/sbin/haproxy"] {
        if !Path::new(p).exists() {
            bail!("{p} is missing: run `cargo xtask setup` (it installs NGINX and HAProxy)");
        }
    }
    std::fs::create_dir_all(&o.out)?;
    let conns = if o.per_conn == 1 {
        "a new TCP connection per request".to_string()
    } else {
        format!("keep-alive connections of {} requests each", o.per_conn)
    };
    let load_desc = format!(
        "open loop, {} requests/s, {conns}, {} s per run, {} ms client timeout",
        o.rate,
        o.secs,
        o.timeout.as_millis()
    );
    println!(
        "comparing {} balancers x {} scenarios x {} trial(s): {load_desc}; 4 backends serving HTTP in {} ms; \
         the degraded backend is b{DEGRADED}",
        o.balancers.len(),
        o.scenarios.len(),
        o.trials,
        o.base_ms
    );
    let mut bed = Testbed::new("cmp", BACKENDS)?;
    bed.start_backends_with(
        &sibling("hc-backend")?,
        &["--delay-ms", &o.base_ms.to_string()],
    )?;
    // Short connections at this rate would run the namespaces out of
    // ports without these (see ../shared notes on proxies).
    bed.client.sysctl("net.ipv4.tcp_tw_reuse", "1")?;
    bed.client
        .sysctl("net.ipv4.ip_local_port_range", "1024 65000")?;
    bed.lb.sysctl("net.ipv4.tcp_tw_reuse", "1")?;

    let started = Instant::now();
    let mut cells = Vec::new();
    let mut md = String::new();
    for s in &o.scenarios {
        let mut series = Vec::new();
        let mut events = Vec::new();
        for b in &o.balancers {
            let mut trials = Vec::new();
            let mut rotations = Vec::new();
            for t in 0..o.trials {
                let (outcomes, rot) = one(&mut bed, &o, *b, *s)
                    .with_context(|| format!("{} / {} / trial {}", s.slug(), b.slug(), t + 1))?;
                let tr = stats::trial(
                    &outcomes,
                    &format!("b{DEGRADED}"),
                    s.fault_at() * o.secs,
                    o.secs,
                );
                println!(
                    "  {:<10} {:<11} trial {}: p50 {:.1} p99 {:.1} max {:.0} ms, {} of {} failed, b{DEGRADED} share {:.1}%",
                    s.slug(),
                    b.slug(),
                    t + 1,
                    tr.p50_ms,
                    tr.p99_ms,
                    tr.max_ms,
                    tr.failed,
                    tr.requests,
                    tr.degraded_share * 100.0
                );
                for f in tr.failures.iter().take(3) {
                    println!("      failed at {f}");
                }
                if t == 0 {
                    series.push((b.name(), stats::series(&outcomes, 0.5, o.secs)));
                    if *b == Balancer::Huddle {
                        events.clone_from(&rot);
                    }
                    rotations = rot;
                }
                trials.push(tr);
            }
            cells.push(Cell {
                scenario: s.slug(),
                balancer: b.slug(),
                load: load_desc.clone(),
                trials,
                rotations,
            });
        }
        let lines: Vec<plot::Line<'_>> = series
            .iter()
            .map(|(n, p)| plot::Line { name: n, points: p })
            .collect();
        let fault = (s.fault_at() > 0.0).then(|| s.fault_at() * o.secs);
        let svg = o.out.join(format!("{}.svg", s.slug()));
        plot::draw(
            &svg,
            &format!("{} ({} req/s, {conns})", s.name(), o.rate),
            o.secs,
            &lines,
            fault,
            &events,
        )?;
        let table = table(&cells, *s, &o, &load_desc);
        print!("{table}");
        md.push_str(&table);
    }
    let closed = if o.closed_secs > 0.0 {
        closed_loop(&mut bed, &o, &mut md)?
    } else {
        Vec::new()
    };
    let results = Results {
        rate: o.rate,
        secs: o.secs,
        trials: o.trials,
        base_ms: o.base_ms,
        timeout_ms: o.timeout.as_millis(),
        backends: BACKENDS,
        cells,
        closed_loop: closed,
    };
    std::fs::write(
        o.out.join("results.json"),
        serde_json::to_vec_pretty(&results)?,
    )?;
    std::fs::write(o.out.join("results.md"), &md)?;
    println!(
        "\n{} runs in {:.0} s{}; tables in {}, raw figures in {}, plots {}/*.svg",
        results.cells.iter().map(|c| c.trials.len()).sum::<usize>(),
        started.elapsed().as_secs_f64(),
        if o.quick {
            " (quick mode: one short trial each, figures not for quoting)"
        } else {
            ""
        },
        o.out.join("results.md").display(),
        o.out.join("results.json").display(),
        o.out.display()
    );
    Ok(())
}

/// Closed-loop throughput of small requests, short and keep-alive
/// connections, one balancer of each kind.
fn closed_loop(bed: &mut Testbed, o: &Opts, md: &mut String) -> Result<Vec<closed::Throughput>> {
    const CONNS: usize = 32;
    for i in 0..BACKENDS {
        bed.reset_backend(i)?;
        bed.backend_admin(i, "delay_ms=0")?;
    }
    let kinds = [
        Balancer::Huddle,
        Balancer::NginxRoundRobin,
        Balancer::HaproxyRoundRobin,
    ];
    let mut out = Vec::new();
    for keepalive in [false, true] {
        for b in kinds {
            let t = closed::run(bed, &o.huddle, b, CONNS, keepalive, o.closed_secs)
                .with_context(|| format!("closed loop, {}", b.slug()))?;
            let per_packet = t.xdp.map(|x| format!(" ({x})")).unwrap_or_default();
            println!(
                "  closed loop {:<11} {}: {:.0} req/s, p50 {:.2} p99 {:.2} ms, {:.2} us CPU per request{per_packet}, {} failed",
                b.slug(),
                if keepalive { "keep-alive" } else { "new conn  " },
                t.rps,
                t.p50_ms,
                t.p99_ms,
                t.cpu_us_per_request,
                t.failed
            );
            out.push(t);
        }
    }
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\n### closed loop: small requests as fast as {CONNS} clients go\n\n{CONNS} client threads, each sending GET / and waiting for the answer, \
         for {} s; backends answer at once. One run each. Balancer CPU per request: a proxy's process CPU time (user + system); \
         for HuddleCluster the XDP program's own run time from the kernel's BPF statistics (the kernel's veth and forwarding \
         work around it is not counted, nor is a proxy's kernel TCP work in softirq). Client, balancer and backends share 2 cores, \
         so throughput is bounded by the machine, not only by the balancer.\n",
        o.closed_secs
    );
    let _ = writeln!(
        t,
        "| balancer | connections | req/s | P50 ms | P99 ms | failed | balancer CPU per request |"
    );
    let _ = writeln!(t, "|---|---|---:|---:|---:|---:|---:|");
    for r in &out {
        let name = peers::ALL
            .iter()
            .find(|b| b.slug() == r.balancer)
            .map_or(r.balancer, |b| b.name());
        let _ = writeln!(
            t,
            "| {name} | {} | {:.0} | {:.2} | {:.2} | {} | {:.2} µs ({}) |",
            if r.keepalive {
                "keep-alive"
            } else {
                "new per request"
            },
            r.rps,
            r.p50_ms,
            r.p99_ms,
            r.failed,
            r.cpu_us_per_request,
            r.xdp
                .map_or_else(|| "process".to_string(), |x| format!("XDP program: {x}"))
        );
    }
    print!("{t}");
    md.push_str(&t);
    Ok(out)
}

/// The markdown table of one scenario.
fn table(cells: &[Cell], s: Scenario, o: &Opts, load: &str) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\n### {} \n\n{load}; {} trial(s), mean ± stdev. Failed requests count at the time they took (the timeout at most). \
         \"b{DEGRADED} share\": of the requests sent after the fault started (all, for the others), the share b{DEGRADED} answered. \
         \"client retries\": requests a keep-alive client sent again on a new connection, as HTTP clients do, because the server closed or reset its \
         reused connection before any byte of the answer (they count as failed only if the retry failed too).\n",
        s.name(),
        o.trials
    );
    let _ = writeln!(
        t,
        "| balancer | P50 ms | P95 ms | P99 ms | P99.9 ms | max ms | mean ms | failed | client retries | b{DEGRADED} share % | req/s |"
    );
    let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for c in cells.iter().filter(|c| c.scenario == s.slug()) {
        let name = peers::ALL
            .iter()
            .find(|b| b.slug() == c.balancer)
            .map_or(c.balancer, |b| b.name());
        let f = |g: fn(&stats::Trial) -> f64, d: usize| {
            stats::fmt(&c.trials.iter().map(g).collect::<Vec<_>>(), d)
        };
        let _ = writeln!(
            t,
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            f(|x| x.p50_ms, 1),
            f(|x| x.p95_ms, 1),
            f(|x| x.p99_ms, 1),
            f(|x| x.p999_ms, 1),
            f(|x| x.max_ms, 0),
            f(|x| x.mean_ms, 1),
            f(|x| x.failed as f64, 1),
            f(|x| x.client_retries as f64, 1),
            f(|x| x.degraded_share * 100.0, 1),
            f(|x| x.throughput, 0),
        );
    }
    t
}
