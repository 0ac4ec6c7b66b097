//! Host CPU and memory of a backend from its Prometheus text endpoint,
//! using node_exporter's metric names so an existing node_exporter works
//! unchanged (`huddle agent` serves the same names).
//!
//! CPU utilisation is a rate: 1 - (idle seconds gained) / (all seconds
//! gained) between two scrapes. Anything unusable (missing, NaN, negative,
//! counters running backwards, absurd sizes) makes that term unknown for
//! this scrape rather than an error.

/// The raw figures of one scrape.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostSample {
    /// Sum over CPUs of `node_cpu_seconds_total{mode="idle"}`.
    pub cpu_idle_s: Option<f64>,
    /// Sum over CPUs and modes of `node_cpu_seconds_total`.
    pub cpu_total_s: Option<f64>,
    pub mem_available: Option<f64>,
    pub mem_total: Option<f64>,
}

/// Parses Prometheus text format, keeping only what the huddle uses.
#[must_use]
pub fn parse(text: &str) -> HostSample {
    let mut s = HostSample::default();
    let mut idle = 0.0;
    let mut total = 0.0;
    let mut cpu_ok = true;
    let mut cpu_seen = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = split(line) else {
            continue;
        };
        match name {
            "node_cpu_seconds_total" => {
                cpu_seen = true;
                if !(value.is_finite() && value >= 0.0) {
                    cpu_ok = false;
                    continue;
                }
                total += value;
                if label(labels, "mode") == Some("idle") {
                    idle += value;
                }
            }
            "node_memory_MemAvailable_bytes" => s.mem_available = sane(value),
            "node_memory_MemTotal_bytes" => s.mem_total = sane(value),
            _ => {}
        }
    }
    if cpu_seen && cpu_ok && total.is_finite() {
        s.cpu_idle_s = Some(idle);
        s.cpu_total_s = Some(total);
    }
    s
}

/// The agent's time-to-first-byte samples of one VIP, as of one scrape
/// (cumulative).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AgentSample {
    pub count: u64,
    pub sum_ns: u64,
}

/// `huddle_agent_ttfb_seconds` of VIP `vip` (its address) in `text`, as
/// `huddle agent` exports it; `None` when the page has none (a plain
/// node_exporter) or only nonsense.
#[must_use]
pub fn agent_ttfb(text: &str, vip: &str) -> Option<AgentSample> {
    let (mut count, mut sum) = (None, None);
    for line in text.lines() {
        let Some((name, labels, value)) = split(line.trim()) else {
            continue;
        };
        if label(labels, "vip") != Some(vip) {
            continue;
        }
        match name {
            "huddle_agent_ttfb_seconds_count" => count = sane(value),
            "huddle_agent_ttfb_seconds_sum" => sum = sane(value),
            _ => {}
        }
    }
    Some(AgentSample {
        count: count? as u64,
        sum_ns: (sum? * 1e9) as u64,
    })
}

/// A non-negative finite value below 2^60 (no host has more bytes).
fn sane(v: f64) -> Option<f64> {
    (v.is_finite() && v >= 0.0 && v < (1u64 << 60) as f64).then_some(v)
}

/// `name{labels} value [timestamp]` -> (name, labels, value).
fn split(line: &str) -> Option<(&str, &str, f64)> {
    let (name, labels, rest) = match line.find('{') {
        Some(i) => {
            let close = line[i..].find('}')? + i;
            (&line[..i], &line[i + 1..close], &line[close + 1..])
        }
        None => {
            let i = line.find(char::is_whitespace)?;
            (&line[..i], "", &line[i..])
        }
    };
    let value = rest.split_whitespace().next()?;
    let v = match value {
        "NaN" => f64::NAN,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name.trim(), labels, v))
}

/// The value of label `key` in `a="x",b="y"`.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Utilisation figures derived from successive scrapes of one host.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostTracker {
    last: Option<HostSample>,
    pub cpu: Option<f64>,
    pub memory: Option<f64>,
}

impl HostTracker {
    /// Takes a new scrape; updates `cpu` (when a previous one allows a
    /// rate) and `memory`.
    pub fn update(&mut self, s: HostSample) {
        self.memory = match (s.mem_available, s.mem_total) {
            (Some(a), Some(t)) if t > 0.0 && a <= t => Some(1.0 - a / t),
            _ => None,
        };
        let prev = self.last.replace(s);
        self.cpu = match (prev, s.cpu_idle_s, s.cpu_total_s) {
            (Some(p), Some(idle), Some(total)) => match (p.cpu_idle_s, p.cpu_total_s) {
                (Some(pi), Some(pt)) => {
                    let (di, dt) = (idle - pi, total - pt);
                    (dt > 0.0 && di >= 0.0 && di <= dt).then(|| 1.0 - di / dt)
                }
                _ => None,
            },
            _ => None,
        };
    }

    /// Forgets everything (the endpoint failed).
    pub fn clear(&mut self) {
        *self = HostTracker::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exporter(idle: f64, user: f64) -> String {
        format!(
            "# HELP node_cpu_seconds_total Seconds the CPUs spent in each mode.\n\
             # TYPE node_cpu_seconds_total counter\n\
             node_cpu_seconds_total{{cpu=\"0\",mode=\"idle\"}} {idle}\n\
             node_cpu_seconds_total{{cpu=\"0\",mode=\"user\"}} {user}\n\
             node_cpu_seconds_total{{cpu=\"1\",mode=\"idle\"}} {idle}\n\
             node_cpu_seconds_total{{cpu=\"1\",mode=\"user\"}} {user}\n\
             node_memory_MemAvailable_bytes 2.5e+09\n\
             node_memory_MemTotal_bytes 1e+10\n"
        )
    }

    #[test]
    fn node_exporter_text_gives_cpu_rate_and_memory() {
        let mut t = HostTracker::default();
        t.update(parse(&exporter(100.0, 100.0)));
        assert_eq!(t.cpu, None, "a rate needs two scrapes");
        assert_eq!(t.memory, Some(0.75));
        t.update(parse(&exporter(101.0, 104.0)));
        let cpu = t.cpu.unwrap();
        assert!((cpu - 0.8).abs() < 1e-9, "{cpu}");
    }

    #[test]
    fn the_agents_ttfb_is_read_for_its_vip_only() {
        let page = "huddle_agent_ttfb_seconds_bucket{vip=\"10.0.0.1\",le=\"+Inf\"} 4\n\
                    huddle_agent_ttfb_seconds_sum{vip=\"10.0.0.1\"} 0.04\n\
                    huddle_agent_ttfb_seconds_count{vip=\"10.0.0.1\"} 4\n\
                    huddle_agent_ttfb_seconds_sum{vip=\"10.0.0.2\"} 9\n\
                    huddle_agent_ttfb_seconds_count{vip=\"10.0.0.2\"} 1\n";
        assert_eq!(
            agent_ttfb(page, "10.0.0.1"),
            Some(AgentSample {
                count: 4,
                sum_ns: 40_000_000
            })
        );
        assert_eq!(agent_ttfb(page, "10.0.0.9"), None);
        assert_eq!(agent_ttfb(&exporter(1.0, 1.0), "10.0.0.1"), None);
        assert_eq!(
            agent_ttfb(
                "huddle_agent_ttfb_seconds_count{vip=\"10.0.0.1\"} NaN\n",
                "10.0.0.1"
            ),
            None
        );
    }

    #[test]
    fn garbage_and_nonsense_give_unknown_not_errors() {
        let mut t = HostTracker::default();
        for text in [
            "",
            "garbage\n{{{\n",
            "node_cpu_seconds_total{mode=\"idle\"} NaN\nnode_memory_MemTotal_bytes -5\n",
            "node_memory_MemAvailable_bytes 1e300\nnode_memory_MemTotal_bytes 1e301\n",
            "node_memory_MemAvailable_bytes 20\nnode_memory_MemTotal_bytes 10\n",
        ] {
            t.update(parse(text));
            assert_eq!((t.cpu, t.memory), (None, None), "{text:?}");
        }
        // Counters that run backwards (exporter restart): unknown once.
        t.update(parse(&exporter(100.0, 100.0)));
        t.update(parse(&exporter(50.0, 50.0)));
        assert_eq!(t.cpu, None);
    }
}
