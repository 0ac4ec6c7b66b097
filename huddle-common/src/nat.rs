//! Source NAT: the NAT table's key and value, the walk's cursors, the
//! TIME_WAIT hints and the NAT_USED filter.

use crate::*;

/// Value of `TW_HINTS`: a tuple whose last connection the backend closed
/// first, in the run before a fresh start: the client's last timestamp
/// and when the flow closed. A fresh data plane has no flows to ask, so
/// without these it would hand such a tuple to a SYN the backend's
/// TIME_WAIT refuses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TwHint {
    pub tsval: u32,
    pub _pad: u32,
    pub closed_ns: u64,
}
shared!(TwHint);

/// Most `TW_HINTS` entries.
pub const MAX_TW_HINTS: u32 = 65_536;

/// Key of `NAT`: a reply as the backend sends it.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NatKey {
    pub backend: Addr,
    /// The balancer's SNAT address.
    pub local: Addr,
    pub backend_port_be: u16,
    pub nat_port_be: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
shared!(NatKey, 40);

/// Value of `NAT`: the client flow a reply belongs to.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NatValue {
    pub flow: FlowKey,
    pub backend: u32,
    /// The backend's sequence number as `seqwin` records it (TCP; 0: none
    /// yet), written by the reply direction only.
    pub backend_seq: u32,
}
shared!(NatValue, 48);

/// Bytes of `NAT_USED` per element: one cache line of tuples.
pub const NAT_USED_LINE: usize = 64;

/// The most memory `NAT_USED` may take; past it the filter is off.
pub const MAX_NAT_USED_BYTES: u64 = 64 << 20;

/// What a `NAT_USED` byte says of its tuple. 0: `NAT` holds nothing for
/// it. 1: `NAT` may hold a live flow's entry (a walk asks `NAT`). From
/// `DONE_FIRST` on: `NAT` holds the entry of a TCP flow that both
/// sides finished (each sent its FIN, or one a RST) with no TIME_WAIT on
/// the backend, last heard of at the tick the byte keeps. Once that
/// is `QUIET_TICKS` old, a SYN takes the tuple with no lookup at all:
/// the old flow's entries stay until the new flow's promotion overwrites
/// the `NAT` one and the LRU evicts the flow-table one, and by then no
/// packet of the old flow is translated (it is past `NAT_LINGER_NS`).
pub mod nat_used {
    /// Nothing in `NAT`.
    pub const FREE: u8 = 0;
    /// Maybe a live flow's.
    pub const MAYBE: u8 = 1;
    /// The first "finished at tick t" value: `DONE_FIRST + t`.
    pub const DONE_FIRST: u8 = 2;
    /// Ticks the byte tells apart (it wraps: a tuple idle longer reads as
    /// any age, and a young one is looked up as before).
    pub const TICKS: u64 = 256 - DONE_FIRST as u64;
    /// A tick: 2^30 ns (1.07 s).
    pub const TICK_SHIFT: u32 = 30;
    /// Age in ticks a finished tuple must reach to be taken without a
    /// lookup: over two whole ticks, so its flow has been silent longer
    /// than `NAT_LINGER_NS` on any CPU's clock.
    pub const QUIET_TICKS: u64 = 3;
    /// How long after its flow's last packet a finished tuple is surely
    /// taken without a lookup.
    pub const QUIET_NS: u64 = QUIET_TICKS << TICK_SHIFT;

    const _: () = assert!((QUIET_TICKS - 1) << TICK_SHIFT > crate::NAT_LINGER_NS);

    /// The byte of a tuple whose flow finished, heard of last at `now_ns`.
    #[inline(always)]
    #[must_use]
    pub fn done(now_ns: u64) -> u8 {
        DONE_FIRST + ((now_ns >> TICK_SHIFT) % TICKS) as u8
    }

    /// Whether byte `b` says its tuple's flow finished and has been
    /// silent long enough at `now_ns` to take the tuple without a lookup.
    #[inline(always)]
    #[must_use]
    pub fn quiet(b: u8, now_ns: u64) -> bool {
        if b < DONE_FIRST {
            return false;
        }
        let then = u64::from(b - DONE_FIRST);
        let age = ((now_ns >> TICK_SHIFT) % TICKS + TICKS - then) % TICKS;
        age >= QUIET_TICKS
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        const T: u64 = 1 << TICK_SHIFT;

        #[test]
        fn a_finished_tuple_is_quiet_only_after_the_linger_on_every_clock() {
            for start in [0, 5 * T + 17, (TICKS - 1) * T + T / 2, 1 << 50] {
                let b = done(start);
                assert!(b >= DONE_FIRST);
                // Just before two whole ticks plus what the linger asks.
                for dt in [0, 1, crate::NAT_LINGER_NS, 2 * T - 1] {
                    assert!(!quiet(b, start + dt), "start {start}, dt {dt}");
                }
                assert!(quiet(b, start + QUIET_NS), "start {start}");
                assert!(quiet(b, start + (TICKS - 1) * T), "start {start}");
            }
        }

        #[test]
        fn free_and_maybe_are_never_quiet() {
            for now in [0, T, 1 << 50] {
                assert!(!quiet(FREE, now));
                assert!(!quiet(MAYBE, now));
            }
        }
    }
}

/// Backend ids `NAT_USED` covers: `0..NAT_USED_BACKENDS`, which the
/// control plane hands out first; new flows toward the others look their
/// tuple up in `NAT`.
pub const NAT_USED_BACKENDS: u32 = 256;

/// Tuples per backend id that `NAT_USED` covers: every (SNAT address,
/// port) a walk of `slices` slices of `slice_ports` ports over
/// `snat_total` addresses hands out; 0 (no filter) when
/// `NAT_USED_BACKENDS` times that would take more than
/// `MAX_NAT_USED_BYTES`.
#[must_use]
pub fn nat_used_per_backend(slice_ports: u16, slices: u16, snat_total: u16) -> u32 {
    let per = u64::from(slice_ports) * u64::from(slices) * u64::from(snat_total);
    if per * u64::from(NAT_USED_BACKENDS) > MAX_NAT_USED_BYTES {
        0
    } else {
        per as u32
    }
}

/// Elements of `NAT_USED` for `per_backend` tuples per backend id (at
/// least one: a map cannot be empty).
#[must_use]
pub fn nat_used_lines(per_backend: u32) -> u32 {
    let bytes = u64::from(per_backend) * u64::from(NAT_USED_BACKENDS);
    (bytes.div_ceil(NAT_USED_LINE as u64) as u32).max(1)
}

impl NatKey {
    /// The key of a reply from `backend`:`backend_port_be` to SNAT address
    /// `local`, port `nat_port_be`.
    #[inline(always)]
    #[must_use]
    pub fn new(
        local: Addr,
        backend: Addr,
        backend_port_be: u16,
        nat_port_be: u16,
        proto: u8,
        family: u8,
    ) -> NatKey {
        let [b0, b1] = addr_words(&backend);
        let [l0, l1] = addr_words(&local);
        key_from_words([
            b0,
            b1,
            l0,
            l1,
            key_tail(backend_port_be, nat_port_be, proto, family),
        ])
    }

    /// Where this tuple's half-open flow sits in the half-open NAT table
    /// of `mask` + 1 slots (before the mask), and the tag it carries
    /// there: a hash of every field but the NAT port, plus the port's
    /// offset from `port_min`. The NAT walk hands out consecutive ports
    /// toward a backend, so consecutive SYNs write neighbouring slots, a
    /// cache line already fetched or fetched ahead by the prefetcher,
    /// rather than a cold one anywhere in the table. Ports a whole table
    /// apart share a slot: the lap (the offset's bits above the mask) is
    /// in the tag, so their tags, short ones too, differ.
    #[inline(always)]
    #[must_use]
    pub fn half_open_slot(&self, seed: u64, port_min: u16, mask: u32) -> (u32, u64) {
        // SAFETY: as for `FlowKey::hash`.
        let w: &[u64; 5] = unsafe { &*(self as *const NatKey).cast() };
        let base = hash_words_masked(w, !NAT_PORT_BITS, seed);
        let offset = u32::from(u16::from_be(self.nat_port_be).wrapping_sub(port_min));
        let lap = u64::from(offset & !mask).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        ((base as u32).wrapping_add(offset), slot_tag(base ^ lap))
    }
}

/// Per backend, per CPU: the next NAT tuple this CPU hands out toward the
/// backend, walking its slice (ports x SNAT addresses) in order, so a
/// tuple comes back only after every other one of the slice was used:
/// the oldest first, never a random recent one still in TIME_WAIT.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatCursor {
    /// Next port, as an offset into this CPU's slice.
    pub port: u32,
    /// Index of the SNAT address that port goes with; the walk takes
    /// every port of one address, then of the next.
    pub addr: u32,
    /// When the current round over all tuples started.
    pub round_ns: u64,
    /// 1: the last round took less than `TIME_WAIT_NS`, so tuples handed
    /// out now may meet a TIME_WAIT on the backend (counted).
    pub early: u32,
    pub _pad: u32,
}
shared!(NatCursor, 24);
