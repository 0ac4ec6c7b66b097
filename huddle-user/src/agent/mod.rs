//! `huddle agent`: this host's CPU and memory under node_exporter's metric
//! names, for backends that run no node_exporter (read from /proc on every
//! scrape, so always current); with `--decap IFACE`, the XDP program that
//! unwraps the balancer's `dsr-ipip` packets, and a check of the DSR
//! set-up that says what is missing.

use crate::{config::XdpMode, kernel::decap::Decap, net::http};
use anyhow::{Context, Result};
use huddle_common::{latency::bucket_bounds, AgentTtfb, Counters, DecapStats, LATENCY_BUCKETS};
use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
};
use tracing::{info, warn};

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

/// What `huddle agent` runs: host metrics, and optionally the decap.
#[derive(Clone, Debug)]
pub struct AgentArgs {
    pub listen: SocketAddr,
    /// Interface to unwrap the balancer's IP-in-IP packets on.
    pub decap: Option<String>,
    pub xdp_mode: XdpMode,
    /// VIPs this backend serves by DSR, checked against its set-up.
    pub vips: Vec<IpAddr>,
    /// Outer sources whose IP-in-IP is unwrapped; empty: the decap
    /// interface's subnets.
    pub allow: Vec<crate::config::IpPrefix>,
}

/// Serves `/metrics` on `args.listen` until killed; with `--decap`, keeps
/// the decap program attached and fed with this host's addresses.
pub async fn run(args: AgentArgs) -> Result<()> {
    current()?;
    let decap = match &args.decap {
        Some(iface) => Some(Arc::new(Mutex::new(start_decap(iface, &args)?))),
        None => None,
    };
    let iface = match &args.decap {
        Some(i) => Some(i.clone()),
        None => default_route_iface(),
    };
    for line in setup_problems(iface.as_deref(), args.decap.is_some(), &args.vips) {
        warn!("{line}");
    }
    if let Some(d) = decap.clone() {
        // Addresses come and go (a VIP added later): follow them.
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(2));
            loop {
                tick.tick().await;
                if let Err(e) = local_ips().and_then(|a| lock(&d).set_addresses(&a)) {
                    warn!("decap: updating this host's addresses: {e:#}");
                }
            }
        });
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    info!(
        "huddle agent: host metrics on http://{}/metrics",
        args.listen
    );
    http::serve(listener, move |asked| {
        let decap = decap.clone();
        async move {
            match asked.path.as_str() {
                "/metrics" => page(decap.as_deref()),
                _ => (404, "text/plain", "not found: try /metrics\n".into()),
            }
            .into()
        }
    })
    .await;
    Ok(())
}

/// Attaches the decap program to `iface`, fed with this host's addresses,
/// timing requests to `args.vips`.
fn start_decap(iface: &str, args: &AgentArgs) -> Result<Decap> {
    crate::sys::host::check_privileges()?;
    let ifindex = crate::sys::addresses::ifindex(iface)?;
    let mut d = Decap::load()?;
    let allow = if args.allow.is_empty() {
        subnets(iface)?
    } else {
        args.allow.clone()
    };
    d.set_allow(&allow)?;
    d.vips_only = !args.vips.is_empty();
    if d.vips_only {
        d.set_inner(&args.vips)?;
    }
    d.set_addresses(&local_ips()?)?;
    let mode = d.attach(ifindex, args.xdp_mode)?;
    info!(
        "huddle agent: unwrapping IP-in-IP to this host on {iface} ({mode} mode) from {} ({}) to {}; any other IP-in-IP to this host is dropped",
        allow
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        if args.allow.is_empty() {
            "the interface's subnets: --allow names the balancers otherwise"
        } else {
            "--allow"
        },
        if d.vips_only {
            "the --vip addresses"
        } else {
            "this host's addresses"
        }
    );
    if !args.vips.is_empty() {
        d.time_vips(iface, &args.vips)?;
        info!(
            "huddle agent: timing requests to {} from arrival to first answer byte on {iface} (huddle_agent_ttfb_seconds)",
            args.vips
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(d)
}

/// `/metrics`: the host's figures, and the decap program's counters and
/// request timings when it runs.
fn page(decap: Option<&Mutex<Decap>>) -> http::Answer {
    let mut text = match current() {
        Ok(t) => t,
        Err(e) => return (500, "text/plain", format!("{e:#}\n")),
    };
    if let Some(d) = decap {
        let d = lock(d);
        let ttfb: Result<Vec<_>> = (0..d.vips.len() as u32)
            .map(|i| Ok((d.vips[i as usize], d.ttfb(i)?)))
            .collect();
        match (d.stats(), ttfb) {
            (Ok(st), Ok(t)) => {
                text.push_str(&render_decap(&st));
                text.push_str(&render_ttfb(&t));
            }
            (Err(e), _) | (_, Err(e)) => return (500, "text/plain", format!("{e:#}\n")),
        }
    }
    (200, "text/plain; version=0.0.4", text)
}

fn lock(d: &Mutex<Decap>) -> std::sync::MutexGuard<'_, Decap> {
    d.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The decap program's counters as Prometheus text.
#[must_use]
pub fn render_decap(st: &DecapStats) -> String {
    let mut out = String::from(
        "# HELP huddle_decap_packets_total IP-in-IP packets the decap program saw, by what it did.\n# TYPE huddle_decap_packets_total counter\n",
    );
    st.for_each(|name, v| {
        let _ = writeln!(out, "huddle_decap_packets_total{{result=\"{name}\"}} {v}");
    });
    out
}

/// The time to first byte of each VIP's requests as a Prometheus
/// histogram, on the kernel's own bucket bounds.
#[must_use]
pub fn render_ttfb(per_vip: &[(IpAddr, AgentTtfb)]) -> String {
    let mut out = String::from(
        "# HELP huddle_agent_ttfb_seconds Time from a request's arrival at this backend to the first byte of its answer leaving, per DSR VIP.\n# TYPE huddle_agent_ttfb_seconds histogram\n",
    );
    for (vip, t) in per_vip {
        let mut cumulative = 0;
        for (b, n) in t.hist.buckets.iter().enumerate().take(LATENCY_BUCKETS - 1) {
            cumulative += n;
            let le = bucket_bounds(b).1 as f64 / 1e9;
            let _ = writeln!(
                out,
                "huddle_agent_ttfb_seconds_bucket{{vip=\"{vip}\",le=\"{le}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "huddle_agent_ttfb_seconds_bucket{{vip=\"{vip}\",le=\"+Inf\"}} {}\nhuddle_agent_ttfb_seconds_sum{{vip=\"{vip}\"}} {}\nhuddle_agent_ttfb_seconds_count{{vip=\"{vip}\"}} {}",
            t.count,
            t.sum_ns as f64 / 1e9,
            t.count
        );
    }
    out
}

/// This host's addresses, both families.
fn local_ips() -> Result<Vec<std::net::IpAddr>> {
    let v4 = crate::sys::addresses::ipv4_addrs()?
        .into_iter()
        .map(|(_, a)| a.into());
    let v6 = crate::sys::addresses::ipv6_addrs()?
        .into_iter()
        .map(|(_, a)| a.into());
    Ok(v4.chain(v6).collect())
}

/// The subnets `iface` is on, as prefixes: the default outer sources to
/// unwrap (a balancer on the backend's own segment).
fn subnets(iface: &str) -> Result<Vec<crate::config::IpPrefix>> {
    let nets: Vec<_> = crate::sys::addresses::interface_prefixes(iface)?
        .into_iter()
        .filter(|(a, _)| !matches!(a, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80))
        .map(|(addr, len)| crate::config::IpPrefix { addr, len })
        .collect();
    if nets.is_empty() {
        anyhow::bail!("--decap {iface}: the interface has no address, so no subnet to take IP-in-IP from; give the balancers' addresses with --allow");
    }
    Ok(nets)
}

/// The interface of the main table's default route, if any.
fn default_route_iface() -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    crate::sys::addresses::route_of(&table, Ipv4Addr::new(192, 0, 2, 1)).map(|(i, _)| i)
}

fn sysctl(path: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{path}"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What keeps DSR packets from reaching the backend's service here, one
/// line each: a VIP that is not a local address, strict reverse-path
/// filtering against the clients' route, no decap, ARP answered for a
/// VIP.
#[must_use]
pub fn setup_problems(iface: Option<&str>, decap: bool, vips: &[IpAddr]) -> Vec<String> {
    let mut out = Vec::new();
    let local = crate::sys::addresses::ip_addrs().unwrap_or_default();
    for vip in vips {
        if !local.iter().any(|(_, a)| a == vip) {
            let len = if vip.is_ipv4() { 32 } else { 128 };
            out.push(format!(
                "VIP {vip} is not an address of this host, so its DSR packets are dropped here: `ip addr add {vip}/{len} dev lo`"
            ));
        }
    }
    if !decap && !std::path::Path::new("/sys/class/net/tunl0").exists() {
        out.push(
            "no IP-in-IP decap on this host: fine for dsr-l2; for dsr-ipip run `huddle agent --decap IFACE` (or load the ipip module)".into(),
        );
    }
    let Some(iface) = iface else {
        return out;
    };
    let strict = [
        sysctl("all/rp_filter"),
        sysctl(&format!("{iface}/rp_filter")),
    ]
    .into_iter()
    .flatten()
    .max()
        == Some(1);
    let default = default_route_iface();
    if strict && default.as_deref() != Some(iface) {
        out.push(format!(
            "rp_filter is strict on {iface} and clients are not routed back through it (default route: {}): the kernel drops their packets; `sysctl -w net.ipv4.conf.{iface}.rp_filter=2 net.ipv4.conf.all.rp_filter=2`",
            default.as_deref().unwrap_or("none")
        ));
    }
    let arp_ignore = [
        sysctl("all/arp_ignore"),
        sysctl(&format!("{iface}/arp_ignore")),
    ]
    .into_iter()
    .flatten()
    .max()
    .unwrap_or(0);
    // IPv6 answers neighbour solicitations only for the interface's own
    // addresses, so only IPv4 VIPs can be given away this way.
    let on_lo: Vec<&IpAddr> = vips
        .iter()
        .filter(|v| v.is_ipv4() && local.iter().any(|(n, a)| a == *v && n != iface))
        .collect();
    if arp_ignore == 0 && !on_lo.is_empty() {
        out.push(format!(
            "this host answers ARP on {iface} for VIP {}: with dsr-l2 on the VIP's own subnet it takes the VIP from the balancer; `sysctl -w net.ipv4.conf.{iface}.arp_ignore=1 net.ipv4.conf.{iface}.arp_announce=2`",
            on_lo[0]
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::scrape::{parse, HostTracker};

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
