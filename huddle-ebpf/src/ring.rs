//! Backend choice for a new flow: the next entry of the service's live ring.
//!
//! The control plane never writes the live slot. It writes the other slot
//! whole, then bumps the generation. A reader takes the generation, reads
//! the slot it names, then reads the generation again: if it changed, a
//! writer may have started on the slot just read (only a second swap
//! rewrites it), so the read is retried. On x86 loads are not reordered
//! with loads and stores are seen in order, so an unchanged generation
//! proves the slot was not being rewritten; the control plane also leaves
//! a just-retired slot alone for a while before reusing it.

use crate::maps::{global, RINGS, RING_GEN, RR_CURSOR};
use core::ptr::read_volatile;
use huddle_common::{ring_slot, MEMBER_WORDS, RING_CAPACITY};

const READ_TRIES: u32 = 3;

/// Backend id for the next new flow of `service`, or `None` if its ring is
/// empty.
#[inline(always)]
pub fn pick(service: u32) -> Option<u32> {
    let generation = RING_GEN.get_ptr(service)?;
    let cursor = RR_CURSOR.get_ptr_mut(service)?;
    // SAFETY: per-CPU element, only this CPU touches it.
    let turn = unsafe {
        let c = *cursor;
        *cursor = c.wrapping_add(1);
        c
    };
    for _ in 0..READ_TRIES {
        // SAFETY: map value pointers from lookups are valid for the whole
        // program run. Volatile, so every read goes to memory and the
        // compiler keeps them in program order (the BPF backend has no
        // fence instruction to select).
        let g1 = unsafe { read_volatile(generation) };
        let ring = RINGS.get_ptr(ring_slot(service, g1))?;
        let len = unsafe { read_volatile(&(*ring).len) };
        let mut chosen = None;
        if len != 0 {
            // Only this check bounds `idx` for the verifier: a separate
            // `len <= RING_CAPACITY` test would let LLVM drop it.
            let idx = (turn % len) as usize;
            if idx < RING_CAPACITY {
                chosen = Some(unsafe { read_volatile(&(*ring).backends[idx]) });
            }
        }
        let g2 = unsafe { read_volatile(generation) };
        if g1 == g2 {
            if let Some(id) = chosen {
                // SAFETY: as above; the bitmap read is bounds-checked.
                let member = unsafe {
                    let w = (id / 64) as usize;
                    w < MEMBER_WORDS && (read_volatile(&(*ring).members[w]) >> (id % 64)) & 1 == 1
                };
                if !member {
                    global(|s| s.ring_stray += 1);
                    continue;
                }
            }
            return chosen;
        }
        global(|s| s.ring_retry += 1);
    }
    None
}
