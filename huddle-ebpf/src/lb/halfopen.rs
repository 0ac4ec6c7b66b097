//! The half-open tables: direct-mapped arrays of slots, one per hash of a
//! tuple (see `huddle_common::HalfOpen` for why not an LRU hash); on the
//! NAT side consecutive NAT ports toward a backend take consecutive slots
//! (`NatKey::half_open_slot`). Each slot's tag is also kept short in
//! `HALF_OPEN_TAGS` or `HALF_OPEN_NAT_TAGS`, which a SYN reads instead of
//! the slots (see `huddle_common::HalfOpenTags`).
//!
//! Two CPUs may write one slot at the same instant (two SYNs whose tuples
//! hash alike); a reader checks the tag and the whole key, so such a slot
//! reads as another flow's or as empty, and at worst one handshake is
//! retried by its client.

use crate::lb::scratch::{self, Scratch};
use crate::{
    lb::maps::{bump, HALF_OPEN, HALF_OPEN_NAT, HALF_OPEN_NAT_TAGS, HALF_OPEN_TAGS, SERVICE_STATS},
    mem::put,
};
use aya_ebpf::maps::Array;
use huddle_common::{
    short_tag, slot_tag, FlowKey, HalfOpen, HalfOpenNat, HalfOpenTags, KernelConfig, NatKey,
    HALF_OPEN_TAGS_PER_LINE,
};

/// `Scratch::pending` bits: the client slot, the NAT slot, and the SYN's
/// options into the client slot.
pub const PENDING_CLIENT: u32 = 1;
pub const PENDING_NAT: u32 = 2;
pub const PENDING_SYN: u32 = 4;

/// Writes the half-open slots a new flow left pending in the scratch map
/// (`Scratch::pending`), counting the handshakes they take over. Called
/// once the packet is rewritten: the slots are cold lines, and stores to
/// them ahead of the packet's own held back every later store (measured:
/// an IP-in-IP SYN 510-557 ns net with the slots written first, 176 with
/// them not written at all). Its own BPF function: called from both
/// request paths without a copy in each.
#[inline(never)]
pub fn commit(cfg: &KernelConfig) {
    let Some(sc) = scratch::get() else {
        return;
    };
    // SAFETY: this CPU's element, used by this run only.
    let sc = unsafe { &mut *sc };
    let pending = sc.pending;
    if pending == 0 {
        return;
    }
    sc.pending = 0;
    let (h, service) = (sc.pending_hash, sc.fwd.service);
    if pending & PENDING_NAT != 0 {
        write_nat(cfg, service, sc);
    }
    let (Some(s), Some(t)) = (client_slot(cfg, h), short_tag_of(cfg, h)) else {
        return;
    };
    // SAFETY: map value pointers, valid for this run. A slot with a short
    // tag holds a handshake that had not completed: it loses it. Field by
    // field, tag last: no 80-byte temporary on the stack, and a reader on
    // another CPU sees the new tag after the new key.
    unsafe {
        if *t != 0 {
            bump(&SERVICE_STATS, service, |st| st.half_open_lost += 1);
        }
        put(&mut (*s).key, &sc.nval.flow);
        put(&mut (*s).flow, &sc.fwd);
        if pending & PENDING_SYN != 0 {
            put(&mut (*s).syn, &sc.syn);
        }
        (*s).tag = slot_tag(h);
        *t = short_tag(h);
    }
}

/// The slot of client tuple `key` (hash `h`), whoever holds it.
#[inline(always)]
pub fn client_slot(cfg: &KernelConfig, h: u64) -> Option<*mut HalfOpen> {
    HALF_OPEN.get_ptr_mut((h as u32) & cfg.half_open_mask)
}

/// Short tag `i` (a slot index, already masked) of `tags`.
#[inline(always)]
fn short_tag_at(tags: &Array<HalfOpenTags>, i: u32) -> Option<*mut u32> {
    let line = tags.get_ptr_mut(i / HALF_OPEN_TAGS_PER_LINE)?;
    let lane = (i % HALF_OPEN_TAGS_PER_LINE) as usize;
    // SAFETY: map value pointer from this run; `lane` < 16, the length.
    Some(unsafe { (*line).tags.as_mut_ptr().add(lane) })
}

/// The short tag of the client slot of hash `h` (see `client_slot`).
#[inline(always)]
pub fn short_tag_of(cfg: &KernelConfig, h: u64) -> Option<*mut u32> {
    short_tag_at(&HALF_OPEN_TAGS, (h as u32) & cfg.half_open_mask)
}

/// The NAT slot of tuple `key`, whoever holds it, its index, and the tag
/// `key` carries there.
#[inline(always)]
fn nat_slot(cfg: &KernelConfig, key: &NatKey) -> Option<(*mut HalfOpenNat, u32, u64)> {
    let (i, tag) = key.half_open_slot(cfg.hash_seed, cfg.nat_port_min, cfg.half_open_mask);
    let i = i & cfg.half_open_mask;
    HALF_OPEN_NAT.get_ptr_mut(i).map(|s| (s, i, tag))
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
pub fn find(cfg: &KernelConfig, key: &FlowKey) -> Option<*mut HalfOpen> {
    find_hashed(cfg, key).map(|(s, _)| s)
}

/// As `find`, with the key's hash (for `empty`).
#[inline(always)]
pub fn find_hashed(cfg: &KernelConfig, key: &FlowKey) -> Option<(*mut HalfOpen, u64)> {
    let h = key.hash(cfg.hash_seed);
    client_slot(cfg, h)
        .filter(|s| holds(*s, h, key))
        .map(|s| (s, h))
}

/// Empties client slot `slot` (of hash `h`): its flow was promoted.
#[inline(always)]
pub fn empty(cfg: &KernelConfig, slot: *mut HalfOpen, h: u64) {
    // SAFETY: map value pointers, valid for this run.
    unsafe {
        (*slot).tag = 0;
        if let Some(t) = short_tag_of(cfg, h) {
            *t = 0;
        }
    }
}

/// The NAT slot of a half-open flow, if it still holds it.
#[inline(always)]
pub fn find_nat(cfg: &KernelConfig, key: &NatKey) -> Option<*mut HalfOpenNat> {
    nat_slot(cfg, key)
        .filter(|(s, _, tag)| nat_holds(*s, *tag, key))
        .map(|(s, _, _)| s)
}

/// Writes the NAT side of the half-open flow in `sc` (`nkey` -> `nval`)
/// into its slot, counting a handshake it takes the slot from. Reads only
/// the short tag: another tuple toward the same backend has another slot
/// or, a whole table of ports apart, another tag, so a matching short
/// tag is this tuple's (a retransmission).
#[inline(always)]
pub fn write_nat(cfg: &KernelConfig, service: u32, sc: &Scratch) {
    let Some((n, i, tag)) = nat_slot(cfg, &sc.nkey) else {
        return;
    };
    if let Some(t) = short_tag_at(&HALF_OPEN_NAT_TAGS, i) {
        let short = short_tag(tag);
        // SAFETY: map value pointers, valid for this run.
        unsafe {
            if *t != 0 && *t != short {
                bump(&SERVICE_STATS, service, |st| st.half_open_lost += 1);
            }
            put(&mut (*n).key, &sc.nkey);
            put(&mut (*n).nat, &sc.nval);
            (*n).tag = tag;
            *t = short;
        }
    }
}

/// Empties the NAT slot of half-open tuple `key` if it still holds it, so
/// a late answer on that tuple finds nothing (the flow moved on).
#[inline(always)]
pub fn forget_nat(cfg: &KernelConfig, key: &NatKey) {
    let Some((n, i, _)) = nat_slot(cfg, key).filter(|(n, _, tag)| nat_holds(*n, *tag, key)) else {
        return;
    };
    // SAFETY: map value pointers, valid for this run.
    unsafe {
        (*n).tag = 0;
        if let Some(t) = short_tag_at(&HALF_OPEN_NAT_TAGS, i) {
            *t = 0;
        }
    }
}
