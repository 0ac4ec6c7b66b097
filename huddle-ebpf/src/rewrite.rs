//! Address and port translation with incremental checksum updates.

use crate::{
    csum::{apply, diff16, diff32},
    parse::Packet,
};

/// Byte offsets of the checksum inside the L4 headers.
const TCP_CHECK: usize = 16;
const UDP_CHECK: usize = 6;

/// The four fields a translation sets, as bytes in network order.
pub struct Tuple {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
}

/// Rewrites addresses and ports of `p` to `to`, keeping both checksums valid.
/// A UDP checksum of 0 (none) stays 0; a computed 0 is sent as 0xffff.
#[inline(always)]
pub fn rewrite(p: &Packet, to: &Tuple) {
    let addr_diff = diff32(u32::from_ne_bytes(p.src), u32::from_ne_bytes(to.src))
        + diff32(u32::from_ne_bytes(p.dst), u32::from_ne_bytes(to.dst));
    let l4_diff = addr_diff
        + diff16(u16::from_ne_bytes(p.sport), u16::from_ne_bytes(to.sport))
        + diff16(u16::from_ne_bytes(p.dport), u16::from_ne_bytes(to.dport));
    // SAFETY: `parse` checked that the IP header and the whole fixed L4
    // header (20 bytes TCP, 8 bytes UDP) lie inside the packet; every write
    // below is inside those headers.
    unsafe {
        let ip = &mut *p.ip;
        ip.src_addr = to.src;
        ip.dst_addr = to.dst;
        ip.check = apply(u16::from_ne_bytes(ip.check), addr_diff).to_ne_bytes();

        let l4 = p.l4;
        *l4.cast::<[u8; 2]>() = to.sport;
        *l4.add(2).cast::<[u8; 2]>() = to.dport;
        if p.is_tcp() {
            let check = l4.add(TCP_CHECK).cast::<u16>();
            check.write_unaligned(apply(check.read_unaligned(), l4_diff));
        } else {
            let check = l4.add(UDP_CHECK).cast::<u16>();
            let old = check.read_unaligned();
            if old != 0 {
                let new = apply(old, l4_diff);
                check.write_unaligned(if new == 0 { 0xffff } else { new });
            }
        }
    }
}
