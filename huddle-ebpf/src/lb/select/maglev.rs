//! Maglev consistent hashing, the kernel's half: a new flow of a service
//! with `selection = "maglev"` takes the entry of the service's live table
//! (`MAGLEV`, written by the control plane with the ring, in the same
//! double buffer) that a hash of its 5-tuple names. The hash's seed is
//! secret and shared by the balancers of a cluster (`maglev_seed`), so
//! every one picks the same backend for the same flow and no client can
//! aim at one.

use crate::{
    lb::maps::{MAGLEV, RING_GEN},
    lb::scratch,
};
use core::ptr::read_volatile;
use huddle_common::{verdict::NO_BACKEND, MAGLEV_EMPTY};

const READ_TRIES: u32 = 3;

/// The entry of `service`'s table of `size` entries (its two tables from
/// entry `base` of `MAGLEV` on) for the flow whose key
/// `scratch::flow_key` names, and a second entry from the same
/// hash (for when the first must be passed over); `None` if the table
/// cannot be read.
#[inline(always)]
pub fn pick(service: u32, size: u32, base: u32, seed: u64) -> Option<(u32, u32)> {
    let flow = scratch::flow_key()?;
    // SAFETY: this CPU's element, used by this run only.
    let h = unsafe { (*flow).hash(seed) };
    let size = u64::from(size);
    if size == 0 {
        return None;
    }
    let (first, second) = (h % size, (h / size) % size);
    let generation = RING_GEN.get_ptr(service)?;
    for _ in 0..READ_TRIES {
        // SAFETY: a map value pointer, valid for this run; volatile so the
        // two reads around the table's stay in order (as in `ring::pick`).
        let g1 = unsafe { read_volatile(generation) };
        let base = u64::from(base) + (g1 & 1) * size;
        let entries = (entry(base + first)?, entry(base + second)?);
        // SAFETY: as above.
        if unsafe { read_volatile(generation) } == g1 {
            return Some(entries);
        }
    }
    None
}

/// Entry `i` of the MAGLEV map: 32-bit ids, two to an element.
#[inline(always)]
fn entry(i: u64) -> Option<u32> {
    let e = MAGLEV.get_ptr((i / 2) as u32)?;
    // SAFETY: a map value pointer, valid for this run.
    let id = (unsafe { read_volatile(e) } >> ((i % 2) * 32)) as u32;
    Some(if id == MAGLEV_EMPTY { NO_BACKEND } else { id })
}
