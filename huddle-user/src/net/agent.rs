//! `huddle agent`: this host's CPU and memory under node_exporter's metric
//! names, for backends that run no node_exporter. Read from /proc on every
//! scrape, so the figures are always current.

use crate::http;
use anyhow::{Context, Result};
use std::{fmt::Write as _, net::SocketAddr};
use tracing::info;

/// Kernel ticks per second of /proc/stat.
fn user_hz() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

const MODES: [&str; 8] = [
    "user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal",
];

/// node_exporter-style text from /proc/stat and /proc/meminfo contents.
#[must_use]
pub fn render(stat: &str, meminfo: &str, hz: f64) -> String {
    let mut out = String::new();
    out.push_str("# HELP node_cpu_seconds_total Seconds the CPUs spent in each mode.\n# TYPE node_cpu_seconds_total counter\n");
    for line in stat.lines() {
        let mut words = line.split_whitespace();
        let Some(cpu) = words.next().and_then(|w| w.strip_prefix("cpu")) else {
            continue;
        };
        if cpu.is_empty() {
            continue; // the all-CPU total line
        }
        for (mode, v) in MODES.iter().zip(words) {
            if let Ok(ticks) = v.parse::<u64>() {
                let _ = writeln!(
                    out,
                    "node_cpu_seconds_total{{cpu=\"{cpu}\",mode=\"{mode}\"}} {}",
                    ticks as f64 / hz
                );
            }
        }
    }
    for (key, name) in [
        ("MemTotal:", "node_memory_MemTotal_bytes"),
        ("MemAvailable:", "node_memory_MemAvailable_bytes"),
    ] {
        let kb = meminfo
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(kb) = kb {
            let _ = writeln!(
                out,
                "# HELP {name} Memory information field.\n# TYPE {name} gauge\n{name} {}",
                kb * 1024
            );
        }
    }
    out
}

fn current() -> Result<String> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let mem = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    Ok(render(&stat, &mem, user_hz()))
}

/// Serves `/metrics` on `listen` until killed.
pub async fn run(listen: SocketAddr) -> Result<()> {
    current()?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    info!("huddle agent: host metrics on http://{listen}/metrics");
    http::serve(listener, |path| async move {
        match path.as_str() {
            "/metrics" => match current() {
                Ok(text) => (200, "text/plain; version=0.0.4", text),
                Err(e) => (500, "text/plain", format!("{e:#}\n")),
            },
            _ => (404, "text/plain", "not found: try /metrics\n".into()),
        }
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scrape::{parse, HostTracker};

    #[test]
    fn agent_output_is_what_the_scraper_reads() {
        let mem = "MemTotal:       1000 kB\nMemFree:  1 kB\nMemAvailable:    250 kB\n";
        let a = render(
            "cpu  9 9 9 9\ncpu0 100 0 0 300 0 0 0 0\ncpu1 100 0 0 300 0 0 0 0\n",
            mem,
            100.0,
        );
        let b = render(
            "cpu  9 9 9 9\ncpu0 190 0 0 310 0 0 0 0\ncpu1 190 0 0 310 0 0 0 0\n",
            mem,
            100.0,
        );
        let mut t = HostTracker::default();
        t.update(parse(&a));
        t.update(parse(&b));
        assert!((t.cpu.unwrap() - 0.9).abs() < 1e-9, "{:?}", t.cpu);
        assert!((t.memory.unwrap() - 0.75).abs() < 1e-9);
    }
}
