//! Address and port translation with incremental checksum updates.

use crate::net::parse::Packet;
use crate::{
    csum::{apply, diff16, diff32, fold, pseudo_rest},
    mem::put,
    net::family::{Family, V4, V6},
    net::partial,
};
use huddle_common::Addr;

/// Byte offsets of the checksum inside the L4 headers.
const TCP_CHECK: usize = 16;
const UDP_CHECK: usize = 6;

/// The four fields a translation sets, as bytes in network order (the
/// addresses where they lie, in a map value: no copies on the stack).
/// `was_src` and `was_dst` are the addresses the packet holds now, in
/// their 16-byte form in a map value (IPv6 sums its checksum change from
/// those: aligned words, where the packet's bytes would be read one by
/// one).
pub struct Tuple<'a, A = [u8; 4]> {
    pub src: &'a A,
    pub dst: &'a A,
    pub was_src: &'a Addr,
    pub was_dst: &'a Addr,
    pub sport: [u8; 2],
    pub dport: [u8; 2],
}

/// Rewrites addresses and ports of `p` to `to`, keeping both checksums valid.
/// A UDP checksum of 0 (none) stays 0; a computed 0 is sent as 0xffff.
/// True if the L4 checksum was left to offload (and stays so).
#[inline(always)]
pub fn rewrite(p: &Packet, to: &Tuple) -> bool {
    let (src, dst) = (u32::from_ne_bytes(*p.src()), u32::from_ne_bytes(*p.dst()));
    let addr_diff =
        diff32(src, u32::from_ne_bytes(*to.src)) + diff32(dst, u32::from_ne_bytes(*to.dst));
    // Word sums fold to what byte pairs do (2^16 = 1, one's complement).
    let was = u64::from(src) + u64::from(dst) + pseudo_rest(p.proto, partial::l4_len(p));
    // SAFETY: `parse` checked that the IP header lies inside the packet.
    unsafe {
        let ip = &mut *p.ip;
        ip.src_addr = *to.src;
        ip.dst_addr = *to.dst;
        ip.check = apply(u16::from_ne_bytes(ip.check), addr_diff).to_ne_bytes();
    }
    ports(p, to, addr_diff, was)
}

/// IPv6: no header checksum; the addresses count in the L4 one.
#[inline(always)]
pub fn rewrite6(p: &Packet<V6>, to: &Tuple<'_, [u8; 16]>) -> bool {
    let addr_diff = diff128(to.was_src, to.src) + diff128(to.was_dst, to.dst);
    let was = sum128(to.was_src) + sum128(to.was_dst) + pseudo_rest(p.proto, partial::l4_len(p));
    // SAFETY: `parse6` checked that the IP header lies inside the packet.
    unsafe {
        let ip = p.ip;
        put(&mut (*ip).src_addr, to.src);
        put(&mut (*ip).dst_addr, to.dst);
    }
    ports(p, to, addr_diff, was)
}

/// Sum of a 16-byte address in a map value, as four words (see `diff128`).
#[inline(always)]
fn sum128(a: &Addr) -> u64 {
    let w = a.as_ptr().cast::<u32>();
    let mut s = 0;
    let mut i = 0;
    while i < 4 {
        // SAFETY: as in `diff128`.
        s += u64::from(unsafe { w.add(i).read() });
        i += 1;
    }
    s
}

/// Sum of the changes from `old` to `new` for one 16-byte address; both
/// lie in map values (8-byte aligned), read as four words.
#[inline(always)]
pub fn diff128(old: &Addr, new: &Addr) -> u64 {
    let (o, n) = (old.as_ptr().cast::<u32>(), new.as_ptr().cast::<u32>());
    let mut d = 0;
    let mut i = 0;
    while i < 4 {
        // SAFETY: word `i` of 4 lies inside both arrays; map values are
        // 8-byte aligned, and so are these addresses in them.
        d += unsafe { diff32(o.add(i).read(), n.add(i).read()) };
        i += 1;
    }
    d
}

/// Sets the ports and updates the L4 checksum by `addr_diff` (the
/// pseudo-header's addresses) and the ports' change; `was` is the pseudo
/// header's sum before. A checksum left to offload (`net::partial`) holds
/// only that sum: it takes the addresses' change alone, and stays one
/// (`forward::finished` has it finished if the frame is sent): returned.
#[inline(always)]
fn ports<F: Family>(p: &Packet<F>, to: &Tuple<'_, F::Addr>, addr_diff: u64, was: u64) -> bool {
    let l4_diff = addr_diff
        + diff16(u16::from_ne_bytes(p.sport), u16::from_ne_bytes(to.sport))
        + diff16(u16::from_ne_bytes(p.dport), u16::from_ne_bytes(to.dport));
    // SAFETY: the parser checked that the whole fixed L4 header (20 bytes
    // TCP, 8 bytes UDP) lies inside the packet; every write is inside it.
    unsafe {
        let l4 = p.l4;
        *l4.cast::<[u8; 2]>() = to.sport;
        *l4.add(2).cast::<[u8; 2]>() = to.dport;
        let check = l4
            .add(if p.is_tcp() { TCP_CHECK } else { UDP_CHECK })
            .cast::<u16>();
        let old = check.read_unaligned();
        let partial = partial::is_partial(old, was);
        if partial {
            check.write_unaligned(fold(u64::from(old) + addr_diff));
        } else if p.is_tcp() {
            check.write_unaligned(apply(old, l4_diff));
        } else if old != 0 {
            let new = apply(old, l4_diff);
            check.write_unaligned(if new == 0 { 0xffff } else { new });
        }
        partial
    }
}

/// The rewrite of addresses and ports, per family.
pub trait Rewrite: Family {
    /// Rewrites addresses and ports, keeping checksums valid; true if the
    /// L4 checksum was left to offload.
    fn rewrite(p: &Packet<Self>, to: &Tuple<'_, Self::Addr>) -> bool;
}

impl Rewrite for V4 {
    #[inline(always)]
    fn rewrite(p: &Packet<V4>, to: &Tuple<'_, [u8; 4]>) -> bool {
        rewrite(p, to)
    }
}

impl Rewrite for V6 {
    #[inline(always)]
    fn rewrite(p: &Packet<V6>, to: &Tuple<'_, [u8; 16]>) -> bool {
        rewrite6(p, to)
    }
}
