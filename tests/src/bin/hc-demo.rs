//! The README's demo: four backends, a client and the balancer in network
//! namespaces, real HTTP through the XDP path, a ring swap (one backend
//! drained and restored), then the huddle at work: one backend is made 5x
//! slower under an open-loop load, rests in the outer ring, and returns
//! once fast again. Everything it creates is removed when it ends.
//!
//! `hc-demo [--huddle PATH] [--mode snat|dsr-l2|dsr-ipip]` (default:
//! `huddle` next to this binary, source NAT). In a DSR mode the VIP is on
//! the backends' port, each backend has it on its loopback, and in
//! dsr-ipip each runs `huddle agent --decap eth0`; the balancer then never
//! sees a reply and the huddle runs on the clients' ACKs.
//!
//! `hc-demo --balancers N` (N >= 2) shows several balancers instead: a
//! router spreading the VIP over N balancers by ECMP (BGP through bird2,
//! BFD), L2 DSR with Maglev, the balancers in one `[cluster]`; under load
//! one balancer's link is cut and restored, and a table per balancer and
//! per backend ends it.

use anyhow::Result;
use huddle_user::status::control::Request;
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    thread,
    time::{Duration, Instant},
};
use testbed::{backend_ip, http_get, sibling, tally, OpenLoop, Testbed, HTTP_PORT, VIP};

const BACKENDS: usize = 4;
/// Normal service time of a backend (ms); the slow one gets 5x.
const BASE_MS: u32 = 10;

fn main() {
    testbed::remove_on_signal();
    if let Err(e) = run() {
        eprintln!("demo failed: {e:#}");
        std::process::exit(1);
    }
}

/// `n` requests from each of `threads` client threads, a new connection
/// each; returns answers per backend and failures.
fn load(bed: &Testbed, vip: SocketAddr, threads: usize, n: usize) -> (BTreeMap<String, u32>, u32) {
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let name = bed.client.name.clone();
            thread::spawn(move || {
                huddle_user::sys::netns::enter(&name).expect("enter client namespace");
                let mut counts: BTreeMap<String, u32> = BTreeMap::new();
                let mut failed = 0;
                for _ in 0..n {
                    match http_get(vip, Duration::from_secs(2)) {
                        Ok(b) => *counts.entry(b).or_default() += 1,
                        Err(_) => failed += 1,
                    }
                }
                (counts, failed)
            })
        })
        .collect();
    let mut total = BTreeMap::new();
    let mut failed = 0;
    for h in handles {
        let (c, f) = h.join().expect("client thread");
        for (k, v) in c {
            *total.entry(k).or_default() += v;
        }
        failed += f;
    }
    (total, failed)
}

fn show(title: &str, counts: &BTreeMap<String, u32>, failed: u32) {
    println!("\n{title}");
    println!("  {:<8} {:<18} {:>8}", "backend", "address", "answers");
    for i in 0..BACKENDS {
        let id = format!("b{i}");
        let n = counts.get(&id).copied().unwrap_or(0);
        println!(
            "  {id:<8} {:<18} {n:>8}",
            format!("{}:{HTTP_PORT}", backend_ip(i))
        );
    }
    println!("  failed requests: {failed}");
}

/// One backend made 5x slower under load: it rests, then returns.
fn rotation_demo(bed: &Testbed, vip: SocketAddr) -> Result<()> {
    let slow = 2;
    let addr = format!("{}:{HTTP_PORT}", backend_ip(slow));
    println!("\nthe huddle: an open-loop client opens 200 connections per second; after 2 s backend b{slow} becomes 5x slower ({} ms)", BASE_MS * 5);
    let load = OpenLoop::start(&bed.client, vip, 200.0, Duration::from_secs(3));
    thread::sleep(Duration::from_secs(2));
    let slow_at = load.start.elapsed();
    bed.backend_admin(slow, &format!("delay_ms={}", BASE_MS * 5))?;
    let out = bed.wait_place(&addr, "outer", Instant::now(), Duration::from_secs(10))?;
    println!(
        "\n>>> b{slow} ({addr}) moved to the outer ring {} ms after it became slow",
        out.as_millis()
    );
    thread::sleep(Duration::from_millis(300));
    print!("{}", bed.status()?.render());
    thread::sleep(Duration::from_secs(1));
    let fast_at = load.start.elapsed();
    bed.backend_admin(slow, &format!("delay_ms={BASE_MS}"))?;
    println!("\nb{slow} is fast again; it rests at least 3 s in all, and returns once its probes show it has cooled");
    let back = bed.wait_place(&addr, "inner", Instant::now(), Duration::from_secs(20))?;
    println!(
        ">>> b{slow} returned to the inner ring {} ms after it was made fast again",
        back.as_millis()
    );
    thread::sleep(Duration::from_millis(500));
    let outcomes = load.stop();
    let evicted = slow_at + out;
    for (title, from, to) in [
        ("before the slowdown", Duration::ZERO, slow_at),
        ("from the slowdown until it left", slow_at, evicted),
        ("while it rested", evicted, fast_at + back),
        ("after it returned", fast_at + back, Duration::MAX),
    ] {
        let (c, f) = tally(&outcomes, from, to);
        show(&format!("requests sent {title}:"), &c, f.len() as u32);
    }
    let st = bed.status()?;
    println!("\nrotations logged by the balancer:");
    for e in &st.services[0].recent {
        println!(
            "  at {:>6.1}s  {} -> {} ring ({}), temperature {:.2}",
            e.at_s,
            e.backend,
            e.to.as_str(),
            e.reason,
            e.temperature
        );
    }
    Ok(())
}

/// The README's demo (root): namespaces, a balancer, backends, real HTTP
/// through XDP; one backend turns slow, rests and returns.
#[derive(clap::Parser)]
#[command(name = "hc-demo")]
struct Cli {
    /// The `huddle` binary (default: the one beside this one).
    #[arg(long)]
    huddle: Option<PathBuf>,
    /// How the VIP reaches its backends.
    #[arg(long, default_value = "snat", value_parser = ["snat", "dsr-l2", "dsr-ipip"])]
    mode: String,
    /// Several balancers behind a router instead of one (2 to 8).
    #[arg(long, value_parser = clap::value_parser!(u8).range(2..=8))]
    balancers: Option<u8>,
}

fn run() -> Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    let huddle = cli.huddle.map_or_else(|| sibling("huddle"), Ok)?;
    if let Some(n) = cli.balancers {
        return several(&huddle, usize::from(n));
    }
    let mode = cli.mode;
    let dsr = mode != "snat";
    // DSR delivers the client's packet unchanged: the VIP takes the
    // backends' port.
    let vip: SocketAddr = (VIP, if dsr { HTTP_PORT } else { 80 }).into();
    testbed::require_root();
    println!("building the testbed: client, balancer and {BACKENDS} backends in network namespaces (10.213.0.0/24, VIP {vip}, mode {mode})");
    let mut bed = Testbed::new("demo", BACKENDS)?;
    bed.start_backends_with(
        &sibling("hc-backend")?,
        &["--delay-ms", &BASE_MS.to_string()],
    )?;
    println!("each backend answers HTTP in about {BASE_MS} ms");
    if dsr {
        bed.dsr_backends(&huddle, mode == "dsr-ipip")?;
        println!(
            "each backend has the VIP on its loopback{}",
            if mode == "dsr-ipip" {
                " and runs `huddle agent --decap eth0 --vip VIP` to unwrap IP-in-IP"
            } else {
                ""
            }
        );
    }
    let config = bed.dir.join("huddle.toml");
    // Defaults everywhere except shorter rests, so the return is seen.
    std::fs::write(
        &config,
        "[huddle]\nmin_rest_ms = 3000\ncooldown_ms = 1000\n",
    )?;
    let config_s = config.display().to_string();
    let mut flags = vec![
        "--config".to_string(),
        config_s,
        "--vip".to_string(),
        vip.to_string(),
        "--mode".to_string(),
        mode.clone(),
    ];
    for i in 0..BACKENDS {
        flags.push("--backend".into());
        flags.push(format!("{}:{HTTP_PORT}", backend_ip(i)));
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    println!(
        "starting `huddle run --iface eth0 {}` in the balancer namespace\n(config: min_rest_ms = 3000, cooldown_ms = 1000; all else default: tick 100 ms, heat 0.55, cool 0.30)",
        flags.join(" ")
    );
    bed.start_huddle(&huddle, &flags)?;
    let st = bed.status()?;
    println!(
        "attached: {} XDP on {}, program id {:?}",
        st.xdp_mode, st.interface, st.program_id
    );

    let (c, f) = load(&bed, vip, 4, 250);
    show(
        "1,000 HTTP requests (4 clients, a new TCP connection each), round robin:",
        &c,
        f,
    );

    let drained = format!("{}:{HTTP_PORT}", backend_ip(BACKENDS - 1));
    let r = bed.control(Request::Drain {
        backend: drained.clone(),
        vip: None,
    })?;
    println!("\nring swap: {}", r.message.or(r.error).unwrap_or_default());
    let st = bed.status()?;
    println!(
        "live ring (generation {}): {:?}",
        st.services[0].ring_generation, st.services[0].ring
    );
    let (c, f) = load(&bed, vip, 4, 150);
    show("600 more requests with the backend drained:", &c, f);
    let r = bed.control(Request::Undrain {
        backend: drained,
        vip: None,
    })?;
    println!("\nring swap: {}", r.message.or(r.error).unwrap_or_default());

    let who = testbed::in_ns(&bed.client, move || {
        testbed::http_get_path(vip, "/whoami", Duration::from_secs(2))
    })?;
    println!(
        "\na backend's answer to /whoami (its name and the peer its stack saw): {}",
        who.trim()
    );
    println!(
        "{}",
        if dsr {
            "the client's own address: the backend answered it directly"
        } else {
            "the balancer's SNAT address: replies come back through it"
        }
    );

    rotation_demo(&bed, vip)?;

    println!("\nthe balancer's own view now (`huddle status`), from kernel counters:\n");
    print!("{}", bed.status()?.render());
    println!("\ncleaning up: stopping the balancer, removing its pinned data plane, the backends and the namespaces");
    drop(bed);
    println!("done");
    Ok(())
}

/// The demo of several balancers (`--balancers N`).
fn several(huddle: &std::path::Path, n: usize) -> Result<()> {
    use testbed::scaleout::{balancer_ip, scale_vip, ScaleOut};
    testbed::require_root();
    println!(
        "building: a client behind a router, {n} balancers announcing {} by BGP (bird2, BFD 100 ms x 3), {BACKENDS} backends answering clients directly (L2 DSR, Maglev), in network namespaces (10.214.0.0/16)",
        scale_vip()
    );
    let mut s = ScaleOut::build("demo", n, BACKENDS)?;
    let t0 = Instant::now();
    s.start_with(
        huddle,
        &sibling("hc-backend")?,
        true,
        &["--delay-ms", &BASE_MS.to_string()],
    )?;
    println!(
        "the router spreads the VIP over {:?} ({:.1} s after the start)",
        s.next_hops(),
        t0.elapsed().as_secs_f64()
    );
    let held =
        testbed::HeldConnections::start(&s.client, scale_vip(), 10, 30, Duration::from_secs(1));
    held.wait_opened(300, Duration::from_secs(30))?;
    let load = OpenLoop::start(&s.client, scale_vip(), 100.0, Duration::from_secs(5));
    println!(
        "load: 300 keep-alive connections asking every second, and 100 new connections a second"
    );
    thread::sleep(Duration::from_secs(3));
    let cut = Instant::now();
    s.cut_link(1)?;
    println!("balancer 1 ({}): link cut", balancer_ip(1));
    testbed::wait_until(Duration::from_secs(10), || {
        !s.next_hops().contains(&balancer_ip(1))
    })?;
    println!(
        "  the router stopped using it after {} ms; next hops {:?}",
        cut.elapsed().as_millis(),
        s.next_hops()
    );
    thread::sleep(Duration::from_secs(3));
    let back = Instant::now();
    s.restore_link(1)?;
    testbed::wait_until(Duration::from_secs(20), || s.next_hops().len() == n)?;
    println!(
        "balancer 1: link restored; the router uses it again after {} ms",
        back.elapsed().as_millis()
    );
    thread::sleep(Duration::from_secs(3));
    let errors = held.stop();
    let outcomes = load.stop();
    let (by_backend, failed) = tally(&outcomes, Duration::ZERO, Duration::MAX);
    println!("\n| balancer | ring | new flows | taken over | packets | cluster |");
    println!("|---|---|---:|---:|---:|---|");
    for i in 0..n {
        let st = s.status(i)?;
        let svc = &st.services[0];
        let c = |k: &str| svc.counters.get(k).copied().unwrap_or(0);
        let note = st
            .notes
            .iter()
            .find(|x| x.starts_with("cluster:"))
            .cloned()
            .unwrap_or_default();
        println!(
            "| {} | {} backends | {} | {} | {} | {} |",
            balancer_ip(i),
            svc.ring.len(),
            c("promoted"),
            c("taken_over"),
            c("pkts"),
            note.trim_start_matches("cluster: ")
        );
    }
    println!("\n| backend | new connections answered |");
    println!("|---|---:|");
    for (b, count) in &by_backend {
        println!("| {b} | {count} |");
    }
    println!(
        "\nkeep-alive connections broken: {} of 300; new connections failed: {} of {}",
        errors.len(),
        failed.len(),
        outcomes.len()
    );
    println!("(connections the router moved off the cut balancer were taken over by the others on the same backend: \"taken over\")");
    Ok(())
}
