//! The `[huddle]` table validated: the huddle's settings, the keys it
//! still reads under their old names, and the small checks of durations
//! and fractions every table uses.

use super::checks::{fraction, millis};
use super::{
    file::HuddleFile,
    model::*,
    tuning::{RotationParams, ThermalParams},
};
use anyhow::{bail, Context, Result};
use std::{net::SocketAddr, time::Duration};

/// Request samples a backend's latency window holds at least (over its
/// newest ticks) before its median is trusted: with 3, one or two long
/// turns among a tick's few samples (a long poll, a slow endpoint) moved
/// the median of a healthy backend now and then on mixed traffic.
pub const DEFAULT_MIN_SAMPLES: u64 = 10;

/// The `[huddle]` table: each group of settings checked by its own step.
pub(super) fn validate_huddle(h: &HuddleFile) -> Result<Huddle> {
    let (hung_after, hung_after_min) = hung(h)?;
    Ok(Huddle {
        rotation: h.rotation.unwrap_or(true),
        tick: millis(h.tick_ms, 100, "huddle.tick_ms", 10, 60_000)?,
        thermal: thermal(h)?,
        rotation_params: rotation(h)?,
        hung_after,
        hung_after_min,
        hung_after_p99: match h.hung_after_p99 {
            None => 5.0,
            Some(k) if k.is_finite() && (1.0..=1000.0).contains(&k) => k,
            Some(k) => bail!("huddle.hung_after_p99: {k} is outside 1..=1000"),
        },
        pass_over_owing: h.pass_over_owing.unwrap_or(true),
        two_choices: h.two_choices.unwrap_or(false),
        syn_timeout: millis(h.syn_timeout_ms, 300, "huddle.syn_timeout_ms", 10, 600_000)?,
        error_threshold: fraction(h.error_threshold, 0.5, "huddle.error_threshold", true)?,
        min_samples: h.min_samples.unwrap_or(DEFAULT_MIN_SAMPLES).max(1),
        move_flows_off_dead: h.move_flows_off_dead.unwrap_or(false),
        listen: listen(h)?,
        scrape_interval: millis(
            h.scrape_interval_ms,
            1000,
            "huddle.scrape_interval_ms",
            50,
            600_000,
        )?,
        scrape_timeout: millis(
            h.scrape_timeout_ms,
            500,
            "huddle.scrape_timeout_ms",
            10,
            60_000,
        )?,
        probe: super::probe::global(h)?,
        metrics_per_backend: h.metrics_per_backend.unwrap_or_default(),
    })
}

/// How long a backend may owe an answer before it counts as hung: the
/// ceiling and the floor of the p99-based wait.
fn hung(h: &HuddleFile) -> Result<(Duration, Duration)> {
    let hung_after = millis(h.hung_after_ms, 200, "huddle.hung_after_ms", 10, 600_000)?;
    let hung_after_min = millis(
        h.hung_after_min_ms,
        50.min(hung_after.as_millis() as u64),
        "huddle.hung_after_min_ms",
        10,
        600_000,
    )?;
    if hung_after_min > hung_after {
        bail!(
            "huddle.hung_after_min_ms: {} is above huddle.hung_after_ms ({})",
            hung_after_min.as_millis(),
            hung_after.as_millis()
        );
    }
    Ok((hung_after, hung_after_min))
}

/// The temperature: weights, smoothing and the latency scale.
fn thermal(h: &HuddleFile) -> Result<ThermalParams> {
    let td = ThermalParams::default();
    let weights = h.weights.unwrap_or_default();
    for (name, w) in [
        ("latency", weights.latency),
        ("cpu", weights.cpu),
        ("memory", weights.memory),
        ("load", weights.load),
    ] {
        if !w.is_finite() || !(0.0..=10.0).contains(&w) {
            bail!("huddle.weights.{name}: {w} must be in [0, 10]");
        }
    }
    let ratio = h.full_anomaly_ratio.unwrap_or(td.full_anomaly_ratio);
    if !ratio.is_finite() || ratio <= 1.0 || ratio > 1000.0 {
        bail!("huddle.full_anomaly_ratio: {ratio} must be above 1");
    }
    if let Some(c) = h.latency_ceiling_ms {
        if !c.is_finite() || c <= 0.0 {
            bail!("huddle.latency_ceiling_ms: {c} must be a positive number");
        }
    }
    let floor_ms = h.latency_floor_ms.unwrap_or(td.floor_ms);
    if !floor_ms.is_finite() || floor_ms < 0.0 {
        bail!("huddle.latency_floor_ms: {floor_ms} must be a number >= 0");
    }
    Ok(ThermalParams {
        weights,
        alpha: fraction(h.alpha, td.alpha, "huddle.alpha", true)?,
        full_anomaly_ratio: ratio,
        ceiling_ms: h.latency_ceiling_ms,
        floor_ms,
    })
}

/// The rotation: hysteresis, the inner ring's floor and rest times.
fn rotation(h: &HuddleFile) -> Result<RotationParams> {
    let rd = RotationParams::default();
    let heat = fraction(h.heat, rd.heat, "huddle.heat", true)?;
    let cool = fraction(h.cool, rd.cool, "huddle.cool", false)?;
    if cool >= heat {
        bail!("huddle.cool: {cool} must be below huddle.heat ({heat}), or backends would flap");
    }
    let min_inner = h.min_inner.unwrap_or(rd.min_inner);
    if min_inner == 0 {
        bail!("huddle.min_inner: must be at least 1 (the inner ring is never empty)");
    }
    let min_rest = millis(h.min_rest_ms, 10_000, "huddle.min_rest_ms", 0, 86_400_000)?;
    let max_rest = millis(h.max_rest_ms, 160_000, "huddle.max_rest_ms", 0, 86_400_000)?;
    if max_rest < min_rest {
        bail!("huddle.max_rest_ms: below huddle.min_rest_ms");
    }
    Ok(RotationParams {
        heat,
        cool,
        min_inner,
        cooldown: millis(h.cooldown_ms, 5000, "huddle.cooldown_ms", 0, 86_400_000)?,
        min_rest,
        max_rest,
        warmup: millis(h.warmup_ms, 0, "huddle.warmup_ms", 0, 86_400_000)?,
    })
}

/// Our own HTTP listener (`/metrics` and the cluster's pages), or none.
fn listen(h: &HuddleFile) -> Result<Option<SocketAddr>> {
    Ok(
        match h.listen.as_deref().unwrap_or(DEFAULT_METRICS_LISTEN) {
            "off" | "" => None,
            a => Some(
                a.parse::<SocketAddr>()
                    .with_context(|| format!("huddle.listen: {a:?} is not IP:PORT or \"off\""))?,
            ),
        },
    )
}

/// Moves keys set under their old names to the new ones, and says so
/// (once, at start); both names set is an error naming both.
pub(super) fn renamed(h: &mut HuddleFile) -> Result<Vec<String>> {
    let mut said = Vec::new();
    let mut carry = |old: &str, new: &str, was: bool, is: bool| -> Result<bool> {
        match (was, is) {
            (true, true) => {
                bail!("huddle.{old} and huddle.{new}: the same setting twice; keep {new}")
            }
            (true, false) => {
                said.push(format!(
                    "huddle.{old} is now huddle.{new}; the old name is read until the next release"
                ));
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    if carry(
        "metrics_listen",
        "listen",
        h.metrics_listen.is_some(),
        h.listen.is_some(),
    )? {
        h.listen = h.metrics_listen.take();
    }
    if carry(
        "metrics_interval_ms",
        "scrape_interval_ms",
        h.metrics_interval_ms.is_some(),
        h.scrape_interval_ms.is_some(),
    )? {
        h.scrape_interval_ms = h.metrics_interval_ms.take();
    }
    if carry(
        "metrics_timeout_ms",
        "scrape_timeout_ms",
        h.metrics_timeout_ms.is_some(),
        h.scrape_timeout_ms.is_some(),
    )? {
        h.scrape_timeout_ms = h.metrics_timeout_ms.take();
    }
    Ok(said)
}

/// The defaults are what validating an empty `[huddle]` gives.
impl Default for Huddle {
    fn default() -> Self {
        validate_huddle(&HuddleFile::default()).expect("the default huddle settings are valid")
    }
}
