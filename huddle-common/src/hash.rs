//! The keyed hash over 40-byte keys, and keys built from words.

use crate::*;

/// Hash of five 64-bit words with a secret seed (multiply-xorshift, as in
/// splitmix64): cheap in BPF, and without the seed nobody can predict
/// which slot a tuple takes.
#[inline(always)]
#[must_use]
pub fn hash_words(w: &[u64; 5], seed: u64) -> u64 {
    hash_words_masked(w, u64::MAX, seed)
}

/// `hash_words` with the fifth word ANDed with `last`.
#[inline(always)]
#[must_use]
pub(crate) fn hash_words_masked(w: &[u64; 5], last: u64, seed: u64) -> u64 {
    let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut i = 0;
    while i < 5 {
        let word = if i == 4 { w[i] & last } else { w[i] };
        h = (h ^ word).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 31;
        i += 1;
    }
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 29)
}

/// The bits of `NatKey`'s fifth 64-bit word (bytes 32..40, little-endian)
/// that hold `nat_port_be`.
pub(crate) const NAT_PORT_BITS: u64 = 0xffff_0000;

const _: () = assert!(core::mem::offset_of!(NatKey, nat_port_be) == 34);

const _: () = assert!(cfg!(target_endian = "little"));

/// The last word of a `FlowKey` or `NatKey` (two ports, protocol,
/// family, zero padding), built in a register.
#[inline(always)]
#[must_use]
pub(crate) const fn key_tail(port_a_be: u16, port_b_be: u16, proto: u8, family: u8) -> u64 {
    port_a_be as u64 | (port_b_be as u64) << 16 | (proto as u64) << 32 | (family as u64) << 40
}

/// A 40-byte key from its five words.
///
/// Keys are made this way, not field by field, because the kernel hashes
/// and compares a key in 4- and 8-byte loads: a load that spans two of
/// the fields' narrow stores cannot be forwarded from the store buffer,
/// and stalls until both stores retire (three such stalls per lookup
/// cost an established packet about 20 ns).
#[inline(always)]
pub(crate) const fn key_from_words<K: Copy>(w: [u64; 5]) -> K {
    const { assert!(size_of::<K>() == 40) };
    // SAFETY: only instantiated for FlowKey and NatKey, 40 bytes of
    // integers and byte arrays, for which any bit pattern is valid.
    unsafe { core::mem::transmute_copy::<[u64; 5], K>(&w) }
}
