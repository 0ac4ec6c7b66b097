//! Latency of DSR flows, whose replies never cross the balancer: the
//! client's own segments say when the backend answered. The client's ACK
//! that completes the handshake comes one client round trip after the
//! backend's SYN-ACK; its first ACK that acknowledges server bytes past
//! those it had acknowledged when it sent a request comes one round trip
//! after the backend's first answer byte. So connect samples are SYN-ACK
//! time plus a round trip, and request samples time to first byte plus a
//! round trip (the control plane subtracts the backend's own median
//! connect sample, its clients' round trip, from them). Only an ACK
//! without data times an answer: one riding on the client's next request
//! came when the client chose to write. A request whose client
//! acknowledges nothing new is a turn the backend still owes, as in SNAT
//! mode, so a hung backend shows in `PULSE` the same way.

use crate::{
    lb::latency::timing,
    lb::maps::{bump, BACKEND_STATS},
    net::family::Family,
    net::parse::{Packet, TCP_ACK, TCP_PSH, TCP_RST},
};
use aya_ebpf::helpers::bpf_ktime_get_ns;
use huddle_common::{flow_flags, FlowValue};

/// The client's ACK completed the handshake of `flow` (being promoted).
#[inline(always)]
pub fn handshake(flow: &mut FlowValue, backend: u32, now: u64) {
    if flow.flags & flow_flags::SYN_WAIT == 0 {
        return;
    }
    flow.flags &= !flow_flags::SYN_WAIT;
    timing::settle(backend, true, false);
    timing::connect_sample(backend, now.wrapping_sub(flow.turn_ns));
}

/// A client segment of an established DSR flow: first settles a pending
/// turn its ACK answers, then starts one if it carries request data.
/// `FlowValue::synack_seq` holds, during a turn, the client's ACK number
/// when the turn started.
#[inline(always)]
pub fn request<F: Family>(f: *mut FlowValue, p: &Packet<F>, backend: u32) {
    // SAFETY: a map value pointer from a lookup in this run; racing CPUs
    // at worst lose one sample.
    unsafe {
        let mut flags = (*f).flags;
        // A RST settles nothing (`timing::abandon`, within its window).
        if p.has_flag(TCP_RST) {
            return;
        }
        let data = p.payload_len > 0 && flags & flow_flags::SYN_WAIT == 0;
        let answered = flags & flow_flags::TURN_WAIT != 0
            && p.has_flag(TCP_ACK)
            && (p.ack.wrapping_sub((*f).synack_seq) as i32) > 0;
        // More of a pending request: only a segment that ends a client
        // write (PSH) restarts its wait (see `timing::request`).
        let more = data && flags & flow_flags::TURN_WAIT != 0;
        if !answered && (!data || (more && !p.has_flag(TCP_PSH))) {
            return;
        }
        let now = bpf_ktime_get_ns();
        if answered {
            flags &= !flow_flags::TURN_WAIT;
            (*f).flags = flags;
            timing::settle(backend, false, true);
            // An ACK on the next request says when the client wrote it,
            // not when the answer came: a client holding back its ACKs
            // would time a healthy backend as slow as it likes.
            if data {
                bump(&BACKEND_STATS, backend, |s| s.unclocked += 1);
            } else {
                let waited = now.wrapping_sub((*f).turn_ns);
                timing::ttfb_sample(backend, waited, &F::wide(p.src()), F::FAMILY);
            }
        }
        if data {
            // More of an unanswered request restarts its wait (the
            // backend is timed from the request's last write); its ACK
            // mark stays that of the turn's first segment.
            (*f).turn_ns = now;
            if flags & flow_flags::TURN_WAIT == 0 {
                (*f).synack_seq = p.ack;
                (*f).flags = flags | flow_flags::TURN_WAIT;
                timing::start_turn(backend, now);
            }
        }
    }
}
