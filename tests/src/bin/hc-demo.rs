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

use anyhow::{Context, Result};
use huddle_user::control::Request;
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
                huddle_user::netns::enter(&name).expect("enter client namespace");
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

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let huddle = match args.iter().position(|a| a == "--huddle") {
        Some(i) => PathBuf::from(args.get(i + 1).context("--huddle PATH")?),
        None => sibling("huddle")?,
    };
    let mode = match args.iter().position(|a| a == "--mode") {
        Some(i) => args
            .get(i + 1)
            .context("--mode snat|dsr-l2|dsr-ipip")?
            .clone(),
        None => "snat".into(),
    };
    if !["snat", "dsr-l2", "dsr-ipip"].contains(&mode.as_str()) {
        anyhow::bail!("--mode {mode}: expected snat, dsr-l2 or dsr-ipip");
    }
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
