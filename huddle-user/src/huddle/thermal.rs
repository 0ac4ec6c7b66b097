//! A backend's temperature: an EMA of a raw score in [0, 1] built from its
//! latency anomaly, host CPU and memory, and its error rate plus
//! connection load. Pure arithmetic; the daemon feeds it one reading per
//! backend per tick.
//!
//! Every input is sanitised: a NaN, infinite or negative reading counts as
//! unknown (0), so no input can make a temperature NaN or leave [0, 1].

use crate::config::tuning::ThermalParams;
use serde::{Deserialize, Serialize};

/// One tick's signals of one backend. `None`: not known this tick.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reading {
    /// Mean latency (request or probe, see the daemon) in ms.
    pub latency_ms: Option<f64>,
    /// Host CPU and memory utilisation, 0..1.
    pub cpu: Option<f64>,
    pub memory: Option<f64>,
    /// Failed attempts over attempts, 0..1.
    pub error_rate: f64,
    /// Active flows over capacity, 0..1.
    pub load: f64,
}

/// The terms of a raw score, each in [0, 1], and the score.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Components {
    pub anomaly: f64,
    pub cpu: f64,
    pub memory: f64,
    pub errors: f64,
    pub load: f64,
    pub raw: f64,
}

/// `x` if it is a finite number, clamped to [0, 1]; else 0.
#[must_use]
pub fn unit(x: f64) -> f64 {
    if x.is_finite() {
        x.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// 0 at the median, rising linearly to 1 at `full_ratio` x the median.
#[must_use]
pub fn anomaly(latency_ms: f64, median_ms: f64, p: &ThermalParams) -> f64 {
    if !latency_ms.is_finite() || latency_ms < 0.0 {
        return 0.0;
    }
    if p.ceiling_ms.is_some_and(|c| latency_ms > c) {
        return 1.0;
    }
    if !median_ms.is_finite() || median_ms <= 0.0 {
        return 0.0;
    }
    let span = (p.full_anomaly_ratio - 1.0).max(f64::EPSILON);
    let base = median_ms.max(p.floor_ms);
    unit((latency_ms / base - 1.0) / span)
}

/// The raw score of `r` against the inner ring's median latency.
#[must_use]
pub fn score(r: &Reading, median_ms: Option<f64>, p: &ThermalParams) -> Components {
    let a = match (r.latency_ms, median_ms) {
        (Some(l), Some(m)) => anomaly(l, m, p),
        (Some(l), None) => anomaly(l, f64::NAN, p),
        _ => 0.0,
    };
    let c = Components {
        anomaly: a,
        cpu: r.cpu.map_or(0.0, unit),
        memory: r.memory.map_or(0.0, unit),
        errors: unit(r.error_rate),
        load: unit(r.load),
        raw: 0.0,
    };
    let w = &p.weights;
    let raw =
        w.latency * c.anomaly + w.cpu * c.cpu + w.memory * c.memory + w.load * (c.errors + c.load);
    Components {
        raw: unit(raw),
        ..c
    }
}

/// The next temperature: EMA of raw scores.
#[must_use]
pub fn ema(previous: f64, raw: f64, alpha: f64) -> f64 {
    let a = unit(alpha);
    unit(a * unit(raw) + (1.0 - a) * unit(previous))
}

/// Median of finite values; `None` if there are none.
#[must_use]
pub fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anomaly_follows_the_published_mapping() {
        let p = ThermalParams::default();
        assert_eq!(anomaly(10.0, 10.0, &p), 0.0);
        assert!((anomaly(20.0, 10.0, &p) - 0.5).abs() < 1e-12);
        assert_eq!(anomaly(30.0, 10.0, &p), 1.0);
        assert_eq!(anomaly(300.0, 100.0, &p), 1.0, "scale free");
        assert_eq!(anomaly(5.0, 10.0, &p), 0.0, "faster than median");
        assert_eq!(
            anomaly(0.9, 0.1, &p),
            0.0,
            "sub-millisecond jitter is no anomaly"
        );
        assert_eq!(anomaly(3.0, 0.1, &p), 1.0, "3 ms against the 1 ms floor");
        let c = ThermalParams {
            ceiling_ms: Some(50.0),
            ..p
        };
        assert_eq!(anomaly(60.0, 60.0, &c), 1.0, "ceiling beats the median");
    }

    #[test]
    fn a_5x_slow_backend_crosses_the_default_heat_in_two_ticks() {
        let p = ThermalParams::default();
        let r = Reading {
            latency_ms: Some(50.0),
            ..Reading::default()
        };
        let raw = score(&r, Some(10.0), &p).raw;
        assert!((raw - 0.7).abs() < 1e-12);
        let t1 = ema(0.0, raw, p.alpha);
        let t2 = ema(t1, raw, p.alpha);
        assert!(t1 < 0.55 && t2 >= 0.55, "{t1} {t2}");
    }

    #[test]
    fn garbage_never_makes_a_temperature_nan_or_out_of_range() {
        let p = ThermalParams::default();
        let bad = [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -1.0,
            1e300,
            -0.0,
        ];
        let mut t = 0.5;
        for &x in &bad {
            for &m in &bad {
                let r = Reading {
                    latency_ms: Some(x),
                    cpu: Some(x),
                    memory: Some(m),
                    error_rate: x,
                    load: m,
                };
                let c = score(&r, Some(m), &p);
                for v in [c.anomaly, c.cpu, c.memory, c.errors, c.load, c.raw] {
                    assert!((0.0..=1.0).contains(&v), "{c:?}");
                }
                t = ema(t, c.raw, x);
                assert!((0.0..=1.0).contains(&t));
            }
        }
        assert_eq!(median([f64::NAN, 3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([f64::NAN]), None);
        assert_eq!(median([1.0, 2.0]), Some(1.5));
    }
}
