//! What happens to the degraded backend during a run.

use anyhow::Result;
use std::time::Duration;
use testbed::Testbed;

/// The backend that degrades in every scenario but `Normal`.
pub const DEGRADED: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    Normal,
    /// 5x slower from halfway.
    Slow,
    /// Killed at halfway (connections refused).
    Killed,
    /// SIGSTOP at halfway: handshakes complete in the kernel, nothing answers.
    Hung,
    /// Slowly degrading from 1x to 5x over the whole run.
    Degrading,
    /// No fault, and beside the open loop every kind of `testbed::kinds`
    /// (uploads, long polls, streams, idle keep-alives, ...): real traffic.
    Mixed,
}

pub const ALL: [Scenario; 5] = [
    Scenario::Normal,
    Scenario::Slow,
    Scenario::Killed,
    Scenario::Hung,
    Scenario::Degrading,
];

/// Run only when named (`--scenarios mixed`): minutes more per balancer.
pub const EXTRA: [Scenario; 1] = [Scenario::Mixed];

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Normal => "normal load",
            Scenario::Slow => "one backend 5x slower from halfway",
            Scenario::Killed => "one backend killed at halfway",
            Scenario::Hung => "one backend hung at halfway (SIGSTOP)",
            Scenario::Degrading => "one backend degrading 1x -> 5x over the run",
            Scenario::Mixed => {
                "mixed traffic: uploads, long polls, streams, idle keep-alives beside the load"
            }
        }
    }

    pub fn slug(self) -> &'static str {
        match self {
            Scenario::Normal => "normal",
            Scenario::Slow => "slow",
            Scenario::Killed => "killed",
            Scenario::Hung => "hung",
            Scenario::Degrading => "degrading",
            Scenario::Mixed => "mixed",
        }
    }

    /// When the fault starts (for the share served by the degraded
    /// backend and the plots), as a fraction of the run.
    pub fn fault_at(self) -> f64 {
        match self {
            Scenario::Normal | Scenario::Degrading | Scenario::Mixed => 0.0,
            _ => 0.5,
        }
    }

    /// Called every `step` from the start of the load with the elapsed
    /// fraction of the run; makes the backend degrade on schedule.
    pub fn drive(self, bed: &Testbed, base_ms: f64, frac: f64, done: &mut bool) -> Result<()> {
        match self {
            Scenario::Normal | Scenario::Mixed => {}
            Scenario::Degrading => {
                let ms = base_ms * (1.0 + 4.0 * frac.clamp(0.0, 1.0));
                bed.backend_admin(DEGRADED, &format!("delay_ms={ms:.2}"))?;
            }
            _ if *done || frac < 0.5 => {}
            Scenario::Slow => {
                bed.backend_admin(DEGRADED, &format!("delay_ms={}", base_ms * 5.0))?;
                *done = true;
            }
            Scenario::Killed => {
                bed.signal_backend(DEGRADED, libc::SIGKILL);
                *done = true;
            }
            Scenario::Hung => {
                bed.signal_backend(DEGRADED, libc::SIGSTOP);
                *done = true;
            }
        }
        Ok(())
    }
}

/// How often the scenario is driven.
pub const STEP: Duration = Duration::from_millis(100);
