//! A hang the kernel's counters show is a suspicion, not a verdict. A
//! client can hold requests open that no server answers (a request head
//! that never ends: slowloris), and in the kernel those look like a hung
//! backend's. So the backend is asked at once, with a probe under a short
//! deadline, and leaves only if that fails too; a probe answered in time
//! clears the suspicion. Only an HTTP probe can answer: a TCP connect
//! succeeds to a stopped process (its kernel completes the handshake), so
//! with TCP probes the kernel's evidence decides alone, as before.

use crate::{config::Probe, net::probe::ProbeResult};
use std::{net::SocketAddr, time::Duration};

/// One suspicion to ask about, from the tick to the daemon's task that
/// probes: service `si`'s backend `bi` at `addr`, and the probe to send.
pub struct Ask {
    pub si: usize,
    pub bi: usize,
    pub addr: SocketAddr,
    pub probe: Probe,
}

/// One backend's suspicion of a hang, and how its past ones ended.
#[derive(Debug, Default)]
pub struct Suspicion {
    open: Option<Open>,
    /// The evidence (the kernel's `evidence_ns`) a probe answered for:
    /// not suspected again (the kernel's record is cleared next tick).
    answered_for: Option<u64>,
    /// Suspicions a probe in time cleared, and that it confirmed (failed,
    /// late, or never came back).
    pub cleared: u64,
    pub confirmed: u64,
}

#[derive(Debug)]
struct Open {
    /// The evidence asked about: its last write (`Pulse::evidence_ns`).
    evidence_ns: u64,
    /// When it was raised (CLOCK_MONOTONIC).
    raised_ns: u64,
    /// How long the probe may take to answer.
    deadline: Duration,
    /// Whether the probe was sent (`take_ask`).
    asked: bool,
    /// Why the probe did not clear it.
    failed: Option<String>,
}

/// What a probe's answer did to the suspicion.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// None was open (it ended meanwhile, or was already answered).
    None,
    /// Answered in time: the backend answers, the suspicion is gone.
    Cleared,
    /// Failed or late: the backend leaves at the next tick.
    Confirmed,
}

/// How long past its deadline a probe sent at once may stay unanswered
/// before the silence counts as failure (a lost task, a queue of them).
const GRACE: Duration = Duration::from_secs(1);

impl Suspicion {
    /// The kernel's evidence of a hang this tick (`why`, its last write
    /// at `evidence_ns`), now `now_ns`; a probe would get `deadline`. The
    /// fault, once the backend itself has confirmed it.
    pub fn evidence(
        &mut self,
        why: &str,
        evidence_ns: u64,
        now_ns: u64,
        deadline: Duration,
    ) -> Option<String> {
        if self.answered_for == Some(evidence_ns) {
            return None;
        }
        let open = self.open.get_or_insert(Open {
            evidence_ns,
            raised_ns: now_ns,
            deadline,
            asked: false,
            failed: None,
        });
        if let Some(err) = &open.failed {
            return Some(format!("{why}; asked at once, it failed too: {err}"));
        }
        // Never sent (no prober) or never back: the kernel decides.
        let limit = (open.deadline + GRACE).as_nanos() as u64;
        if now_ns.saturating_sub(open.raised_ns) > limit {
            self.confirmed += 1;
            open.failed = Some("the probe sent at once never came back".into());
            return Some(format!(
                "{why}; the probe sent at once did not come back in {} ms",
                limit / 1_000_000
            ));
        }
        None
    }

    /// No evidence this tick: it answered, or its record was cleared.
    pub fn no_evidence(&mut self) {
        self.open = None;
    }

    /// The deadline of a probe to send now, once per suspicion.
    pub fn take_ask(&mut self) -> Option<Duration> {
        let open = self.open.as_mut().filter(|o| !o.asked)?;
        open.asked = true;
        Some(open.deadline)
    }

    /// Whether a suspicion waits for its probe.
    #[must_use]
    pub fn pending(&self) -> bool {
        self.open.as_ref().is_some_and(|o| o.failed.is_none())
    }

    /// A probe's answer (the one sent at once, or a round's that came
    /// first). One that failed for want of something on this host says
    /// nothing of the backend, and leaves the suspicion open.
    pub fn answered(&mut self, r: &ProbeResult) -> Answer {
        let Some(open) = self.open.as_mut().filter(|o| o.failed.is_none()) else {
            return Answer::None;
        };
        if r.local {
            return Answer::None;
        }
        let limit_ms = open.deadline.as_secs_f64() * 1e3;
        match &r.error {
            None if r.latency_ms <= limit_ms => {
                self.answered_for = Some(open.evidence_ns);
                self.open = None;
                self.cleared += 1;
                Answer::Cleared
            }
            None => {
                open.failed = Some(format!(
                    "it answered in {:.0} ms, past the {limit_ms:.0} ms allowed",
                    r.latency_ms
                ));
                self.confirmed += 1;
                Answer::Confirmed
            }
            Some(e) => {
                open.failed = Some(e.clone());
                self.confirmed += 1;
                Answer::Confirmed
            }
        }
    }
}
