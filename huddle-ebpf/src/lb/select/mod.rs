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

pub mod maglev;
pub mod ring;

use crate::lb::maps::{bump, BACKEND_STATS, PULSE, TUNING};
use core::ptr::read_volatile;
use huddle_common::{verdict::NO_BACKEND, Tuning, HUNG_EVIDENCE};

/// The backend for a new flow of `service` at `now`. Of the ring's next
/// two entries it takes the first (with `Tuning::two_choices`, the one
/// that has owed an answer for less time), unless it owes for longer than
/// the limits (then the second), never `avoid` (the backend that just
/// refused or ignored this connection); a backend owing a turn still takes
/// new flows until it has had its evidence (`look`); if both are past, the next two
/// entries are taken as they come. With Maglev (`Tuning::maglev_size`) the
/// flow's entry in the service's table, never passed over; its second
/// entry only when the first is `avoid` (`maglev_seed`: the caller's
/// `KernelConfig::maglev_seed`, already read). `NO_BACKEND` when the ring is empty or
/// offers only `avoid`.
#[inline(never)]
pub fn choose(service: u32, avoid: u32, now: u64, maglev_seed: u64) -> u32 {
    let Some(limits) = TUNING.get_ptr(service) else {
        return NO_BACKEND;
    };
    // SAFETY: a map value pointer, valid for this run.
    let limits = unsafe { &*limits };
    let maglev = limits.maglev_size != 0;
    let entries = if maglev {
        maglev::pick(service, limits.maglev_size, limits.maglev_base, maglev_seed)
    } else {
        ring::pick(service)
    };
    let Some((a, b)) = entries else {
        return NO_BACKEND;
    };
    if maglev {
        // Never passed over: every balancer must pick alike (a connection
        // another balancer opened lands where that one sent it). Measured:
        // with the pass-over, one balancer sent 9 flows to their second
        // entry, and 7-20 connections broke when the router moved them.
        return if a != avoid {
            a
        } else if b != avoid {
            b
        } else {
            NO_BACKEND
        };
    }
    // Few live values: the call chain's stack is nearly full here.
    let (sa, sb) = (look(a, now, limits), look(b, now, limits));
    if a != avoid {
        if sa & LATE == 0 {
            // With two choices, the one owing for less time (`sb < sa`
            // also means `b` is not past the limits, nor `a` itself).
            let two = limits.two_choices != 0 && b != avoid && sb < sa;
            return if two { b } else { a };
        }
        bump(&BACKEND_STATS, a, |s| s.skipped_owing += 1);
    }
    if b != avoid && b != a {
        if sb & LATE == 0 {
            return b;
        }
        bump(&BACKEND_STATS, b, |s| s.skipped_owing += 1);
    }
    // Both owe too long: the next two, as they come.
    match ring::pick(service) {
        Some((a, _)) if a != avoid => a,
        Some((_, b)) if b != avoid => b,
        _ => NO_BACKEND,
    }
}

/// Set in `look`'s answer when the backend owes past a limit.
const LATE: u64 = 1 << 63;

/// How long backend `id` has owed an answer or a SYN-ACK at `now` (the
/// longer of the two, in ns; 0: nothing), with `LATE` set when either is
/// past its limit (0: no limit). A turn past it is late only once the
/// backend has had its `HUNG_EVIDENCE` evidence turns (`Pulse::evidence`):
/// passing over must not starve the evidence, since a backend owing one
/// long turn (a long poll) is healthy if it answers other requests, and
/// new flows may be all that can show that; a hung one is found by the
/// control plane from those going unanswered. Not a SYN-ACK owed: a healthy backend's
/// kernel answers SYNs at once whatever the traffic, so a late one is no
/// traffic's doing, and its SYNs would only wait to be retried elsewhere
/// (measured: 55 of 802 SYNs toward a backend whose firewall drops them,
/// against 50 allowed). A wait started on another CPU after `now` was
/// read counts as none.
#[inline(always)]
fn look(id: u32, now: u64, limits: &Tuning) -> u64 {
    let Some(p) = PULSE.get_ptr(id) else {
        return 0;
    };
    // SAFETY: a map value pointer, valid for this run; other CPUs write it
    // with plain stores, so each load sees an old or a new value.
    let (turn, syn, evidence) = unsafe {
        (
            read_volatile(&(*p).turn_wait_ns),
            read_volatile(&(*p).syn_wait_ns),
            read_volatile(&(*p).evidence),
        )
    };
    let age = |since: u64| {
        if since != 0 && now > since {
            now - since
        } else {
            0
        }
    };
    let (turn, syn) = (age(turn), age(syn));
    let late = (limits.syn_skip_ns != 0 && syn > limits.syn_skip_ns)
        || (limits.turn_skip_ns != 0 && turn > limits.turn_skip_ns && evidence >= HUNG_EVIDENCE);
    let longer = if turn > syn { turn } else { syn };
    (longer & !LATE) | if late { LATE } else { 0 }
}
