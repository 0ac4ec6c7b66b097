//! Whose sample is it: one client, or one /24 (/64), must not decide a
//! backend's latency alone. Per backend and CPU the program keeps the two
//! sources that give most of its samples (`HeavySource`); the samples of
//! the one counted more (of two alike, the lower prefix) go to
//! `LATENCY_HEAVY`, everyone else's to `LATENCY`. The same source is the
//! heavy one on every CPU: when it was whichever came first to the CPU,
//! the two CPUs could pick different ones, each part then held both, and
//! a client sending late ACKs on 45% of a backend's samples rotated it
//! out in one of several 30 s runs (46 ms judged against 4.7).
//! A client aiming slow-looking turns at one backend becomes its heavy
//! source and is outvoted by the others; a backend with one client is
//! judged on that client's samples, as before.

use crate::lb::maps::HEAVY;
use huddle_common::{source_prefix, Addr, HEAVY_HOLD};

/// Counts a sample of `backend` from `client` and says whether it is the
/// first slot's (`HeavySource`).
#[inline(always)]
pub fn is_heavy(backend: u32, client: &Addr, family: u8) -> bool {
    let key = source_prefix(client, family);
    let Some(h) = HEAVY.get_ptr_mut(backend) else {
        return false;
    };
    // SAFETY: this CPU's map value, valid for this run.
    let h = unsafe { &mut *h };
    for i in 0..2 {
        if h.prefix[i] == key && h.count[i] > 0 {
            if h.count[i] < HEAVY_HOLD {
                h.count[i] += 1;
            }
            return leads(h, i == 0);
        }
    }
    for i in 0..2 {
        if h.count[i] == 0 {
            h.prefix[i] = key;
            h.count[i] = 1;
            return leads(h, i == 0);
        }
    }
    h.count[0] -= 1;
    h.count[1] -= 1;
    false
}

/// Whether slot 0 (`first`) or slot 1 is the heavy source: counted more,
/// or as much with the lower prefix.
#[inline(always)]
fn leads(h: &huddle_common::HeavySource, first: bool) -> bool {
    let (a, b) = (h.count[0], h.count[1]);
    let zero_leads = a > b || (a == b && h.prefix[0] <= h.prefix[1]);
    zero_leads == first
}
