//! Addresses as map keys hold them: 16 bytes, an IPv4 address in the first
//! 4 in network order.

/// A 16-byte address; IPv4 in the first four bytes, network order.
pub type Addr = [u8; 16];

/// The 16-byte form of an IPv4 address given in network byte order.
///
/// Made as one 128-bit value: built byte by byte, the zero tail became a
/// call to the BPF object's `memset`, a loop of byte stores (two per flow
/// key, about 6 ns of an established packet's path).
#[inline(always)]
#[must_use]
pub const fn addr_v4(octets: [u8; 4]) -> Addr {
    (u32::from_le_bytes(octets) as u128).to_le_bytes()
}

/// A 16-byte address as two little-endian words, for comparing and
/// hashing it without a byte loop.
#[inline(always)]
#[must_use]
pub const fn addr_words(a: &Addr) -> [u64; 2] {
    [
        u64::from_le_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]),
        u64::from_le_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]),
    ]
}
