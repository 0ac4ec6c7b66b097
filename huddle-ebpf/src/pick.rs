//! Which backend a new flow takes: the ring's next one, unless it has owed
//! an answer for longer than its peers take to give one.
//!
//! The control plane judges a hung backend from ticks of counters, which
//! takes a tick or two; meanwhile every new flow sent there is lost. The
//! kernel knows at once (`PULSE`): since when each backend owes an answer.
//! A least-connections balancer stops feeding a backend as soon as its
//! connections pile up; this is the same idea, measured in time, with the
//! limits (`Tuning`) set by the control plane from the ring's own answer
//! times.

use crate::{
    maps::{bump, BACKEND_STATS, PULSE, TUNING},
    ring,
};
use core::ptr::read_volatile;
use huddle_common::{Tuning, PICK_TRIES};

/// No backend (to avoid, or chosen).
pub const NONE: u32 = u32::MAX;

/// The backend for a new flow of `service` at `now`: the ring's next one,
/// passing over one that owes an answer for too long, and `avoid` (the
/// backend that just refused or ignored this connection). After
/// `PICK_TRIES` ring entries the last one is taken even if it owes (never
/// `avoid`). `NONE` when the ring is empty or offers only `avoid`.
#[inline(never)]
pub fn choose(service: u32, avoid: u32, now: u64) -> u32 {
    let limits = match TUNING.get(service) {
        Some(t) => *t,
        None => Tuning::default(),
    };
    let mut i = 0;
    while i < PICK_TRIES {
        i += 1;
        let Some(id) = ring::pick(service) else {
            return NONE;
        };
        if id == avoid {
            continue;
        }
        if i == PICK_TRIES || !owes_too_long(id, &limits, now) {
            return id;
        }
        bump(&BACKEND_STATS, id, |s| s.skipped_owing += 1);
    }
    NONE
}

/// Whether backend `id` has owed a SYN-ACK or an answer for longer than
/// `limits` allow.
#[inline(always)]
fn owes_too_long(id: u32, limits: &Tuning, now: u64) -> bool {
    let Some(p) = PULSE.get_ptr(id) else {
        return false;
    };
    // SAFETY: a map value pointer, valid for this run; other CPUs write it
    // with plain stores, so each load sees an old or a new value.
    let (turn, syn) = unsafe {
        (
            read_volatile(&(*p).turn_wait_ns),
            read_volatile(&(*p).syn_wait_ns),
        )
    };
    late(turn, limits.turn_skip_ns, now) || late(syn, limits.syn_skip_ns, now)
}

/// Whether a wait that started at `since` (0: none) has passed `limit`
/// (0: no limit). A wait started on another CPU after `now` was read is
/// not late.
#[inline(always)]
fn late(since: u64, limit: u64, now: u64) -> bool {
    limit != 0 && since != 0 && now > since && now - since > limit
}
