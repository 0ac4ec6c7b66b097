//! The half-open tables: direct-mapped arrays of slots, one per hash of a
//! tuple (see `huddle_common::HalfOpen` for why not an LRU hash); on the
//! NAT side consecutive NAT ports toward a backend take consecutive slots
//! (`NatKey::half_open_slot`).
//!
//! Two CPUs may write one slot at the same instant (two SYNs whose tuples
//! hash alike); a reader checks the tag and the whole key, so such a slot
//! reads as another flow's or as empty, and at worst one handshake is
//! retried by its client.

use crate::maps::{bump, put, Scratch, HALF_OPEN, HALF_OPEN_NAT, SERVICE_STATS};
use huddle_common::{slot_tag, Config, FlowKey, HalfOpen, HalfOpenNat, NatKey};

/// The slot of client tuple `key` (hash `h`), whoever holds it.
#[inline(always)]
pub fn client_slot(cfg: &Config, h: u64) -> Option<*mut HalfOpen> {
    HALF_OPEN.get_ptr_mut((h as u32) & cfg.half_open_mask)
}

/// The slot of NAT tuple `key`, whoever holds it, and the tag `key`
/// carries there.
#[inline(always)]
pub fn nat_slot(cfg: &Config, key: &NatKey) -> Option<(*mut HalfOpenNat, u64)> {
    let (i, tag) = key.half_open_slot(cfg.hash_seed, cfg.nat_port_min);
    HALF_OPEN_NAT
        .get_ptr_mut(i & cfg.half_open_mask)
        .map(|s| (s, tag))
}

/// Whether `slot` holds the half-open flow `key` (of hash `h`).
#[inline(always)]
pub fn holds(slot: *const HalfOpen, h: u64, key: &FlowKey) -> bool {
    // SAFETY: a map value pointer from a lookup in this run.
    unsafe { (*slot).tag == slot_tag(h) && (*slot).key == *key }
}

/// Whether `slot` holds the NAT side of a half-open flow with NAT tuple
/// `key` (whose tag there is `tag`).
#[inline(always)]
pub fn nat_holds(slot: *const HalfOpenNat, tag: u64, key: &NatKey) -> bool {
    // SAFETY: as above.
    unsafe { (*slot).tag == tag && (*slot).key == *key }
}

/// The slot of the half-open flow `key`, if one holds it.
#[inline(always)]
pub fn find(cfg: &Config, key: &FlowKey) -> Option<*mut HalfOpen> {
    let h = key.hash(cfg.hash_seed);
    client_slot(cfg, h).filter(|s| holds(*s, h, key))
}

/// The NAT slot of a half-open flow, if it still holds it.
#[inline(always)]
pub fn find_nat(cfg: &Config, key: &NatKey) -> Option<*mut HalfOpenNat> {
    nat_slot(cfg, key)
        .filter(|(s, tag)| nat_holds(*s, *tag, key))
        .map(|(s, _)| s)
}

/// Writes the NAT side of the half-open flow in `sc` (`nkey` -> `nval`)
/// into its slot, counting a handshake it takes the slot from.
#[inline(always)]
pub fn write_nat(cfg: &Config, service: u32, sc: &Scratch) {
    if let Some((n, tag)) = nat_slot(cfg, &sc.nkey) {
        // SAFETY: map value pointer, valid for this run.
        unsafe {
            if (*n).tag != 0 && (*n).key != sc.nkey {
                bump(&SERVICE_STATS, service, |st| st.half_open_lost += 1);
            }
            put(&mut (*n).key, &sc.nkey);
            put(&mut (*n).nat, &sc.nval);
            (*n).tag = tag;
        }
    }
}

/// Empties the NAT slot of half-open tuple `key` if it still holds it, so
/// a late answer on that tuple finds nothing (the flow moved on).
#[inline(always)]
pub fn forget_nat(cfg: &Config, key: &NatKey) {
    if let Some(n) = find_nat(cfg, key) {
        // SAFETY: map value pointer, valid for this run.
        unsafe { (*n).tag = 0 };
    }
}
