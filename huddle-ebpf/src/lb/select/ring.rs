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

use crate::lb::maps::{global, RINGS, RING_GEN, RR_CURSOR};
use aya_ebpf::helpers::bpf_get_prandom_u32;
use core::ptr::read_volatile;
use huddle_common::{ring_slot, RING_CAPACITY};

const _: () = assert!(RING_CAPACITY.is_power_of_two());

const READ_TRIES: u32 = 3;

/// The next entry of `service`'s ring for a new flow, advancing this CPU's
/// round-robin position by one, and a random other entry (the same when
/// the ring has one: a second choice, so that the work a backend is passed
/// over for spreads over all the others, not onto its neighbour); `None`
/// if the ring is empty.
#[inline(always)]
pub fn pick(service: u32) -> Option<(u32, u32)> {
    // SAFETY: plain helper call.
    let r = unsafe { bpf_get_prandom_u32() };
    let generation = RING_GEN.get_ptr(service)?;
    let cursor = RR_CURSOR.get_ptr_mut(service)?;
    // SAFETY: per-CPU element, only this CPU touches it.
    let turn = unsafe { *cursor };
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
            // The cursor stays below the ring's length, so no division
            // but after a swap to a shorter ring (three divisions were 4%
            // of a new flow's samples); the random step is scaled, not
            // divided, into 0..len - 1.
            // The masks bound the indexes for the verifier (a comparison
            // LLVM may move away from the access); `len` is at most
            // RING_CAPACITY, a power of two, so they change nothing.
            let at = if turn < len { turn } else { turn % len };
            let step = ((u64::from(r) * u64::from(len - 1)) >> 32) as u32;
            let mut other = at + 1 + step;
            if other >= len {
                other -= len;
            }
            let after = at + 1;
            // SAFETY: as for the cursor above.
            unsafe { *cursor = if after < len { after } else { 0 } };
            let idx = at as usize & (RING_CAPACITY - 1);
            let next = other as usize & (RING_CAPACITY - 1);
            {
                chosen = Some(unsafe {
                    (
                        read_volatile(&(*ring).backends[idx]),
                        read_volatile(&(*ring).backends[next]),
                    )
                });
            }
        }
        let g2 = unsafe { read_volatile(generation) };
        if g1 == g2 {
            return chosen;
        }
        global(|s| s.ring_retry += 1);
    }
    None
}
