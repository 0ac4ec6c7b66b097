//! The rate of ICMP the program sends: "fragmentation needed" it writes
//! and errors it translates to clients. Both answer packets anyone can
//! send with a spoofed source (a DF packet too big, an error quoting a
//! tuple), so without a limit the balancer would reflect ICMP at a victim
//! at the rate of the flood. A GCRA per CPU: one word, no lock.

use crate::lb::maps::{global, ICMP_GATE};
use aya_ebpf::helpers::bpf_ktime_get_ns;
use huddle_common::{ICMP_BURST, ICMP_EVERY_NS};

/// Whether one more ICMP message may go out now; if not, it is counted
/// (`icmp_rate_limited`) and the caller drops it.
#[inline(always)]
pub fn may_send() -> bool {
    let Some(g) = ICMP_GATE.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's element, used by this run only; a plain helper.
    let (g, now) = unsafe { (&mut *g, bpf_ktime_get_ns()) };
    let due = if g.due_ns > now { g.due_ns } else { now };
    if due - now > (ICMP_BURST - 1) * ICMP_EVERY_NS {
        global(|s| s.icmp_rate_limited += 1);
        return false;
    }
    g.due_ns = due + ICMP_EVERY_NS;
    true
}
