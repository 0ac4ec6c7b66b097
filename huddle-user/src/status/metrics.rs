//! The Prometheus endpoint: the same figures as `huddle status` (rings,
//! temperatures and their terms, latency, errors), every kernel counter,
//! and each backend's time to first byte as a real histogram built from
//! the kernel's log-linear buckets, so `histogram_quantile` works and
//! several balancers' figures can be summed. OpenMetrics text from the
//! `prometheus-client` crate (escaping, HELP, TYPE, `_total`, EOF).

use crate::status::{BackendStatus, ServiceStatus, Status};
use huddle_common::{latency::bucket_bounds, Latency, LATENCY_BUCKETS};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, NoLabelSet},
    metrics::{exemplar::Exemplar, MetricType},
    registry::Registry,
};
use std::sync::Arc;

pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Everything one scrape shows, taken by one tick.
#[derive(Debug)]
pub struct Snapshot {
    pub status: Status,
    /// What the page shows per backend.
    pub per_backend: crate::config::BackendMetrics,
    /// Whether `ttfb` (and, when `per_backend` shows them, `connect`)
    /// were read: a status call's snapshot skips them.
    pub histograms: bool,
    /// Its status has no backend's entry (`/metrics` past 8,192 backends).
    pub lean: bool,
    /// Per backend (service, backend) with `per_backend` `All`, else one
    /// a service (backend ""): time to first byte and connect time.
    pub ttfb: Vec<(String, String, Histogram)>,
    pub connect: Vec<(String, String, Histogram)>,
}

/// A latency histogram in Prometheus form: (upper bound in seconds, count
/// in that bucket alone), the last bound `f64::MAX` (+Inf); the sum in
/// seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, u64)>,
    pub sum: f64,
    pub count: u64,
}

/// Largest finite bucket bound: 2^36 ns, about 69 s.
const TOP_SHIFT: u32 = 36;

impl Histogram {
    /// The kernel's 4-per-power-of-two buckets merged into one per power
    /// of two (the merge is exact: every fourth kernel bound is a power of
    /// two), from 1 µs to about 69 s, then +Inf. `sum_ns` is the kernel's
    /// summed time of the same samples.
    #[must_use]
    pub fn from_kernel(lat: &Latency, sum_ns: u64) -> Histogram {
        let mut buckets: Vec<(f64, u64)> = Vec::new();
        let mut pending = 0;
        for (b, n) in lat.buckets.iter().enumerate().take(LATENCY_BUCKETS) {
            pending += n;
            let hi = bucket_bounds(b).1;
            if hi.is_power_of_two() && hi <= 1 << TOP_SHIFT {
                buckets.push((hi as f64 / 1e9, pending));
                pending = 0;
            }
        }
        buckets.push((f64::MAX, pending));
        let count = buckets.iter().map(|b| b.1).sum();
        Histogram {
            buckets,
            sum: sum_ns as f64 / 1e9,
            count,
        }
    }
}

/// The whole exposition, ending in `# EOF`.
#[must_use]
pub fn render(snapshot: impl Into<Arc<Snapshot>>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Page(snapshot.into())));
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// A kernel counter's exposed name and value: nanosecond sums become
/// seconds, as Prometheus names units.
fn counter(name: &str, value: u64) -> (String, f64) {
    match name.strip_suffix("_ns") {
        Some(base) => (format!("{base}_seconds"), value as f64 / 1e9),
        None => (name.to_string(), value as f64),
    }
}

type Encoded = Result<(), std::fmt::Error>;

/// A shared snapshot as the registry's collector: the daemon publishes one
/// snapshot to every reader that asked for it in the same tick.
#[derive(Debug)]
struct Page(Arc<Snapshot>);

impl Collector for Page {
    fn encode(&self, enc: DescriptorEncoder) -> Encoded {
        self.0.encode(enc)
    }
}

fn no_exemplar() -> Option<&'static Exemplar<NoLabelSet, f64>> {
    None
}

/// One family with a sample per backend (labels service, backend); a
/// backend for which `get` has no value is left out.
fn per_backend(
    enc: &mut DescriptorEncoder,
    st: &Status,
    name: &str,
    kind: MetricType,
    help: &str,
    get: impl Fn(&BackendStatus) -> Option<f64>,
) -> Encoded {
    let mut family = enc.encode_descriptor(name, help, None, kind)?;
    for s in &st.services {
        for b in &s.backends {
            let Some(v) = get(b) else { continue };
            let labels = [("service", s.name.as_str()), ("backend", b.addr.as_str())];
            let mut m = family.encode_family(&labels)?;
            match kind {
                MetricType::Counter => m.encode_counter(&v, no_exemplar())?,
                _ => m.encode_gauge(&v)?,
            }
        }
    }
    Ok(())
}

/// One family with a sample per service (label service).
fn per_service(
    enc: &mut DescriptorEncoder,
    st: &Status,
    name: &str,
    kind: MetricType,
    help: &str,
    get: impl Fn(&ServiceStatus) -> f64,
) -> Encoded {
    let mut family = enc.encode_descriptor(name, help, None, kind)?;
    for s in &st.services {
        let labels = [("service", s.name.as_str())];
        let mut m = family.encode_family(&labels)?;
        let v = get(s);
        match kind {
            MetricType::Counter => m.encode_counter(&v, no_exemplar())?,
            _ => m.encode_gauge(&v)?,
        }
    }
    Ok(())
}

const KERNEL: &str = "Kernel counter, summed over CPUs.";

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Encoded {
        use crate::config::BackendMetrics;
        let st = &self.status;
        if self.per_backend != BackendMetrics::None {
            backend_gauges(&mut enc, st)?;
        }
        if self.per_backend == BackendMetrics::All {
            self.histograms(&mut enc)?;
            backend_counters(&mut enc, st)?;
        }
        self.service_histograms(&mut enc)?;
        service_families(&mut enc, st)?;
        global_counters(&mut enc, st)?;
        control(&mut enc, st)
    }
}

/// The control plane's own cost: tick durations and probes sent.
fn control(enc: &mut DescriptorEncoder, st: &Status) -> Encoded {
    let labels = [("interface", st.interface.as_str())];
    let c = &st.control;
    let mut family = enc.encode_descriptor(
        "huddle_tick_seconds",
        "How long the huddle's ticks took: quantiles of the last 600.",
        None,
        MetricType::Gauge,
    )?;
    for (q, v) in [
        ("0.5", c.tick_p50_ms),
        ("0.99", c.tick_p99_ms),
        ("1", c.tick_max_ms),
    ] {
        family
            .encode_family(&[("interface", st.interface.as_str()), ("quantile", q)])?
            .encode_gauge(&(v / 1e3))?;
    }
    let mut family = enc.encode_descriptor(
        "huddle_kernel_map_bytes",
        "Kernel memory of the data plane's maps.",
        None,
        MetricType::Gauge,
    )?;
    family
        .encode_family(&labels)?
        .encode_gauge(&(c.map_bytes as f64))?;
    let mut family = enc.encode_descriptor(
        "huddle_probes",
        "Health probes sent.",
        None,
        MetricType::Counter,
    )?;
    family
        .encode_family(&labels)?
        .encode_counter(&(c.probes_sent as f64), no_exemplar())?;
    for (name, help, n) in [
        (
            "huddle_hang_suspicions_cleared",
            "Suspected hangs cleared: the backend answered a probe sent at once.",
            c.hangs_cleared,
        ),
        (
            "huddle_hang_suspicions_confirmed",
            "Suspected hangs confirmed: the probe sent at once failed too.",
            c.hangs_confirmed,
        ),
    ] {
        let mut family = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
        family
            .encode_family(&labels)?
            .encode_counter(&(n as f64), no_exemplar())?;
    }
    Ok(())
}

/// The gauge per backend for each term and figure of `huddle status`,
/// and its rotations.
fn backend_gauges(enc: &mut DescriptorEncoder, st: &Status) -> Encoded {
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
        per_backend(enc, st, name, MetricType::Gauge, help, get)?;
    }
    per_backend(
        enc,
        st,
        "huddle_backend_rotations",
        MetricType::Counter,
        "Moves between the inner and outer ring.",
        |b| Some(b.rotations as f64),
    )?;
    Ok(())
}

impl Snapshot {
    /// Each service's time to first byte over its backends (what a
    /// dashboard of thousands of backends plots).
    fn service_histograms(&self, enc: &mut DescriptorEncoder) -> Encoded {
        let mut family = enc.encode_descriptor(
            "huddle_service_ttfb_seconds",
            "Time to first byte of every request turn the kernel timed, over the service's backends.",
            None,
            MetricType::Histogram,
        )?;
        let mut sums: Vec<(&str, Histogram)> = Vec::new();
        for (service, _, h) in &self.ttfb {
            match sums.last_mut() {
                Some((s, sum))
                    if *s == service.as_str() && sum.buckets.len() == h.buckets.len() =>
                {
                    for (a, b) in sum.buckets.iter_mut().zip(&h.buckets) {
                        a.1 += b.1;
                    }
                    sum.sum += h.sum;
                    sum.count += h.count;
                }
                _ => sums.push((service.as_str(), h.clone())),
            }
        }
        for (service, h) in sums {
            family
                .encode_family(&[("service", service)])?
                .encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)?;
        }
        Ok(())
    }

    /// Each backend's time to first byte and connect time, as histograms.
    fn histograms(&self, enc: &mut DescriptorEncoder) -> Encoded {
        for (name, help, hists) in [
                (
                    "huddle_backend_ttfb_seconds",
                    "Time to first byte of every request turn the kernel timed (from the client's data to the backend's first data back).",
                    &self.ttfb,
                ),
                (
                    "huddle_backend_connect_seconds",
                    "Connect time of every connection the kernel timed (from the client's SYN to the backend's SYN-ACK).",
                    &self.connect,
                ),
            ] {
                let mut family = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
                for (service, backend, h) in hists {
                    let labels = [("service", service.as_str()), ("backend", backend.as_str())];
                    family.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
                        h.sum,
                        h.count,
                        &h.buckets,
                        None,
                    )?;
                }
            }
        Ok(())
    }
}

/// Every kernel counter per backend, one family each (the summed times to
/// first byte and of connects are the histograms' sums).
fn backend_counters(enc: &mut DescriptorEncoder, st: &Status) -> Encoded {
    let mut names: Vec<&str> = st
        .services
        .iter()
        .flat_map(|s| s.backends.iter().flat_map(|b| b.counters.keys()))
        .map(AsRef::as_ref)
        .filter(|c| *c != "ttfb_ns" && *c != "connect_ns")
        .collect();
    names.sort();
    names.dedup();
    for c in names {
        let (name, _) = counter(c, 0);
        per_backend(
            enc,
            st,
            &format!("huddle_backend_{name}"),
            MetricType::Counter,
            KERNEL,
            |b| Some(counter(c, b.counters.get(c).copied().unwrap_or(0)).1),
        )?;
    }
    Ok(())
}

/// The ring, panic and kernel counters per service.
fn service_families(enc: &mut DescriptorEncoder, st: &Status) -> Encoded {
    per_service(
        enc,
        st,
        "huddle_service_inner_size",
        MetricType::Gauge,
        "Backends in the live ring.",
        |s| s.ring.len() as f64,
    )?;
    per_service(
        enc,
        st,
        "huddle_service_panic",
        MetricType::Gauge,
        "1 while too few healthy backends remain.",
        |s| f64::from(u8::from(s.panic)),
    )?;
    per_service(
        enc,
        st,
        "huddle_service_ring_generation",
        MetricType::Counter,
        "Ring swaps written to the kernel.",
        |s| s.ring_generation as f64,
    )?;
    if let Some(first) = st.services.first() {
        for c in first.counters.keys() {
            per_service(
                enc,
                st,
                &format!("huddle_service_{c}"),
                MetricType::Counter,
                KERNEL,
                |s| s.counters.get(c).copied().unwrap_or(0) as f64,
            )?;
        }
    }
    Ok(())
}

/// The interface's global kernel counters.
fn global_counters(enc: &mut DescriptorEncoder, st: &Status) -> Encoded {
    for (c, v) in &st.global {
        let name = format!("huddle_{c}");
        let mut family = enc.encode_descriptor(&name, KERNEL, None, MetricType::Counter)?;
        let labels = [("interface", st.interface.as_str())];
        family
            .encode_family(&labels)?
            .encode_counter(&(*v as f64), no_exemplar())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use huddle_common::latency_bucket;

    #[test]
    fn kernel_buckets_merge_into_powers_of_two_with_nothing_lost() {
        let mut lat = Latency::default();
        // 3 ms and 5 ms samples, and one of 2 minutes (past the last
        // finite bound).
        for ns in [3_000_000u64, 3_100_000, 5_000_000, 120_000_000_000] {
            lat.buckets[latency_bucket(ns)] += 1;
        }
        let h = Histogram::from_kernel(&lat, 11_100_000 + 120_000_000_000);
        assert_eq!(h.count, 4);
        assert!((h.sum - 120.0111).abs() < 1e-9);
        let le = |s: f64| -> u64 {
            h.buckets
                .iter()
                .filter(|(b, _)| *b <= s)
                .map(|(_, n)| n)
                .sum()
        };
        // 2^22 ns = 4.19 ms holds the two 3 ms samples; 2^23 the 5 ms one.
        assert_eq!(le(0.002_097_152), 0);
        assert_eq!(le(0.004_194_304), 2);
        assert_eq!(le(0.008_388_608), 3);
        assert_eq!(h.buckets.last(), Some(&(f64::MAX, 1)));
        // 1 µs (2^10 ns), then one bound per power of two up to 2^36.
        assert_eq!(h.buckets.len(), 1 + 26 + 1);
        assert!(h.buckets.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn nanosecond_counters_are_exposed_in_seconds() {
        assert_eq!(
            counter("connect_ns", 2_500_000_000),
            ("connect_seconds".into(), 2.5)
        );
        assert_eq!(counter("pkts_to", 7), ("pkts_to".into(), 7.0));
    }
}
