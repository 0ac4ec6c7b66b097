//! Half-open flows: the direct-mapped slots, their short tags, and what a
//! SYN keeps for a retry.

use crate::*;

/// A half-open flow, client side: slot `hash(key) & half_open_mask` of
/// `HALF_OPEN`. A direct-mapped table instead of an LRU hash: a SYN costs
/// one slot write (no lock, no LRU lists to rotate, one cache line or two)
/// and a newer SYN hashing to a taken slot takes it, much as an LRU evicts
/// its oldest entry under a flood.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfOpen {
    /// `slot_tag(hash of key)`; 0: empty (never used, or promoted).
    pub tag: u64,
    pub key: FlowKey,
    pub flow: FlowValue,
    pub syn: SynCopy,
}
shared!(HalfOpen, 128);

/// What the balancer keeps of a client's SYN so that it can send it again
/// itself, to another backend, when the first refuses it (RST): the client
/// then never sees the refusal.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynCopy {
    /// The client's initial sequence number (host order).
    pub isn: u32,
    /// The SYN's window field, as sent (network order).
    pub window_be: u16,
    /// Bytes of `opts` in use: a multiple of 4, at most `SYN_OPTS`.
    pub opt_len: u8,
    /// Low four bits: backends tried after the first one (at most
    /// `MAX_SYN_RETRIES`); high four: NAT tuples tried after one a
    /// TIME_WAIT refused, toward the current backend (at most
    /// `MAX_TUPLE_RETRIES`). One byte: the struct has no other to spare.
    pub retries: u8,
    /// The SYN's TCP options (MSS, window scale, SACK, timestamps), so the
    /// connection keeps them on the next backend.
    pub opts: [u8; SYN_OPTS],
}

impl SynCopy {
    /// Backends tried after the first one.
    #[inline(always)]
    #[must_use]
    pub fn backends_tried(&self) -> u8 {
        self.retries & 0x0f
    }

    /// NAT tuples tried after a refused one, toward the current backend.
    #[inline(always)]
    #[must_use]
    pub fn tuples_tried(&self) -> u8 {
        self.retries >> 4
    }

    /// Counts one more NAT tuple tried toward the current backend.
    #[inline(always)]
    pub fn tried_tuple(&mut self) {
        self.retries += 0x10;
    }

    /// Counts one more backend tried; its tuples count afresh.
    #[inline(always)]
    pub fn tried_backend(&mut self) {
        self.retries = self.backends_tried() + 1;
    }
}

/// The NAT side of a half-open flow, so the backend's SYN-ACK finds its
/// client: slot `NatKey::half_open_slot` of `HALF_OPEN_NAT`.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfOpenNat {
    /// `slot_tag` of the key's hash without its NAT port; 0: empty.
    pub tag: u64,
    pub key: NatKey,
    pub nat: NatValue,
}
shared!(HalfOpenNat, 96);

/// The short tags of a half-open table's slots (`HALF_OPEN_TAGS` for
/// `HALF_OPEN`, `HALF_OPEN_NAT_TAGS` for `HALF_OPEN_NAT`): slot `i` is
/// lane `i % 16` of element `i / 16`. A SYN must know whether its slots
/// hold its own tuple (a retransmission) or another handshake (one it
/// takes over); read from the slots (8 and 6 MiB for 65,536), that was a
/// cache miss on almost every SYN. These tags take a quarter MiB each,
/// which stays in cache. Only a matching short tag sends a SYN on to the
/// client slot itself; the slots are only written.
///
/// Kept equal to the slots' tags wherever a slot's tag is set or cleared;
/// a lane of 0 where the slot is taken only costs a retransmitted SYN its
/// first backend (a data plane adopted from a build without this map).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfOpenTags {
    pub tags: [u32; HALF_OPEN_TAGS_PER_LINE as usize],
}
shared!(HalfOpenTags, 64);

/// Short tags to an element of `HALF_OPEN_TAGS`: one cache line.
pub const HALF_OPEN_TAGS_PER_LINE: u32 = 16;

/// Elements of `HALF_OPEN_TAGS` for `slots` half-open slots (a power of
/// two; at least one element).
#[must_use]
pub fn half_open_tag_lines(slots: u32) -> u32 {
    (slots / HALF_OPEN_TAGS_PER_LINE).max(1)
}

/// The short tag of a slot holding a key of hash `h`: never 0, and taken
/// from the bits the slot index does not use.
#[inline(always)]
#[must_use]
pub const fn short_tag(h: u64) -> u32 {
    ((h >> 32) as u32) | 1
}

/// The tag a slot holding a key of hash `h` carries: never 0.
#[inline(always)]
#[must_use]
pub const fn slot_tag(h: u64) -> u64 {
    h | 1
}
