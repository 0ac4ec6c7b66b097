//! TCP and UDP checksums left to offload. A veth hands XDP frames whose
//! L4 checksum field holds only the pseudo header's sum (the kernel's
//! CHECKSUM_PARTIAL): a sender on a veth with checksum offload on (the
//! default), or GRO on a bridge port whose coalesced segments the next
//! port cuts up again, leaves the rest to a device that never comes. Sent
//! on by XDP_TX or a redirect, such a frame loses that state and its
//! receiver drops it as corrupt. So the program finishes the sum itself
//! before it sends one (`complete`, in a program of its own: `lb::finish`);
//! a frame it hands to the kernel keeps
//! the partial sum, updated for a rewrite, as the kernel expects.
//!
//! Which frames: the field equals the folded pseudo header sum. A full
//! checksum can equal it by chance (1 in 65,536); finishing that one sums
//! to the same full checksum, so the test needs no skb state.

use crate::{csum, net::family::Family, net::parse::Packet};
use aya_ebpf::{
    helpers::generated::{bpf_csum_diff, bpf_xdp_load_bytes, bpf_xdp_store_bytes},
    macros::map,
    maps::PerCpuArray,
    programs::XdpContext,
};
use huddle_common::PROTO_TCP;

/// `bpf_csum_diff` sums at most 512 bytes a call.
const CHUNK: u32 = 512;
/// The longest L4 segment finished: a 9,000-byte jumbo frame's, with room.
pub const MAX_L4: u32 = 20 * CHUNK;
/// Offsets of the checksum in the TCP and UDP headers.
const TCP_CHECK: u32 = 16;
const UDP_CHECK: u32 = 6;

/// Per-CPU room to copy a chunk of the segment into (the frame may be
/// made of several buffers), with 4 bytes to pad the last one with zeros.
#[map]
static CSUM_BUF: PerCpuArray<[u8; CHUNK as usize + 4]> = PerCpuArray::with_max_entries(1, 0);

/// Length of `p`'s TCP or UDP segment (header and payload).
#[inline(always)]
pub fn l4_len<F: Family>(p: &Packet<F>) -> u16 {
    p.tot_len.wrapping_sub(F::IP_LEN as u16)
}

/// Whether `field`, a TCP or UDP checksum of a segment with this pseudo
/// header sum, was left to offload. A UDP checksum of 0 (none) never is.
#[inline(always)]
pub fn is_partial(field: u16, pseudo: u64) -> bool {
    field != 0 && field == csum::fold(pseudo)
}

/// Whether `p`'s checksum, as it is now, was left to offload (for the
/// paths that do not rewrite the segment: DSR).
#[inline(always)]
pub fn left_to_offload<F: Family>(p: &Packet<F>) -> bool {
    let at = if p.is_tcp() { TCP_CHECK } else { UDP_CHECK };
    // SAFETY: the parser checked the whole fixed L4 header is in bounds.
    let field = unsafe { p.l4.add(at as usize).cast::<u16>().read_unaligned() };
    let pseudo =
        F::addr_sum(p.src()) + F::addr_sum(p.dst()) + csum::pseudo_rest(p.proto, l4_len(p));
    is_partial(field, pseudo)
}

/// Where `p`'s L4 header starts in the frame.
#[inline(always)]
pub fn l4_offset<F: Family>(ctx: &XdpContext, p: &Packet<F>) -> u32 {
    (p.l4 as usize).wrapping_sub(ctx.data()) as u32
}

/// Sums the `len` bytes of the `proto` segment at `off` as they are (its
/// checksum field holds the pseudo header's sum, so the whole is the full
/// sum) and writes the complement into the field. False if it could not
/// (a segment longer than `MAX_L4`): the frame is dropped rather than
/// sent corrupt. Run by the checksum program only (`lb::finish`).
#[inline(always)]
pub fn complete(ctx: &XdpContext, off: u32, len: u32, proto: u8) -> bool {
    let Some(buf) = CSUM_BUF.get_ptr_mut(0) else {
        return false;
    };
    let udp = proto != PROTO_TCP;
    let at = if udp { UDP_CHECK } else { TCP_CHECK };
    if len > MAX_L4 || len < at + 2 {
        return false;
    }
    let mut sum = 0u64;
    let mut done = 0u32;
    let mut i = 0;
    while i < MAX_L4 / CHUNK {
        let left = len.wrapping_sub(done);
        // Read back through memory: LLVM would otherwise test `done ==
        // len` instead, which tells the verifier nothing of `left`, and a
        // load of `left` bytes must be known not to be empty.
        // SAFETY: a local, read right after it is written.
        let left = unsafe { core::ptr::read_volatile(&left) };
        if left == 0 || left > MAX_L4 {
            break;
        }
        let n = if left > CHUNK { CHUNK } else { left };
        // SAFETY: `buf` is this CPU's element, CHUNK + 4 bytes; `n` is
        // 1..=CHUNK, and the 3 bytes after it are inside the element.
        unsafe {
            if bpf_xdp_load_bytes(ctx.ctx.cast(), off + done, buf.cast(), n) != 0 {
                return false;
            }
            // The last chunk may end mid-word: zeros pad it (a chunk
            // starts at an even offset, so the pairs of bytes stay).
            let b = (*buf).as_mut_ptr();
            let k = (n & 0x3ff) as usize;
            if k <= CHUNK as usize {
                b.add(k).cast::<[u8; 3]>().write_unaligned([0; 3]);
            }
            let padded = (n + 3) & !3;
            let part = bpf_csum_diff(core::ptr::null_mut(), 0, buf.cast(), padded, 0);
            if part < 0 {
                return false;
            }
            sum += part as u64 & 0xffff_ffff;
        }
        done += n;
        i += 1;
    }
    if done != len {
        return false;
    }
    let mut full = !csum::fold(sum);
    if udp && full == 0 {
        full = 0xffff;
    }
    let bytes = full.to_ne_bytes();
    // SAFETY: plain helper call; `bytes` is 2 bytes on the stack.
    unsafe { bpf_xdp_store_bytes(ctx.ctx.cast(), off + at, bytes.as_ptr() as *mut _, 2) == 0 }
}
