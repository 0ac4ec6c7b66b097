//! Internet checksums: incremental updates (RFC 1624), and sums of whole
//! headers the program writes itself.
//!
//! Values are taken as they lie in memory (native-endian loads of network
//! order bytes); one's-complement sums do not depend on byte order as long
//! as the checksum field is read and written the same way.

/// Sum of the changes from `old` to `new` for one 32-bit field.
#[inline(always)]
pub fn diff32(old: u32, new: u32) -> u64 {
    u64::from(!old & 0xffff)
        + u64::from((!old) >> 16)
        + u64::from(new & 0xffff)
        + u64::from(new >> 16)
}

/// Sum of the changes from `old` to `new` for one 16-bit field.
#[inline(always)]
pub fn diff16(old: u16, new: u16) -> u64 {
    u64::from(!old) + u64::from(new)
}

/// Applies an accumulated difference to a checksum field's value.
#[inline(always)]
pub fn apply(check: u16, diff: u64) -> u16 {
    !fold(u64::from(!check) + diff)
}

/// A one's-complement sum folded to 16 bits, not complemented: what a
/// checksum field left to offload holds of its pseudo header
/// (`net::partial`).
#[inline(always)]
pub fn fold(mut s: u64) -> u16 {
    // Four folds bring any sum of a few dozen terms to 16 bits.
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// Sum of the 16-bit words of `b`; `apply(0xffff, sum)` (a zero field
/// updated by the whole sum) is the checksum of a header written afresh.
#[inline(always)]
pub fn words<const N: usize>(b: &[u8; N]) -> u64 {
    let mut s = 0u64;
    let mut i = 0;
    while i + 1 < N {
        s += u64::from(u16::from_ne_bytes([b[i], b[i + 1]]));
        i += 2;
    }
    s
}

/// Sum of a TCP pseudo header (addresses, protocol, TCP length) of either
/// family: both sum to the same words but for the addresses' width.
#[inline(always)]
pub fn tcp_pseudo<const N: usize>(src: &[u8; N], dst: &[u8; N], tcp_len: u16) -> u64 {
    words(src) + words(dst) + pseudo_rest(huddle_common::PROTO_TCP, tcp_len)
}

/// The words of a TCP or UDP pseudo header but the addresses.
#[inline(always)]
pub fn pseudo_rest(proto: u8, l4_len: u16) -> u64 {
    u64::from(u16::from_ne_bytes([0, proto])) + u64::from(u16::from_ne_bytes(l4_len.to_be_bytes()))
}
