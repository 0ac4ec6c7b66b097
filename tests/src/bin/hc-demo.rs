//! The README's demo: four backends, a client and the balancer in network
//! namespaces, real HTTP through the XDP path, a ring swap (one backend
//! drained and restored), and the balancer's per-backend table at the end.
//! Everything it creates is removed when it ends.
//!
//! `hc-demo [--huddle PATH]` (default: `huddle` next to this binary).

use anyhow::{Context, Result};
use huddle_user::control::Request;
use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, thread, time::Duration};
use testbed::{backend_ip, http_get, Testbed, HTTP_PORT, VIP};

const BACKENDS: usize = 4;

fn main() {
    if let Err(e) = run() {
        eprintln!("demo failed: {e:#}");
        std::process::exit(1);
    }
}

fn sibling(name: &str) -> Result<PathBuf> {
    Ok(std::env::current_exe()?
        .parent()
        .context("binary folder")?
        .join(name))
}

/// `n` requests from each of `threads` client threads, a new connection
/// each; returns answers per backend and failures.
fn load(bed: &Testbed, threads: usize, n: usize) -> (BTreeMap<String, u32>, u32) {
    let vip: SocketAddr = (VIP, 80).into();
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

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let huddle = match args.iter().position(|a| a == "--huddle") {
        Some(i) => PathBuf::from(args.get(i + 1).context("--huddle PATH")?),
        None => sibling("huddle")?,
    };
    testbed::require_root();
    println!("building the testbed: client, balancer and {BACKENDS} backends in network namespaces (10.213.0.0/24, VIP {VIP}:80)");
    let mut bed = Testbed::new("demo", BACKENDS)?;
    bed.start_backends(&sibling("hc-backend")?)?;
    let mut flags = vec!["--vip".to_string(), format!("{VIP}:80")];
    for i in 0..BACKENDS {
        flags.push("--backend".into());
        flags.push(format!("{}:{HTTP_PORT}", backend_ip(i)));
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    println!(
        "starting `huddle run --iface eth0 {}` in the balancer namespace",
        flags.join(" ")
    );
    bed.start_huddle(&huddle, &flags)?;
    let st = bed.status()?;
    println!(
        "attached: {} XDP on {}, program id {:?}",
        st.xdp_mode, st.interface, st.program_id
    );

    let (c, f) = load(&bed, 4, 250);
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
    let (c, f) = load(&bed, 4, 150);
    show("600 more requests with the backend drained:", &c, f);
    let r = bed.control(Request::Undrain {
        backend: drained,
        vip: None,
    })?;
    println!("\nring swap: {}", r.message.or(r.error).unwrap_or_default());

    println!("\nthe balancer's own view (`huddle status`), from kernel counters:\n");
    print!("{}", bed.status()?.render());
    println!("\ncleaning up: stopping the balancer (it detaches), the backends, and removing the namespaces");
    drop(bed);
    println!("done");
    Ok(())
}
