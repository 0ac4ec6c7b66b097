//! The hang suspicion (`suspicion`), on made-up counters.

use super::*;
use crate::net::probe::ProbeResult;
use huddle_common::{Pulse, HUNG_EVIDENCE};

/// A probe answered in time clears the suspicion, and the same evidence
/// raises none again; with TCP probes (a connect cannot tell a stopped
/// process) the kernel's evidence decides alone; a probe that never
/// comes back confirms it after its deadline and a second.
#[test]
fn a_suspected_hang_is_asked_and_only_tcp_probes_leave_it_to_the_kernel() {
    let s = settings();
    let ms = 1_000_000u64;
    let owes = |last: u64| Pulse {
        turn_wait_ns: 1000 * ms,
        syn_wait_ns: 0,
        evidence: HUNG_EVIDENCE,
        evidence_ns: last * ms,
    };
    let mut t = tracker();
    assert_eq!(owing(&mut t, &owes(2000), 3, 2200, &s), None);
    assert!(t.suspicion.take_ask().is_some());
    let fine = ProbeResult {
        latency_ms: 6.0,
        error: None,
        local: false,
    };
    assert_eq!(t.suspicion.answered(&fine), suspicion::Answer::Cleared);
    assert_eq!(owing(&mut t, &owes(2000), 3, 2400, &s), None);
    assert_eq!(t.suspicion.take_ask(), None, "the same evidence, answered");
    // New evidence: asked again; never answered, it confirms itself.
    assert_eq!(owing(&mut t, &owes(2500), 4, 2700, &s), None);
    assert!(t.suspicion.take_ask().is_some());
    let late = 2700 + (s.hung_after.min(s.probe.timeout).as_millis() as u64) + 1001;
    assert!(owing(&mut t, &owes(2500), 4, late, &s).is_some());
    assert_eq!((t.suspicion.cleared, t.suspicion.confirmed), (1, 1));
    // TCP probes: the kernel's evidence alone, at once.
    let mut t = tracker();
    t.probing = std::sync::Arc::new(crate::config::Probe {
        kind: crate::config::ProbeKind::Tcp,
        ..(*t.probing).clone()
    });
    assert!(owing(&mut t, &owes(2000), 3, 2200, &s)
        .unwrap()
        .starts_with("hung"));
    assert_eq!(t.suspicion.take_ask(), None);
}
