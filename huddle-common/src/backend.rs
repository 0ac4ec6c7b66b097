//! Backends and the rings of them the program picks from.

use crate::*;

/// `Backend::flags` bits.
pub mod backend_flags {
    /// The backend is dead and the operator asked for its flows to move:
    /// a packet of an existing flow to it is balanced afresh.
    pub const MOVE_FLOWS: u32 = 1;
}

/// A backend, indexed by its id in `BACKENDS`.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    pub addr: Addr,
    pub port_be: u16,
    /// 0 for an unused slot.
    pub family: u8,
    /// The service the backend belongs to: lets a restarted control plane
    /// find each backend's id again (ids must not change under live flows).
    pub service: u8,
    pub flags: u32,
}
shared!(Backend, 24);

/// Words of a ring's membership bitmap (one bit per backend id).
pub const MEMBER_WORDS: usize = MAX_BACKENDS as usize / 64;

/// One service's active ring: backend ids, taken round robin, and the same
/// set as a bitmap, so the program can check in O(1) that what it picked
/// belongs to the ring it read (a torn read would not).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Ring {
    pub len: u32,
    pub _pad: u32,
    pub backends: [u32; RING_CAPACITY],
    pub members: [u64; MEMBER_WORDS],
}
shared!(Ring, 8 + 4 * RING_CAPACITY + 8 * MEMBER_WORDS);

impl Ring {
    pub const EMPTY: Ring = Ring {
        len: 0,
        _pad: 0,
        backends: [0; RING_CAPACITY],
        members: [0; MEMBER_WORDS],
    };

    /// Whether backend `id` is in the bitmap.
    #[inline(always)]
    #[must_use]
    pub fn has(&self, id: u32) -> bool {
        let w = (id / 64) as usize;
        w < MEMBER_WORDS && (self.members[w] >> (id % 64)) & 1 == 1
    }
}
