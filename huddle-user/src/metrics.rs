//! The Prometheus endpoint: the same figures as `huddle status` (rings,
//! temperatures and their terms, latency, errors) plus every kernel
//! counter, in the text exposition format.

use crate::{
    daemon::{lock, Balancer},
    http::Answer,
    status::{BackendStatus, ServiceStatus, Status},
};
use std::{fmt::Write as _, sync::Mutex};

const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Answers a GET of `path`.
pub fn route(shared: &Mutex<Balancer>, path: &str) -> Answer {
    match path {
        "/metrics" => match lock(shared).status() {
            Ok(st) => (200, TEXT, render(&st)),
            Err(e) => (
                500,
                "text/plain",
                format!("reading the kernel's counters: {e:#}\n"),
            ),
        },
        "/" => (
            200,
            "text/plain",
            "HuddleCluster balancer: metrics at /metrics\n".into(),
        ),
        _ => (404, "text/plain", "not found: try /metrics\n".into()),
    }
}

/// A metric family being written: HELP and TYPE once, then samples.
struct Family<'a> {
    out: &'a mut String,
}

impl Family<'_> {
    fn new<'a>(out: &'a mut String, name: &str, kind: &str, help: &str) -> Family<'a> {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        Family { out }
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        let l: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
            .collect();
        let v = if value.is_finite() {
            format!("{value}")
        } else {
            "NaN".into()
        };
        let _ = writeln!(self.out, "{name}{{{}}} {v}", l.join(","));
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

const KERNEL: &str = "Kernel counter, summed over CPUs.";

/// One family with a sample per backend (labels service, backend); a
/// backend for which `get` has no value is left out.
fn backends(
    out: &mut String,
    st: &Status,
    name: &str,
    kind: &str,
    help: &str,
    get: impl Fn(&BackendStatus) -> Option<f64>,
) {
    let mut f = Family::new(out, name, kind, help);
    for s in &st.services {
        for b in &s.backends {
            if let Some(v) = get(b) {
                f.sample(name, &[("service", &s.name), ("backend", &b.addr)], v);
            }
        }
    }
}

/// One family with a sample per service (label service).
fn services(
    out: &mut String,
    st: &Status,
    name: &str,
    kind: &str,
    help: &str,
    get: impl Fn(&ServiceStatus) -> f64,
) {
    let mut f = Family::new(out, name, kind, help);
    for s in &st.services {
        f.sample(name, &[("service", &s.name)], get(s));
    }
}

/// The whole exposition.
#[must_use]
pub fn render(st: &Status) -> String {
    let mut out = String::new();
    type Get = fn(&BackendStatus) -> Option<f64>;
    let gauges: [(&str, &str, Get); 12] = [
        (
            "huddle_backend_temperature",
            "EMA of the raw score, 0..1.",
            |b| Some(b.temperature),
        ),
        (
            "huddle_backend_inner",
            "1 if the backend is in the inner ring (takes new flows).",
            |b| Some(f64::from(u8::from(b.place == "inner"))),
        ),
        (
            "huddle_backend_unhealthy",
            "1 if a health signal failed.",
            |b| Some(f64::from(u8::from(b.unhealthy.is_some()))),
        ),
        (
            "huddle_backend_latency_anomaly",
            "Latency anomaly term, 0..1.",
            |b| Some(b.components.anomaly),
        ),
        (
            "huddle_backend_cpu",
            "Host CPU utilisation from the metrics URL, 0..1.",
            |b| b.cpu,
        ),
        (
            "huddle_backend_memory",
            "Host memory utilisation from the metrics URL, 0..1.",
            |b| b.memory,
        ),
        (
            "huddle_backend_error_rate",
            "Failed share of last tick's attempts.",
            |b| Some(b.error_rate),
        ),
        (
            "huddle_backend_load",
            "Active flows over capacity, 0..1.",
            |b| Some(b.components.load),
        ),
        (
            "huddle_backend_active_flows",
            "Flows assigned minus flows seen closing.",
            |b| Some(b.active_flows as f64),
        ),
        (
            "huddle_backend_latency_p50_seconds",
            "Median time to first byte over the newest ticks.",
            |b| b.p50_ms.map(|v| v / 1e3),
        ),
        (
            "huddle_backend_latency_p99_seconds",
            "99th percentile time to first byte over the newest ticks.",
            |b| b.p99_ms.map(|v| v / 1e3),
        ),
        (
            "huddle_backend_probe_seconds",
            "Latency of the last probe.",
            |b| b.probe_ms.map(|v| v / 1e3),
        ),
    ];
    for (name, help, get) in gauges {
        backends(&mut out, st, name, "gauge", help, get);
    }
    backends(
        &mut out,
        st,
        "huddle_backend_rotations_total",
        "counter",
        "Moves between the inner and outer ring.",
        |b| Some(b.rotations as f64),
    );
    // Kernel counters, one family each.
    let mut names: Vec<&String> = st
        .services
        .iter()
        .flat_map(|s| s.backends.iter().flat_map(|b| b.counters.keys()))
        .collect();
    names.sort();
    names.dedup();
    for c in names {
        backends(
            &mut out,
            st,
            &format!("huddle_backend_{c}_total"),
            "counter",
            KERNEL,
            |b| Some(b.counters.get(c).copied().unwrap_or(0) as f64),
        );
    }
    services(
        &mut out,
        st,
        "huddle_service_inner_size",
        "gauge",
        "Backends in the live ring.",
        |s| s.ring.len() as f64,
    );
    services(
        &mut out,
        st,
        "huddle_service_panic",
        "gauge",
        "1 while too few healthy backends remain.",
        |s| f64::from(u8::from(s.panic)),
    );
    services(
        &mut out,
        st,
        "huddle_service_ring_generation",
        "counter",
        "Ring swaps written to the kernel.",
        |s| s.ring_generation as f64,
    );
    if let Some(first) = st.services.first() {
        for c in first.counters.keys() {
            services(
                &mut out,
                st,
                &format!("huddle_service_{c}_total"),
                "counter",
                KERNEL,
                |s| s.counters.get(c).copied().unwrap_or(0) as f64,
            );
        }
    }
    for (c, v) in &st.global {
        let name = format!("huddle_{c}_total");
        let mut f = Family::new(&mut out, &name, "counter", KERNEL);
        f.sample(&name, &[("interface", &st.interface)], *v as f64);
    }
    out
}
