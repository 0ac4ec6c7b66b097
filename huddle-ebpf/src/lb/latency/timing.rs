//! Request latency, measured on the flows we forward: SYN to SYN-ACK, and
//! from client data that starts a turn to the backend's first data back
//! (time to first byte). Keep-alive connections give a sample per request.
//!
//! A flow holds at most one pending wait (`flow_flags::SYN_WAIT` or
//! `TURN_WAIT`, started at `turn_ns`). `PULSE` records, per backend, since
//! when it owes any answer at all, so the control plane sees a backend that
//! accepts work and never answers before any reply could tell it.

use crate::{
    lb::latency::sources,
    lb::maps::{bump, BACKEND_STATS, CONNECT, LATENCY, LATENCY_HEAVY, PULSE},
    net::family::Family,
    net::parse::{Packet, TCP_ACK, TCP_PSH, TCP_RST, TCP_SYN},
};
use aya_ebpf::helpers::bpf_ktime_get_ns;
use core::ptr::write_volatile;
use huddle_common::{
    flow_flags, latency_bucket, Addr, FlowKey, FlowValue, HUNG_EVIDENCE, LATENCY_BUCKETS,
};

/// The wait a new flow starts with: a SYN waits for its SYN-ACK, a first
/// datagram for its answer. Returns the flow's initial wait flags; the
/// wait itself starts with `start_first` once the flow is recorded.
#[inline(always)]
pub fn first_flags<F: Family>(p: &Packet<F>) -> u8 {
    if p.is_tcp() {
        if p.has_flag(TCP_SYN) {
            return flow_flags::SYN_WAIT;
        }
        return 0;
    }
    if p.payload_len > 0 {
        return flow_flags::TURN_WAIT;
    }
    0
}

/// Starts the wait `first_flags` named: `backend` owes an answer from now.
#[inline(always)]
pub fn start_first(flags: u8, backend: u32, now: u64) {
    if flags & flow_flags::SYN_WAIT != 0 {
        owe(backend, now, true);
    } else if flags & flow_flags::TURN_WAIT != 0 {
        start_turn(backend, now);
    }
}

/// A client RST within its window (`window`) gives up the flow's pending
/// turn, if any: not the backend's fault. One outside is a guess, and
/// leaves the turn owed (SNAT and DSR alike).
#[inline(always)]
pub fn abandon(f: *mut FlowValue, backend: u32) {
    // SAFETY: a map value pointer from a lookup in this run.
    unsafe {
        let flags = (*f).flags;
        if flags & flow_flags::TURN_WAIT != 0 {
            (*f).flags = flags & !flow_flags::TURN_WAIT;
            bump(&BACKEND_STATS, backend, |s| s.abandoned += 1);
        }
    }
}

/// Client to backend on an existing flow: data starts a turn unless one is
/// pending; a segment that ends a client write (PSH) restarts the pending
/// turn's wait. So the backend is timed from the request's last segment,
/// and a slow upload or a dribbled request is the client's time, not the
/// backend's. Only PSH segments read the clock again: restarting on every
/// segment cost an upload's packets 40-70 ns each (`huddle bench`,
/// established flow). A RST takes no part (see `abandon`).
#[inline(always)]
pub fn request<F: Family>(f: *mut FlowValue, p: &Packet<F>, backend: u32) {
    // SAFETY: a map value pointer from a lookup in this run; racing CPUs
    // at worst lose one sample.
    unsafe {
        let flags = (*f).flags;
        if p.has_flag(TCP_RST) {
            return;
        }
        if p.payload_len == 0 || flags & flow_flags::SYN_WAIT != 0 {
            return;
        }
        if flags & flow_flags::TURN_WAIT != 0 {
            if p.has_flag(TCP_PSH) {
                (*f).turn_ns = bpf_ktime_get_ns();
            }
            return;
        }
        let now = bpf_ktime_get_ns();
        (*f).turn_ns = now;
        (*f).flags = flags | flow_flags::TURN_WAIT;
        start_turn(backend, now);
    }
}

/// A request turn starts at `backend`: counted, and owed.
#[inline(always)]
pub fn start_turn(backend: u32, now: u64) {
    bump(&BACKEND_STATS, backend, |s| s.turns += 1);
    owe(backend, now, false);
}

/// Records that `backend` owes an answer from `now` on, unless it already
/// owed one: then the turn is evidence, up to `HUNG_EVIDENCE` of them (at
/// most that many writes of the shared line per owed answer), dated by
/// its start. More of its request dates nothing: an upload to a hung
/// backend goes on (its kernel takes it) for as long as the upload lasts,
/// and dated by its last write one kept a SIGSTOPped backend in for 1.6 s.
#[inline(always)]
fn owe(backend: u32, now: u64, syn: bool) {
    if let Some(p) = PULSE.get_ptr_mut(backend) {
        // SAFETY: shared map value; plain loads and stores are atomic at
        // this width, and a lost race only delays detection.
        unsafe {
            if syn {
                if (*p).syn_wait_ns == 0 {
                    (*p).syn_wait_ns = now;
                }
            } else if (*p).turn_wait_ns == 0 {
                // In this order, so a tick never reads the new wait with
                // the last one's evidence.
                write_volatile(&mut (*p).evidence, 0);
                write_volatile(&mut (*p).turn_wait_ns, now);
            } else if (*p).evidence < HUNG_EVIDENCE {
                (*p).evidence += 1;
                (*p).evidence_ns = now;
            }
        }
    }
}

/// Backend to client: a SYN-ACK or RST clears the SYNs the backend owes;
/// the first answer to this flow's pending turn clears the turns it owes
/// and is a latency sample of the flow's `client`. Other data answers no
/// turn: a hung process's kernel goes on sending what it wrote before
/// (a download read slowly, retransmissions), and that must not keep it
/// alive. `f` is null when the flow is gone or no longer this backend's.
#[inline(always)]
pub fn reply<F: Family>(f: *mut FlowValue, p: &Packet<F>, backend: u32, client: &FlowKey) {
    let syn_answer = p.has_flag(TCP_SYN | TCP_RST);
    let data = p.payload_len > 0;
    if !syn_answer && !data {
        return;
    }
    if syn_answer {
        settle(backend, true, false);
    }
    if f.is_null() {
        return;
    }
    // SAFETY: as in `request`.
    unsafe {
        let flags = (*f).flags;
        if flags & (flow_flags::SYN_WAIT | flow_flags::TURN_WAIT) == 0 {
            return;
        }
        let waited = bpf_ktime_get_ns().wrapping_sub((*f).turn_ns);
        if flags & flow_flags::SYN_WAIT != 0 {
            if p.has_flag(TCP_RST) {
                (*f).flags = flags & !flow_flags::SYN_WAIT;
                bump(&BACKEND_STATS, backend, |s| s.refused += 1);
            } else if p.has_flag(TCP_SYN) && p.has_flag(TCP_ACK) {
                (*f).flags = flags & !flow_flags::SYN_WAIT;
                connect_sample(backend, waited);
            }
            return;
        }
        if data {
            (*f).flags = flags & !flow_flags::TURN_WAIT;
            settle(backend, false, true);
            ttfb_sample(backend, waited, &client.client, client.family);
        } else if p.has_flag(TCP_RST) {
            (*f).flags = flags & !flow_flags::TURN_WAIT;
            bump(&BACKEND_STATS, backend, |s| s.reset_turns += 1);
        }
    }
}

/// A SYN answered after `waited` ns: counted and put in `CONNECT`.
#[inline(always)]
pub fn connect_sample(backend: u32, waited: u64) {
    bump(&BACKEND_STATS, backend, |s| {
        s.syn_acks += 1;
        s.connect_ns += waited;
    });
    let b = latency_bucket(waited);
    bump(&CONNECT, backend, |l| {
        // The bound is already true; the verifier needs to see it.
        if b < LATENCY_BUCKETS {
            l.buckets[b] += 1;
        }
    });
}

/// A turn of `client` answered after `waited` ns: counted and put in
/// `LATENCY`, or `LATENCY_HEAVY` if the client is the backend's heavy
/// source (`sources`).
#[inline(always)]
pub fn ttfb_sample(backend: u32, waited: u64, client: &Addr, family: u8) {
    bump(&BACKEND_STATS, backend, |s| {
        s.answered += 1;
        s.ttfb_ns += waited;
    });
    let b = latency_bucket(waited);
    let hist = if sources::is_heavy(backend, client, family) {
        &LATENCY_HEAVY
    } else {
        &LATENCY
    };
    bump(hist, backend, |l| {
        // The bound is already true; the verifier needs to see it.
        if b < LATENCY_BUCKETS {
            l.buckets[b] += 1;
        }
    });
}

/// `backend` answered: it no longer owes SYN answers (`syn`) or request
/// answers (`data`) since any time.
#[inline(always)]
pub fn settle(backend: u32, syn: bool, data: bool) {
    if let Some(pulse) = PULSE.get_ptr_mut(backend) {
        // SAFETY: as in `owe`; read first so a busy backend's answers do
        // not all write the shared line.
        unsafe {
            if syn && (*pulse).syn_wait_ns != 0 {
                (*pulse).syn_wait_ns = 0;
            }
            if data && (*pulse).turn_wait_ns != 0 {
                (*pulse).turn_wait_ns = 0;
            }
        }
    }
}
