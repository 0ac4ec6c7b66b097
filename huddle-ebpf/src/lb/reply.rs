//! The backend-to-client direction of a source-NAT flow: the reply's NAT
//! entry found, its flow's timing and state kept, and the packet
//! translated back to VIP -> client (or a refused SYN handed back for a
//! retry).

use crate::lb::scratch::{self, Scratch};
use crate::{
    lb::balanced::Balanced,
    lb::forward::send,
    lb::halfopen,
    lb::latency::timing,
    lb::maps::{bump, global, BACKEND_STATS},
    lb::snat::nat,
    lb::snat::rewrite::Tuple,
    lb::tables::{flows, nat_table},
    mem::put,
    net::parse::{Packet, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};
use aya_ebpf::{
    bindings::xdp_action, helpers::generated::bpf_ktime_get_coarse_ns, programs::XdpContext,
};
use huddle_common::{
    config_flags, flow_flags, seqwin, verdict::RETRY, FlowValue, HalfOpen, KernelConfig, NatKey,
    NatValue,
};

/// Backend to client: translate a reply back, or leave the balancer host's
/// own traffic alone (but for a migration's last moments: `MIGRATING`).
#[inline(never)]
pub fn reply<F: Balanced>(ctx: &XdpContext, p: &Packet<F>, cfg: &KernelConfig) -> u32 {
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's element, used by this run only.
    let sc = unsafe { &mut *sc };
    sc.nkey = NatKey::new(
        F::wide(p.dst()),
        F::wide(p.src()),
        u16::from_ne_bytes(p.sport),
        u16::from_ne_bytes(p.dport),
        p.proto,
        F::FAMILY,
    );
    // A SYN-ACK or a RST may answer a handshake on a tuple whose finished
    // flow's NAT entry is still there (`nat::allocate`).
    let Some((half, entry)) = nat_entry(cfg, sc, p.has_flag(TCP_SYN | TCP_RST)) else {
        if cfg.flags & config_flags::MIGRATING != 0 {
            global(|s| s.drop_no_nat += 1);
            return xdp_action::XDP_DROP;
        }
        global(|s| s.pass_no_nat += 1);
        return xdp_action::XDP_PASS;
    };
    if !entry.is_null() && p.is_tcp() {
        if let Some(n) = seqwin::advanced(sc.nval.backend_seq, p.seq) {
            // SAFETY: a non-null map value pointer, valid for this run;
            // only this direction writes the field.
            unsafe { (*entry).backend_seq = n };
        }
    }
    let backend = sc.nval.backend;
    let bytes = u64::from(p.tot_len);
    let rst = p.has_flag(TCP_RST);
    bump(&BACKEND_STATS, backend, |s| {
        s.pkts_from += 1;
        s.bytes_from += bytes;
        if rst {
            s.rsts_from += 1;
        }
    });
    let closing = p.has_flag(TCP_FIN | TCP_RST);
    // A bare ACK answering a SYN: the backend still holds an older
    // connection on this tuple (its TIME_WAIT refused the SYN's timestamp
    // or sequence number). Passed on, the client would reset it and send
    // its SYN again a timer tick later (8 ms at HZ=250).
    let stale = half
        && p.tcp_flags & (TCP_SYN | TCP_RST | TCP_FIN | TCP_ACK) == TCP_ACK
        && p.payload_len == 0;
    if (closing || p.has_flag(TCP_SYN) || p.payload_len > 0 || stale)
        && on_flow(p, cfg, sc, backend, half, stale)
    {
        return RETRY;
    }
    to_client(ctx, p, cfg, sc)
}

/// Copies the NAT entry of `sc.nkey` into `sc.nval`: from the NAT table
/// (`Some((false, its entry))`) or a half-open slot (`Some((true,
/// null))`), the half-open slot first if `half_first`; `None` if neither
/// holds it (not a reply of ours). A nullable pointer for the reason
/// `on_flow` gives.
#[inline(always)]
fn nat_entry(
    cfg: &KernelConfig,
    sc: &mut Scratch,
    half_first: bool,
) -> Option<(bool, *mut NatValue)> {
    let table = nat_table(sc.nkey.proto);
    if half_first {
        if let Some(h) = halfopen::find_nat(cfg, &sc.nkey) {
            // SAFETY: map value pointer, valid for this run.
            put(&mut sc.nval, unsafe { &(*h).nat });
            return Some((true, core::ptr::null_mut()));
        }
    }
    let Some(n) = table.get_ptr_mut(&sc.nkey) else {
        if half_first {
            return None;
        }
        let h = halfopen::find_nat(cfg, &sc.nkey)?;
        // SAFETY: map value pointer, valid for this run.
        put(&mut sc.nval, unsafe { &(*h).nat });
        return Some((true, core::ptr::null_mut()));
    };
    // `put`, not an assignment: that compiled to a call of the object's
    // memmove, a byte loop (two maps never overlap).
    // SAFETY: map value pointer, valid for this run.
    put(&mut sc.nval, unsafe { &*n });
    Some((false, n))
}

/// A reply that tells something of its flow (a SYN-ACK, data, a FIN or a
/// RST, a stale ACK): marks, times or closes the flow if it is still this
/// backend's. True when the client's SYN should be retried instead
/// (`sc.retry_tuple` says how).
#[inline(always)]
fn on_flow<F: Balanced>(
    p: &Packet<F>,
    cfg: &KernelConfig,
    sc: &mut Scratch,
    backend: u32,
    half: bool,
    stale: bool,
) -> bool {
    let closing = p.has_flag(TCP_FIN | TCP_RST);
    // The flow, if it is still this backend's (it may have moved). A
    // nullable pointer, not an Option of one: LLVM leaves the pointer
    // of a `None` undefined and moves it around anyway, which the
    // verifier refuses as reading an uninitialised register.
    let slot: *mut HalfOpen = if half {
        halfopen::find(cfg, &sc.nval.flow).unwrap_or(core::ptr::null_mut())
    } else {
        core::ptr::null_mut()
    };
    let entry: *mut FlowValue = if half {
        if slot.is_null() {
            core::ptr::null_mut()
        } else {
            // SAFETY: map value pointer, valid for this run.
            unsafe { core::ptr::addr_of_mut!((*slot).flow) }
        }
    } else {
        flows(false, p.proto)
            .get_ptr_mut(&sc.nval.flow)
            .unwrap_or(core::ptr::null_mut())
    };
    // SAFETY: a non-null map value pointer, valid for this run. (Not a
    // flow that is over: its tuple may be another's now.)
    let ours = !entry.is_null()
        && unsafe {
            (*entry).backend == backend
                && (*entry).nat_port_be == sc.nkey.nat_port_be
                && (half || !nat::over(&*entry))
        };
    let flow = if ours { entry } else { core::ptr::null_mut() };
    if ours && half && p.has_flag(TCP_SYN) && p.has_flag(TCP_ACK) {
        // The client's ACK must acknowledge exactly this to promote it.
        // SAFETY: as above.
        unsafe {
            (*flow).synack_seq = p.seq;
            (*flow).flags |= flow_flags::SYNACK_SEEN;
        }
    }
    if ours && !p.is_tcp() {
        // SAFETY: as above.
        unsafe {
            if half {
                // The backend answered: the client's next datagram
                // promotes the flow.
                (*flow).flags |= flow_flags::SYNACK_SEEN;
            } else {
                (*flow).stamp_ns = bpf_ktime_get_coarse_ns();
                // Answered since the promotion: the client's next
                // datagram confirms the flow (`UDP_CONFIRMED`).
                (*flow).flags |= flow_flags::SYNACK_SEEN;
            }
        }
    }
    // The client's SYN still waits on this backend (no SYN-ACK came
    // before): a refusal the balancer may retry itself.
    // SAFETY: as above.
    let awaiting = F::RETRY
        && ours
        && half
        && unsafe {
            (*flow).flags & (flow_flags::SYN_WAIT | flow_flags::SYNACK_SEEN) == flow_flags::SYN_WAIT
        };
    // A real refusal is a RST+ACK acknowledging the client's SYN
    // exactly: anything else (an off-path guess at the tuple, a SYN
    // with RST set) moves nothing and goes on as it is.
    // SAFETY: as above.
    let refused = awaiting
        && p.tcp_flags & (TCP_RST | TCP_ACK | TCP_SYN) == TCP_RST | TCP_ACK
        && p.ack == unsafe { (*slot).syn.isn }.wrapping_add(1);
    let stale = awaiting && stale;
    timing::reply(flow, p, backend, &sc.nval.flow);
    if refused || stale {
        sc.retry_tuple = u32::from(stale);
        return true;
    }
    if ours && closing && !half {
        // In the backend's window, or a spoofed close (the NAT ports are a
        // known range) could end any flow of this backend.
        if seqwin::within(sc.nval.backend_seq, p.seq) {
            nat::close_by_backend(flow, backend, p.has_flag(TCP_FIN));
            nat::finish(flow);
        } else {
            bump(&BACKEND_STATS, backend, |s| s.closes_unproven += 1);
        }
    }
    if ours && !half {
        nat::heard(cfg, flow, backend);
    }
    false
}

/// A refused SYN that was not retried after all: its RST goes to the
/// client like any reply.
#[inline(never)]
pub fn back<F: Balanced>(ctx: &XdpContext, p: &Packet<F>, cfg: &KernelConfig) -> u32 {
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's element, used by this run only.
    to_client(ctx, p, cfg, unsafe { &*sc })
}

/// Translates a reply of the flow in `sc.nval` back to VIP -> client and
/// sends it.
#[inline(always)]
fn to_client<F: Balanced>(
    ctx: &XdpContext,
    p: &Packet<F>,
    cfg: &KernelConfig,
    sc: &Scratch,
) -> u32 {
    let partial = F::rewrite(
        p,
        &Tuple {
            src: F::narrow(&sc.nval.flow.vip),
            dst: F::narrow(&sc.nval.flow.client),
            was_src: &sc.nkey.backend,
            was_dst: &sc.nkey.local,
            sport: sc.nval.flow.vip_port_be.to_ne_bytes(),
            dport: sc.nval.flow.client_port_be.to_ne_bytes(),
        },
    );
    send(ctx, p, None, cfg, partial)
}
