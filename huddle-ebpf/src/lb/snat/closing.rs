//! A client's segments after its backend closed first: their timestamp,
//! the one the backend's TIME_WAIT will hold, kept where `nat::reclaim`
//! finds it (the flow entry, and `TW_REUSED` for when the client reuses
//! its tuple and a new connection takes that entry).

use crate::lb::{
    maps::{BACKENDS, CONFIG, TW_REUSED},
    scratch,
    snat::{nat::flow_key, timewait},
};
use crate::net::{family::Family, parse::Packet, tcp};
use aya_ebpf::programs::XdpContext;
use huddle_common::{flow_flags, FlowValue, TwHint, PROTO_TCP};

/// A client segment `p` of source-NAT flow `f` after the backend's FIN:
/// keeps its timestamp, the one the backend's TIME_WAIT will hold. Its
/// own BPF function: the option copy's frame stays off `request`'s.
#[inline(never)]
pub fn note_client<F: Family>(ctx: &XdpContext, p: &Packet<F>, f: *mut FlowValue) {
    let Some(sc) = scratch::get() else {
        return;
    };
    // SAFETY: this CPU's element, used by this run only.
    let syn = unsafe { core::ptr::addr_of_mut!((*sc).syn) };
    tcp::keep_syn(ctx, p, syn, 0);
    // SAFETY: as above; `f` is a map value pointer valid for this run.
    unsafe {
        let ts = timewait::tsval(&*syn);
        // A segment with the timestamp already kept (a retransmit, or one
        // stamped in the same millisecond) changes nothing: no second write
        // of the shared map, and no hint put back once a SYN ended it.
        if ts != 0 && ts != (*f).synack_seq && (*f).flags & flow_flags::BACKEND_TIME_WAIT != 0 {
            (*f).synack_seq = ts;
            keep_time_wait(&*f);
        }
    }
}

/// Keeps, as `TW_REUSED`, what the flow `f` tells of its backend's
/// TIME_WAIT: the client's last timestamp (`synack_seq` once the backend
/// closed first) and when it closed. Written with each client segment
/// after the backend's FIN (the last is the one the TIME_WAIT holds), so
/// it outlives the flow entry a new connection on the client tuple takes.
/// Called from `note_client`, a BPF function of its own: in the
/// promotion's states the same write took the IPv6 program past the
/// verifier's 1M instructions.
#[inline(always)]
fn keep_time_wait(f: &FlowValue) {
    let (Some(cfg), Some(backend)) = (CONFIG.get(0), BACKENDS.get(f.backend)) else {
        return;
    };
    let key = flow_key(cfg, f, backend, PROTO_TCP);
    let hint = TwHint {
        tsval: f.synack_seq,
        _pad: 0,
        closed_ns: f.stamp_ns,
    };
    let _ = TW_REUSED.insert(&key, &hint, 0);
}
