//! `hc-realload`: the huddle beside kernel DNAT under real servers and
//! real clients, on one bed in one run (issue 50). Four NGINX backends on
//! the project's usual layout (client, balancer, backends on one bridge of
//! veth pairs, native XDP, every host's default offloads), `huddle run
//! --config` with two services and TCP probes; then the same bed with the
//! huddle detached and nftables DNAT (`numgen inc` + masquerade). For each:
//! curl downloads (digest checked), wrk `Connection: close` at full speed
//! over healthy backends (req/s, P50/P99, socket errors, each backend's
//! share from its access log, the huddle's moves out), wrk keep-alive,
//! h2load h2c, and with `--starve` the close run again with backend 1's
//! NGINX held to 3% of a core (cgroup v1 CPU quota) from halfway.
//!
//! Figures are printed, not judged. `cargo xtask bench-real [-- --secs 60
//! --starve --gro off --mtu 9000]` (as root).

use anyhow::{bail, Context, Result};
use clap::Parser;
use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::Duration,
};
use testbed::nginx::{self, body, line};
use testbed::{wait_until, Testbed, VIP};

#[derive(Parser)]
struct Cli {
    /// Seconds of each `Connection: close` run.
    #[arg(long, default_value_t = 60)]
    secs: u64,
    /// Also run close with backend 1 starved of CPU from halfway.
    #[arg(long)]
    starve: bool,
    /// GRO on the bridge's ports: on or off.
    #[arg(long, default_value = "on")]
    gro: String,
    /// MTU of every link (9000: the bridge port's XDP_PASS program is not
    /// frags-aware and comes off, so the huddle picks its own mode).
    #[arg(long, default_value_t = 1500)]
    mtu: u32,
    /// The huddle's `nat_ports` (default: the product's).
    #[arg(long)]
    nat_ports: Option<String>,
    /// A line for the huddle's config, e.g. `flow_table_size = 1048576`,
    /// or `huddle.rotation = false` for the `[huddle]` table (repeatable).
    #[arg(long)]
    config_line: Vec<String>,
    /// A sysctl for the client's namespace, e.g. `net.ipv4.tcp_timestamps=2`.
    #[arg(long)]
    client_sysctl: Option<String>,
    /// wrk connections.
    #[arg(long, default_value_t = 64)]
    conns: u32,
    /// Only this balancer: huddle or dnat.
    #[arg(long)]
    only: Option<String>,
    /// Print the huddle's view of each backend every 2 s of a close run.
    #[arg(long)]
    watch: bool,
    /// The daemon (default: `hc-huddle` beside this binary).
    #[arg(long)]
    huddle: Option<PathBuf>,
}

const N: usize = 4;
/// The starved backend and its quota (microseconds of CPU per 100 ms).
const STARVED: usize = 1;
const QUOTA_US: u32 = 3000;

/// One close run's figures.
#[derive(Default)]
struct Close {
    rps: String,
    p50: String,
    p99: String,
    errors: String,
    /// Each backend's share of the requests, in percent (after the starve
    /// when there was one).
    shares: Vec<f64>,
    moves: Vec<String>,
    /// What the huddle made of each backend of `VIP:80` late in the run.
    seen: String,
}

fn main() -> Result<()> {
    testbed::require_root();
    let cli = Cli::parse();
    let huddle = cli.huddle.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .expect("own path")
            .with_file_name("hc-huddle")
    });
    let mut bed = Testbed::native("rl", N)?;
    set_links(&bed, &cli)?;
    nginx::start(&mut bed, true)?;
    if let Some(kv) = &cli.client_sysctl {
        bed.client.exec("sysctl", &["-qw", kv])?;
    }
    let config = nginx::huddle_config(&bed)?;
    let mut lines = cli.config_line.clone();
    lines.extend(cli.nat_ports.iter().map(|p| format!("nat_ports = \"{p}\"")));
    if !lines.is_empty() {
        // `huddle.rotation = false` goes into the `[huddle]` table.
        let (inner, top): (Vec<String>, Vec<String>) =
            lines.into_iter().partition(|l| l.starts_with("huddle."));
        let inner: String = inner.iter().map(|l| format!("{}\n", &l[7..])).collect();
        let text = std::fs::read_to_string(&config)?.replacen(
            "[huddle]\n",
            &format!("[huddle]\n{inner}"),
            1,
        );
        std::fs::write(&config, format!("{}\n{text}", top.join("\n")))?;
    }
    let mut report = String::new();
    for (key, who) in [("huddle", "huddle"), ("dnat", "kernel DNAT")] {
        if cli.only.as_deref().is_some_and(|o| o != key) {
            continue;
        }
        let from = report.len();
        if who == "huddle" {
            bed.start_huddle(&huddle, &["--config", &config.display().to_string()])?;
        } else {
            bed.stop_huddle();
            if testbed::xdp_attached(&bed.lb) {
                bail!("the huddle's program is still attached after its stop");
            }
            nginx::dnat(&bed)?;
        }
        let got = bed.dir.join("got");
        wait_until(Duration::from_secs(20), || {
            nginx::fetch(&bed.client, &format!("http://{VIP}/1k"), &got)
                .is_some_and(|(b, _)| b == body(1024))
        })
        .with_context(|| format!("{who}: the VIP never answered"))?;
        let mode = if who == "huddle" {
            bed.status()?.xdp_mode
        } else {
            "-".into()
        };
        writeln!(report, "\n### {who} (XDP mode {mode})\n")?;
        for name in ["100k", "1m"] {
            let mut took = Vec::new();
            for _ in 0..3 {
                let (b, t) = nginx::fetch(&bed.client, &format!("http://{VIP}/{name}"), &got)
                    .with_context(|| format!("{who}: /{name} failed"))?;
                let n = nginx::BODIES.iter().find(|(k, _)| *k == name).unwrap().1;
                if b != body(n) {
                    bail!("{who}: /{name} came back {} bytes, not intact", b.len());
                }
                took.push(t * 1e3);
            }
            took.sort_by(f64::total_cmp);
            writeln!(
                report,
                "- curl /{name}: intact 3 of 3, median {:.1} ms",
                took[1]
            )?;
        }
        let c = close(&bed, &cli, false)?;
        writeln!(
            report,
            "- wrk -c{} close {} s: {}",
            cli.conns,
            cli.secs,
            c.line()
        )?;
        let ka = wrk(&bed, &cli, 10, false)?;
        writeln!(
            report,
            "- wrk -c{} keep-alive 10 s: {} req/s, P99 {}, errors {}",
            cli.conns,
            field(&ka, "Requests/sec:"),
            field(&ka, "99%"),
            errors(&ka)
        )?;
        let h2 = bed.client.output(
            "h2load",
            &["-c16", "-m10", "-n20000", &format!("http://{VIP}:81/5k")],
        )?;
        writeln!(
            report,
            "- h2load 16 x 10 h2c: {} / {}",
            line(&h2, "finished in").unwrap_or("?"),
            line(&h2, "requests:").unwrap_or("?")
        )?;
        if cli.starve {
            let c = close(&bed, &cli, true)?;
            writeln!(
                report,
                "- wrk close {} s, b{STARVED} at {QUOTA_US} us/100 ms from halfway: {}",
                cli.secs,
                c.line()
            )?;
        }
        for (host, ns) in std::iter::once(("client", &bed.client))
            .chain(bed.backends.iter().map(|b| ("backend", b)))
        {
            let e = nginx::csum_errors(ns)?;
            if e > 0 {
                writeln!(
                    report,
                    "- {host} {}: {e} TCP checksum errors so far",
                    ns.name
                )?;
            }
        }
        if who == "huddle" {
            let g = bed.status()?.global;
            let k = |n: &str| g.get(n).copied().unwrap_or(0);
            writeln!(
                report,
                "- csum_finished {}, drop_csum {}",
                k("csum_finished"),
                k("drop_csum")
            )?;
        }
        println!("{}", &report[from..]);
    }
    nginx::undo_dnat(&bed);
    println!(
        "\n## hc-realload: GRO {}, MTU {}\n{report}",
        cli.gro, cli.mtu
    );
    Ok(())
}

impl Close {
    fn line(&self) -> String {
        let shares: Vec<String> = self.shares.iter().map(|s| format!("{s:.1}")).collect();
        format!(
            "{} req/s, P50 {}, P99 {}, errors {}, shares {}%, moves out {}{}{}",
            self.rps,
            self.p50,
            self.p99,
            self.errors,
            shares.join("/"),
            self.moves.len(),
            if self.moves.is_empty() {
                String::new()
            } else {
                format!(" ({})", self.moves.join("; "))
            },
            self.seen
        )
    }
}

/// GRO on the bridge's ports and the MTU of every link, as `cli` says.
fn set_links(bed: &Testbed, cli: &Cli) -> Result<()> {
    let mut ports = vec!["pl".to_string(), "pc".to_string()];
    ports.extend((0..N).map(|i| format!("pb{i}")));
    if cli.mtu != 1500 {
        bed.switch
            .ip(&["link", "set", "dev", "pl", "xdpdrv", "off"])?;
    }
    let mtu = cli.mtu.to_string();
    for p in &ports {
        bed.switch.exec("ethtool", &["-K", p, "gro", &cli.gro])?;
        bed.switch.ip(&["link", "set", "dev", p, "mtu", &mtu])?;
    }
    bed.switch.ip(&["link", "set", "dev", "br0", "mtu", &mtu])?;
    for ns in std::iter::once(&bed.client)
        .chain(std::iter::once(&bed.lb))
        .chain(&bed.backends)
    {
        ns.ip(&["link", "set", "dev", "eth0", "mtu", &mtu])?;
    }
    Ok(())
}

fn wrk_args(cli: &Cli, secs: u64, close: bool) -> Vec<String> {
    let mut a: Vec<String> = ["-t2", &format!("-c{}", cli.conns), &format!("-d{secs}s")]
        .iter()
        .map(ToString::to_string)
        .collect();
    a.push("--latency".into());
    if close {
        a.extend(["-H".into(), "Connection: close".into()]);
    }
    a.push(format!("http://{VIP}/5k"));
    a
}

fn wrk(bed: &Testbed, cli: &Cli, secs: u64, close: bool) -> Result<String> {
    let a = wrk_args(cli, secs, close);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    bed.client.output("wrk", &a)
}

/// The words after `key` on its line of wrk's output.
fn field(out: &str, key: &str) -> String {
    line(out, key).map_or("?".into(), |l| l[key.len()..].trim().to_string())
}

fn errors(out: &str) -> String {
    let mut e = vec![line(out, "Socket errors")
        .unwrap_or("0 socket errors")
        .to_string()];
    e.extend(line(out, "Non-2xx").map(str::to_string));
    e.join(", ")
}

/// Requests each backend's access log holds so far.
fn logged(dir: &Path) -> Vec<usize> {
    (0..N)
        .map(|i| {
            std::fs::read(nginx::access_log(dir, i))
                .map_or(0, |b| b.iter().filter(|c| **c == b'\n').count())
        })
        .collect()
}

/// A `Connection: close` run; with `starve`, backend `STARVED` is held to
/// `QUOTA_US` from halfway and the shares are those after that.
fn close(bed: &Testbed, cli: &Cli, starve: bool) -> Result<Close> {
    let first = bed.status().ok();
    let since = first.as_ref().map(|s| s.uptime_s);
    // Access logs flush every second.
    thread::sleep(Duration::from_millis(1500));
    let mut before = logged(&bed.dir);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &bed.client.name, "wrk"])
        .args(wrk_args(cli, cli.secs, true))
        .stdout(Stdio::piped());
    let child = cmd.spawn().context("wrk")?;
    let mut held = None;
    let ext0 = tcp_ext(&bed.backends[STARVED]);
    if starve {
        thread::sleep(Duration::from_secs(cli.secs / 2));
        held = Some(Starved::hold(&bed.dir, STARVED)?);
        before = logged(&bed.dir);
    }
    let rest = if starve { cli.secs / 2 } else { cli.secs };
    let mut last = bed.status().ok();
    for _ in 0..rest / 2 {
        if !cli.watch {
            break;
        }
        thread::sleep(Duration::from_secs(2));
        let now = bed.status().ok();
        if let (Some(a), Some(b)) = (&last, &now) {
            eprintln!("{}{}", view(b), deltas(a, b));
        }
        last = now;
    }
    thread::sleep(Duration::from_secs(cli.secs / 4));
    let seen: String = bed.status().map(|s| view(&s)).unwrap_or_default();
    let out = child.wait_with_output()?;
    drop(held);
    let ext1 = tcp_ext(&bed.backends[STARVED]);
    let mut seen = seen;
    for (k, v) in &ext1 {
        let was = ext0.iter().find(|(a, _)| a == k).map_or(0, |(_, b)| *b);
        if *v > was {
            let _ = write!(seen, "\n  - b{STARVED} {k} +{}", v - was);
        }
    }
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    thread::sleep(Duration::from_millis(1500));
    let after = logged(&bed.dir);
    let d: Vec<usize> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let total = d.iter().sum::<usize>().max(1) as f64;
    let last = bed.status().ok();
    if let (Some(a), Some(b)) = (&first, &last) {
        let sum = |s: &huddle_user::status::Status, k: &str| -> u64 {
            s.services
                .iter()
                .flat_map(|v| &v.backends)
                .map(|b| b.counters.get(k).copied().unwrap_or(0))
                .sum()
        };
        for k in [
            "flows_new",
            "nat_reuse_early",
            "nat_tw_skipped",
            "retried_time_wait",
        ] {
            let _ = write!(
                seen,
                "\n  - huddle {k} +{}",
                sum(b, k).saturating_sub(sum(a, k))
            );
        }
    }
    let moves = match (since, last) {
        (Some(t0), Some(st)) => st
            .services
            .iter()
            .flat_map(|s| &s.recent)
            .filter(|e| e.at_s >= t0 && e.to.as_str() == "outer")
            .map(|e| {
                format!(
                    "{} {} at {:.1} s: {}",
                    e.service,
                    e.backend,
                    e.at_s - t0,
                    e.reason
                )
            })
            .collect(),
        _ => Vec::new(),
    };
    Ok(Close {
        seen,
        rps: field(&out, "Requests/sec:"),
        p50: field(&out, "50%"),
        p99: field(&out, "99%"),
        errors: errors(&out),
        shares: d.iter().map(|n| *n as f64 * 100.0 / total).collect(),
        moves,
    })
}

/// The TCP counters of `ns` that tell where connections waited or were
/// refused: listen queue overflows, TIME_WAIT reuse and PAWS.
fn tcp_ext(ns: &huddle_user::sys::netns::Netns) -> Vec<(String, u64)> {
    let text = ns.output("cat", &["/proc/net/netstat"]).unwrap_or_default();
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("TcpExt:")).collect();
    let (Some(h), Some(v)) = (rows.first(), rows.get(1)) else {
        return Vec::new();
    };
    let keep = [
        "ListenOverflows",
        "ListenDrops",
        "TW",
        "PAWS",
        "Challenge",
        "SynRetrans",
        "TCPReqQFullDrop",
        "TCPTimeWaitOverflow",
    ];
    h.split_whitespace()
        .zip(v.split_whitespace())
        .skip(1)
        .filter(|(k, _)| keep.iter().any(|w| k.contains(w)))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

/// What moved between two readings of the counters: the global ones, and
/// each backend's of the `:80` service, those that did.
fn deltas(a: &huddle_user::status::Status, b: &huddle_user::status::Status) -> String {
    let diff = |x: &huddle_user::status::Counters, y: &huddle_user::status::Counters| {
        let v: Vec<String> = y
            .iter()
            .filter_map(|(k, n)| {
                let d = n.saturating_sub(x.get(k).copied().unwrap_or(0));
                (d > 0).then(|| format!("{k} {d}"))
            })
            .collect();
        v.join(", ")
    };
    let mut out = format!("\n  global: {}", diff(&a.global, &b.global));
    let svc = |s: &huddle_user::status::Status| {
        s.services.iter().find(|s| s.name.contains(":80")).cloned()
    };
    if let (Some(x), Some(y)) = (svc(a), svc(b)) {
        for (p, q) in x.backends.iter().zip(&y.backends) {
            let _ = write!(out, "\n  {}: {}", q.addr, diff(&p.counters, &q.counters));
        }
    }
    out
}

/// Each backend of the `:80` service as the huddle judges it: place,
/// temperature, latency and what it was judged against.
fn view(st: &huddle_user::status::Status) -> String {
    let mut v = String::new();
    for s in st.services.iter().filter(|s| s.name.contains(":80")) {
        for b in &s.backends {
            let ms = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.1}"));
            let _ = write!(
                v,
                "\n  - {} {} t {:.2}: p50 {} p75 {} p99 {} ms ({}), probe {} ms",
                b.addr,
                b.place,
                b.temperature,
                ms(b.p50_ms),
                ms(b.p75_ms),
                ms(b.p99_ms),
                b.latency_source,
                ms(b.probe_ms)
            );
        }
    }
    v
}

/// Backend `i`'s NGINX in a cgroup v1 CPU group with a quota, until dropped.
struct Starved {
    group: PathBuf,
    pids: Vec<u32>,
}

impl Starved {
    fn hold(dir: &Path, i: usize) -> Result<Starved> {
        let root = Path::new("/sys/fs/cgroup/cpu");
        let group = root.join(dir.file_name().context("bed folder")?);
        std::fs::create_dir_all(&group).context("cgroup v1 cpu controller")?;
        std::fs::write(group.join("cpu.cfs_period_us"), "100000")?;
        std::fs::write(group.join("cpu.cfs_quota_us"), QUOTA_US.to_string())?;
        let pids = nginx::pids(dir, i)?;
        let s = Starved { group, pids };
        for p in &s.pids {
            std::fs::write(s.group.join("cgroup.procs"), p.to_string())?;
        }
        Ok(s)
    }
}

impl Drop for Starved {
    fn drop(&mut self) {
        for p in &self.pids {
            let _ = std::fs::write("/sys/fs/cgroup/cpu/cgroup.procs", p.to_string());
        }
        let _ = std::fs::remove_dir(&self.group);
    }
}
