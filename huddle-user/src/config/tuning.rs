//! The huddle's tuning: how a temperature is made and when a backend
//! rotates. Defined here, with the config that sets them, so the huddle
//! takes them from below instead of the config reaching up into it.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How much each term weighs in the raw score.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Weights {
    pub latency: f64,
    pub cpu: f64,
    pub memory: f64,
    /// Error rate plus connection load.
    pub load: f64,
}

impl Default for Weights {
    /// The original's: latency dominates.
    fn default() -> Self {
        Weights {
            latency: 0.7,
            cpu: 0.1,
            memory: 0.1,
            load: 0.1,
        }
    }
}

/// Settings of the temperature.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThermalParams {
    pub weights: Weights,
    /// EMA weight of the newest raw score.
    pub alpha: f64,
    /// Latency ratio to the median at which the anomaly is full (1.0).
    pub full_anomaly_ratio: f64,
    /// Above this mean latency a backend is fully anomalous whatever the
    /// median (covers the whole cluster slowing down).
    pub ceiling_ms: Option<f64>,
    /// The median is taken as at least this: below a millisecond, a 3x
    /// ratio is scheduler noise, not a slow server.
    pub floor_ms: f64,
}

impl Default for ThermalParams {
    fn default() -> Self {
        ThermalParams {
            weights: Weights::default(),
            alpha: 0.6,
            full_anomaly_ratio: 3.0,
            ceiling_ms: None,
            floor_ms: 1.0,
        }
    }
}

/// Settings of the rotation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RotationParams {
    pub heat: f64,
    pub cool: f64,
    pub min_inner: usize,
    /// No hot eviction within this long of a member's last move.
    pub cooldown: Duration,
    /// Shortest rest; doubled per eviction in a row, up to `max_rest`.
    pub min_rest: Duration,
    pub max_rest: Duration,
    /// A new member rests this long before it first joins (0: at once).
    pub warmup: Duration,
}

impl Default for RotationParams {
    fn default() -> Self {
        RotationParams {
            heat: 0.55,
            cool: 0.30,
            min_inner: 2,
            cooldown: Duration::from_secs(5),
            min_rest: Duration::from_secs(10),
            max_rest: Duration::from_secs(160),
            warmup: Duration::ZERO,
        }
    }
}
