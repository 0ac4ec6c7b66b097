//! TCP options: what a retry and the TIME_WAIT check keep of a segment's.

use crate::net::{family::Family, parse::Packet};
use aya_ebpf::{helpers::generated::bpf_xdp_load_bytes, programs::XdpContext};
use huddle_common::{headers::TCP_LEN, SynCopy, SYN_OPTS};

/// Keeps what a retry needs of the client's SYN `p` in `syn`; `retries`
/// is how many backends this connection has tried after its first.
#[inline(always)]
pub fn keep_syn<F: Family>(ctx: &XdpContext, p: &Packet<F>, syn: *mut SynCopy, retries: u8) {
    // SAFETY: `parse` checked that the 20-byte TCP header lies inside the
    // packet; `syn` is a map value pointer, valid for this run.
    unsafe {
        let doff = usize::from(*p.l4.add(12) >> 4) * 4;
        let len = doff.wrapping_sub(TCP_LEN) & 0x3c;
        (*syn).isn = p.seq;
        (*syn).window_be = p.l4.add(14).cast::<u16>().read_unaligned();
        (*syn).retries = retries;
        (*syn).opt_len = 0;
        // `parse` checked that `doff` bytes of header lie in the packet.
        if len > 0
            && len <= SYN_OPTS
            && bpf_xdp_load_bytes(
                ctx.ctx.cast(),
                F::OPTS_AT as u32,
                (*syn).opts.as_mut_ptr().cast(),
                len as u32,
            ) == 0
        {
            (*syn).opt_len = len as u8;
        }
    }
}
