//! Kernel log lines, at most one a second per CPU. A flood that makes the
//! program refuse packets (every NAT tuple toward a backend held) would
//! otherwise write a line per packet, and the daemon forward each; the
//! counters still count every refusal.

use crate::lb::maps::LOG_GATE;
use huddle_common::LOG_EVERY_NS;

/// Whether a line may be written at `now`; if so, how many were held
/// back since the last one.
#[inline(always)]
pub fn may_log(now: u64) -> Option<u64> {
    let g = LOG_GATE.get_ptr_mut(0)?;
    // SAFETY: this CPU's element, used by this run only.
    let g = unsafe { &mut *g };
    if g.last_ns != 0 && now.wrapping_sub(g.last_ns) < LOG_EVERY_NS {
        g.held += 1;
        return None;
    }
    let held = g.held;
    g.last_ns = now;
    g.held = 0;
    Some(held)
}
