//! Backends and the rings of them the program picks from.

use crate::*;

/// `Backend::flags` bits.
pub mod backend_flags {
    /// The backend is dead and the operator asked for its flows to move:
    /// a packet of an existing flow to it is balanced afresh.
    pub const MOVE_FLOWS: u8 = 1;
}

/// A backend, indexed by its id in `BACKENDS`.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backend {
    pub addr: Addr,
    pub port_be: u16,
    /// 0 for an unused slot.
    pub family: u8,
    pub flags: u8,
    /// The service the backend belongs to: lets a restarted control plane
    /// find each backend's id again (ids must not change under live flows),
    /// and the program check that an id it picked is the service's.
    pub service: u32,
}
shared!(Backend, 24);

/// One service's active ring: backend ids, taken round robin. (A bitmap
/// of its members, one bit per possible backend id, took 8 KiB a ring at
/// 65,536 backends; the program checks a picked backend's `service`
/// instead.)
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Ring {
    pub len: u32,
    pub _pad: u32,
    pub backends: [u32; RING_CAPACITY],
}
shared!(Ring, 8 + 4 * RING_CAPACITY);

impl Ring {
    pub const EMPTY: Ring = Ring {
        len: 0,
        _pad: 0,
        backends: [0; RING_CAPACITY],
    };
}
