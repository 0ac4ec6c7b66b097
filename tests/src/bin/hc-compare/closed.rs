//! Closed-loop throughput of small HTTP requests through each balancer
//! (backends answer at once), with the balancer's CPU per request: the
//! process CPU time of a proxy, the XDP program's own run time (kernel
//! BPF statistics) for HuddleCluster.

use crate::{
    peers::{self, Balancer},
    stats,
};
use anyhow::{Context, Result};
use serde::Serialize;
use std::{
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};
use testbed::{http_get, KeepAlive, Testbed};

#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    pub balancer: &'static str,
    pub keepalive: bool,
    pub connections: usize,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub failed: u64,
    /// Microseconds of balancer CPU per request.
    pub cpu_us_per_request: f64,
    /// What that CPU figure covers.
    pub cpu_of: &'static str,
    /// HuddleCluster only: what its XDP program did per request.
    pub xdp: Option<XdpRuns>,
}

/// The XDP program's runs (packets) per request and mean run time per
/// packet, from the kernel's BPF statistics.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct XdpRuns {
    pub packets_per_request: f64,
    pub ns_per_packet: f64,
}

impl std::fmt::Display for XdpRuns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} packets of {:.0} ns",
            self.packets_per_request, self.ns_per_packet
        )
    }
}

/// CPU seconds (user + system) of process `root` and all its descendants
/// (a proxy's master and workers; NGINX rewrites its workers' command
/// lines, so they are found by parent).
fn cpu_of(root: u32) -> f64 {
    let hz = 100.0; // USER_HZ on Linux
                    // (pid, ppid, cpu seconds) of every process.
    let mut procs = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) {
            // Fields after the command's closing parenthesis: state, ppid, ...
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            procs.push((pid, num(1) as u32, (num(11) + num(12)) / hz)); // utime, stime
        }
    }
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(procs.iter().filter(|q| q.1 == p).map(|q| q.0));
        i += 1;
    }
    procs
        .iter()
        .filter(|q| tree.contains(&q.0))
        .map(|q| q.2)
        .sum()
}

/// Run time and run count of the kernel program with id `id`.
fn prog_time(id: u32) -> Result<(Duration, u64)> {
    for p in aya::programs::loaded_programs() {
        let p = p?;
        if p.id() == id {
            return Ok((p.run_time(), p.run_count()));
        }
    }
    anyhow::bail!("program {id} not found")
}

/// One closed-loop run of `secs` with `conns` clients.
pub fn run(
    bed: &mut Testbed,
    huddle: &Path,
    b: Balancer,
    conns: usize,
    keepalive: bool,
    secs: f64,
) -> Result<Throughput> {
    let running = peers::start(b, bed, huddle, 4, &[])?;
    thread::sleep(Duration::from_millis(500));
    let vip = b.vip();
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("enabling BPF run-time statistics")?;
    let prog = if b.is_xdp() {
        bed.status()?.program_id
    } else {
        None
    };
    let pid = match &running {
        peers::Running::Proxy(p) => Some(p.child.id()),
        peers::Running::Xdp => None,
    };
    let cpu0 = pid.map_or(0.0, cpu_of);
    let prog0 = prog.map(prog_time).transpose()?;
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let workers: Vec<_> = (0..conns)
        .map(|_| {
            let (stop, ns) = (stop.clone(), bed.client.name.clone());
            thread::spawn(move || -> (Vec<f64>, u64) {
                huddle_user::sys::netns::enter(&ns).expect("client namespace");
                let mut lat = Vec::new();
                let mut failed = 0;
                let mut conn: Option<KeepAlive> = None;
                let t = Duration::from_secs(3);
                while !stop.load(Ordering::Relaxed) {
                    let t0 = Instant::now();
                    let ok = if keepalive {
                        if conn.is_none() {
                            conn = KeepAlive::connect(vip, t).ok();
                        }
                        match conn.as_mut().map(KeepAlive::get) {
                            Some(Ok(_)) => true,
                            _ => {
                                conn = None;
                                false
                            }
                        }
                    } else {
                        http_get(vip, t).is_ok()
                    };
                    if ok {
                        lat.push(t0.elapsed().as_secs_f64() * 1e3);
                    } else {
                        failed += 1;
                    }
                }
                (lat, failed)
            })
        })
        .collect();
    thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let mut lat = Vec::new();
    let mut failed = 0;
    for w in workers {
        let (l, f) = w.join().expect("client thread");
        lat.extend(l);
        failed += f;
    }
    let took = started.elapsed().as_secs_f64();
    let cpu = pid.map_or(0.0, cpu_of) - cpu0;
    // (ns of run time, runs) over the run.
    let prog_ns = match (prog, prog0) {
        (Some(id), Some((t0, n0))) => {
            let (t, runs) = prog_time(id)?;
            Some(((t - t0).as_nanos() as f64, runs.saturating_sub(n0) as f64))
        }
        _ => None,
    };
    peers::stop(running, bed)?;
    lat.sort_by(f64::total_cmp);
    let n = lat.len().max(1) as f64;
    let (cpu_us, cpu_of) = match prog_ns {
        Some((ns, _)) => (
            ns / 1e3 / n,
            "XDP program run time (kernel BPF stats), all packets of the request",
        ),
        None => (cpu * 1e6 / n, "proxy process CPU (user + system)"),
    };
    Ok(Throughput {
        balancer: b.slug(),
        keepalive,
        connections: conns,
        rps: lat.len() as f64 / took,
        p50_ms: stats::quantile(&lat, 0.5),
        p99_ms: stats::quantile(&lat, 0.99),
        failed,
        cpu_us_per_request: cpu_us,
        cpu_of,
        xdp: prog_ns.map(|(ns, runs)| XdpRuns {
            packets_per_request: runs / n,
            ns_per_packet: ns / runs.max(1.0),
        }),
    })
}
