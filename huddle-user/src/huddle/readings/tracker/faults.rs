//! A tracker's faults from what the kernel says it owes (hung: a turn's
//! answer; unreachable: a SYN-ACK), and its health verdict over those and
//! its probes.

use super::Tracker;
use crate::config::Huddle as Settings;
use huddle_common::{BackendStats, Pulse, HUNG_EVIDENCE};
use std::time::Duration;

impl Tracker {
    /// Faults from answers owed: hung (owes a turn's answer, none comes),
    /// unreachable (owes a SYN-ACK).
    pub(super) fn owed_answers(
        &mut self,
        stats: &BackendStats,
        pulse: &Pulse,
        now_ns: u64,
        s: &Settings,
        hung_after: Duration,
    ) {
        let hung_ns = hung_after.as_nanos() as u64;
        // With `latency = "connect"` or `"off"` a request owes nothing.
        let turns = if self.latency.turns() {
            pulse.turn_wait_ns
        } else {
            0
        };
        let mut hung = None;
        if let Some(age) = owed(turns, now_ns, stats.flows_new, &mut self.wait_seen) {
            // One turn owed long is no fault (a long poll, a stream, an
            // upload's body): hung is further requests, sent to it since
            // it last answered anything (the kernel's evidence turns, which
            // the pass-over never withholds), still unanswered half of
            // `hung_after` after the last of their writes, with nothing
            // else answered all that time. The health probe covers a
            // backend that gets no traffic.
            let evidence = pulse.evidence >= HUNG_EVIDENCE
                && now_ns.saturating_sub(pulse.evidence_ns) > hung_ns / 2;
            if evidence {
                hung = Some(format!(
                    "hung: no answer for {} ms, {} requests sent since",
                    age / 1_000_000,
                    pulse.evidence
                ));
            }
        }
        // A client can make that evidence (requests no server answers):
        // an HTTP probe asks the backend first (`suspicion`).
        let fault = match hung {
            Some(why) if self.probing.asks_the_application() => {
                let deadline = hung_after.min(self.probing.timeout);
                (self.suspicion).evidence(&why, pulse.evidence_ns, now_ns, deadline)
            }
            Some(why) => Some(why),
            None => {
                self.suspicion.no_evidence();
                None
            }
        };
        if fault.is_some() {
            self.kernel_fault = fault;
        }
        // Unreachable: the oldest SYN unanswered `syn_timeout`, and another
        // connection attempt sent to it since (one lost SYN is no fault);
        // or five times that alone. Attempts are `syns`, not `flows_new`:
        // that counts completed handshakes, which a dead backend never has,
        // so one dead from the start took 5 x 300 ms to leave, not 300.
        let syn_ns = s.syn_timeout.as_nanos() as u64;
        if let Some(age) = owed(pulse.syn_wait_ns, now_ns, stats.syns, &mut self.syn_seen) {
            let (_, syns_then) = self.syn_seen.unwrap_or_default();
            let piled = stats.syns.wrapping_sub(syns_then) >= 1;
            if (age > syn_ns && piled) || age > syn_ns.saturating_mul(5) {
                self.kernel_fault = Some(format!(
                    "unreachable: SYNs unanswered for {} ms",
                    age / 1_000_000
                ));
            }
        }
    }

    /// Health after this tick's kernel figures and probes.
    pub(in crate::huddle::readings) fn judge(&mut self) {
        let probe_fault = (self.fails >= self.probing.fall).then(|| {
            let why = self
                .probe
                .as_ref()
                .and_then(|p| p.error.clone())
                .unwrap_or_default();
            format!("{} probes failed: {why}", self.fails)
        });
        if let Some(f) = self.kernel_fault.clone().or(probe_fault) {
            if self.kernel_fault.is_some() {
                self.passes = 0;
            }
            self.unhealthy = Some(f);
        } else if self.unhealthy.is_some() && self.passes >= self.probing.rise {
            self.unhealthy = None;
        }
    }
}

/// How long a backend has owed an answer, if it does. Remembers, per
/// distinct wait, the counter value when it was first seen.
fn owed(since: u64, now_ns: u64, counter: u64, seen: &mut Option<(u64, u64)>) -> Option<u64> {
    if since == 0 {
        *seen = None;
        return None;
    }
    if seen.is_none_or(|(s, _)| s != since) {
        *seen = Some((since, counter));
    }
    Some(now_ns.saturating_sub(since))
}
