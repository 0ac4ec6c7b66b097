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
use huddle_common::{source_prefix, Addr};

/// Counts a sample of `backend` from `client` and says whether it is the
/// first slot's (`HeavySource`).
#[inline(always)]
pub fn is_heavy(backend: u32, client: &Addr, family: u8) -> bool {
    let key = source_prefix(client, family);
    let Some(h) = HEAVY.get_ptr_mut(backend) else {
        return false;
    };
    // SAFETY: this CPU's map value, valid for this run.
    unsafe { &mut *h }.count_sample(key)
}
