//! The client's place in its sequence space, kept in each open TCP flow
//! (`seqwin`), so that a FIN or RST closes a flow only from near where
//! its client is: a spoofer who guessed a tuple must guess that too. In
//! source NAT the record is `FlowValue::synack_seq`; a DSR flow has no NAT
//! port, and that word holds it, 64 KiB coarse (`seqwin::coarse`), since
//! `synack_seq` times its turns (`ackclock`).

use huddle_common::{flow_flags, seqwin, FlowValue};

/// The client's record in flow `v`.
#[inline(always)]
fn record(v: &FlowValue, dsr: bool) -> u32 {
    if dsr {
        seqwin::widen(v.nat_port_be)
    } else {
        v.synack_seq
    }
}

/// The record a new DSR flow starts with, from its first segment (a SYN's
/// is its initial sequence number); UDP keeps none.
#[inline(always)]
pub fn first_dsr_record(tcp: bool, seq: u32) -> u16 {
    if tcp {
        seqwin::coarse(seq)
    } else {
        0
    }
}

/// Whether a client's FIN or RST (sequence number `seq`) may close the
/// open flow `f`: within the client's window. A flow already closing has
/// nothing more to lose (in source NAT its record then holds a timestamp).
#[inline(always)]
pub fn close_in_window(f: *mut FlowValue, seq: u32, dsr: bool) -> bool {
    // SAFETY: a map value pointer from a lookup in this run.
    let v = unsafe { *f };
    v.flags & flow_flags::CLOSING != 0 || seqwin::within(record(&v, dsr), seq)
}

/// Moves the client's record of the open flow `f` (read as `v`) if the
/// segment at `seq` is far enough past it (a write per 256 KiB sent).
#[inline(always)]
pub fn note_client_seq(f: *mut FlowValue, v: &FlowValue, seq: u32, dsr: bool) {
    if let Some(n) = seqwin::advanced(record(v, dsr), seq) {
        // SAFETY: a map value pointer from a lookup in this run.
        unsafe {
            if dsr {
                (*f).nat_port_be = seqwin::coarse(n);
            } else {
                (*f).synack_seq = n;
            }
        }
    }
}
