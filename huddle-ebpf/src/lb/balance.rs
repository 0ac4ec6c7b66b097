//! The two directions of a balanced flow: client to backend (pick or find
//! the flow, then source-NAT it or send it by DSR) and backend to client
//! (translate the reply back). Everything that is neither goes to the
//! kernel untouched. Written once for both address families (`balanced::Balanced`); the reply direction is `reply`.
//!
//! Every packet costs one small lookup first (`SERVICE_INDEX`, an array
//! slot; `SERVICES6` for IPv6): its destination is a VIP:port/proto, a SNAT
//! address, or not ours, and traffic that is not ours leaves right there.
//! A source-NAT service's packets try `established` first (an open flow's
//! plain segments), then `request`.

use crate::lb::scratch::{self, Scratch};
use crate::{
    lb::balanced::Balanced,
    lb::dsr,
    lb::established::{carry_on, client_key, count_to, established, translate},
    lb::guard,
    lb::halfopen,
    lb::latency::ackclock,
    lb::latency::timing,
    lb::maps::{bump, global, BACKENDS, BACKEND_STATS, CONFIG, SERVICE_STATS, TUNING},
    lb::new_flow::{new_flow, Start},
    lb::reply::{back, reply},
    lb::snat::nat,
    lb::snat::retry,
    lb::tables::{flows, nat_table},
    lb::window,
    mem::put,
    net::parse::{Packet, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};
use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns, programs::XdpContext};
use huddle_common::{
    backend_flags, flow_flags, service_mode,
    verdict::{FORWARD, FORWARD_NEW, FULL_PATH, RETRY, TOO_BIG},
    Backend, FlowValue, HalfOpen, KernelConfig, PROTO_TCP,
};

#[inline(always)]
pub fn balance<F: Balanced>(ctx: &XdpContext, p: &Packet<F>) -> u32 {
    let Some(cfg) = CONFIG.get(0) else {
        return xdp_action::XDP_PASS;
    };
    let port = u16::from_be_bytes(p.dport);
    if port >= cfg.nat_port_min && port <= cfg.nat_port_max && F::to_snat(p, cfg) {
        let verdict = reply(ctx, p, cfg);
        if verdict != RETRY || !F::RETRY {
            return verdict;
        }
        // Called from here, not from `reply`: the call chain's stack
        // (512 bytes) has no room for them under `reply`.
        let slot = retry::plan::<F>(cfg);
        if slot.is_null() {
            return back(ctx, p, cfg);
        }
        return retry::resend::<F>(ctx, cfg, slot);
    }
    match F::vip(p, cfg) {
        // Translated and sent from here: the rewrite and the FIB request
        // then take no room under `request`'s frame.
        Some(s) if s.mode == service_mode::SNAT => match established(ctx, p, cfg) {
            FULL_PATH => match request::<F, false>(ctx, p, cfg, s.id) {
                FORWARD => to_backend(ctx, p, cfg),
                FORWARD_NEW => {
                    let verdict = to_backend(ctx, p, cfg);
                    halfopen::commit(cfg);
                    verdict
                }
                verdict => verdict,
            },
            verdict => verdict,
        },
        // Sent from here for the same reason (IPv6 encapsulation's
        // header and FIB request did not fit under `request`).
        Some(s) => match request::<F, true>(ctx, p, cfg, s.id) {
            forward @ (FORWARD | FORWARD_NEW) => {
                let verdict = match dsr_send(ctx, p, cfg, s.mode) {
                    TOO_BIG => F::too_big(ctx),
                    verdict => verdict,
                };
                if forward == FORWARD_NEW {
                    halfopen::commit(cfg);
                }
                verdict
            }
            verdict => verdict,
        },
        None => match guard::pass::<F>(p.dst()) {
            xdp_action::XDP_PASS => {
                global(|s| s.pass_not_service += 1);
                xdp_action::XDP_PASS
            }
            verdict => verdict,
        },
    }
}

/// Client to backend: finds or makes the flow (`DSR`: a direct server
/// return service) and leaves it in the scratch map for `to_backend` or
/// `dsr_send` (`FORWARD`), or returns the verdict. Its own BPF function
/// (as is `reply`), one per kind of mode: the paths then neither share one
/// stack frame nor multiply the verifier's states (inlined together they
/// passed its 1M-instruction limit and the 512-byte stack).
#[inline(never)]
fn request<F: Balanced, const DSR: bool>(
    ctx: &XdpContext,
    p: &Packet<F>,
    cfg: &KernelConfig,
    service: u32,
) -> u32 {
    let dsr = DSR;
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's element, used by this run only.
    let sc = unsafe { &mut *sc };
    sc.nval.flow = client_key(p);
    let existing = existing(cfg, sc, p, dsr);
    // The flow's table entry, kept so a FIN or RST can mark it without a
    // second lookup; `None` for a flow not (yet) in the flow table.
    let (mut flow, mut entry) = match existing {
        // SAFETY: map value pointer, valid for this run.
        Some(f) => match unsafe { *f } {
            v if v.flags & flow_flags::ADOPTED != 0 => (adopt(f, v, service), Some(f)),
            // Finished and silent past its linger: its tuple may be another
            // flow's now, so it is as good as gone (`nat::over`).
            v if !dsr && v.flags & flow_flags::DONE != 0 && nat::over(&v) => {
                bump(&SERVICE_STATS, service, |s| s.pass_no_flow += 1);
                return guard::pass::<F>(p.dst());
            }
            v => (v, Some(f)),
        },
        None => match handshake(ctx, cfg, service, sc, p, dsr) {
            Ok(o) => o,
            Err(verdict) => return verdict,
        },
    };
    let Some(backend) = BACKENDS.get(flow.backend) else {
        halfopen::commit(cfg);
        return xdp_action::XDP_DROP;
    };
    if let Some(f) = entry {
        if backend.flags & backend_flags::MOVE_FLOWS != 0 {
            flow = match move_off_dead(ctx, cfg, service, sc, p, f, &flow, backend, dsr) {
                Ok(f) => f,
                Err(verdict) => return verdict,
            };
            entry = None;
        } else {
            carry_on(ctx, p, f, &flow, dsr);
        }
    }
    if p.has_flag(TCP_FIN | TCP_RST) {
        // Only a flow created by this packet needs a lookup.
        // FIN and RST are TCP's: `FLOWS` (or `DSR_FLOWS`).
        if let Some(f) = entry.or_else(|| flows(dsr, PROTO_TCP).get_ptr_mut(&sc.nval.flow)) {
            if window::close_in_window(f, p.seq, dsr) {
                if p.has_flag(TCP_RST) {
                    timing::abandon(f, flow.backend);
                }
                nat::close(f, flow.backend);
                if !dsr && p.has_flag(TCP_RST) {
                    nat::finish(f);
                    nat::heard(cfg, f, flow.backend);
                }
            } else {
                bump(&BACKEND_STATS, flow.backend, |s| s.closes_unproven += 1);
            }
        }
    }
    // A later segment of a finished flow (the RST that finished one is
    // heard above).
    if let (false, Some(f)) = (dsr, entry) {
        if flow.flags & flow_flags::DONE != 0 {
            nat::heard(cfg, f, flow.backend);
        }
    }
    count_to(flow.backend, p.tot_len);
    sc.fwd = flow;
    if sc.pending != 0 {
        FORWARD_NEW
    } else {
        FORWARD
    }
}

/// The flow-table entry a packet that is not a SYN belongs to. A SYN
/// always starts a connection: it never looks in the flow table (a flow
/// left there by an earlier connection on this tuple is replaced when the
/// new one is promoted).
#[inline(always)]
fn existing<F: Balanced>(
    cfg: &KernelConfig,
    sc: &Scratch,
    p: &Packet<F>,
    dsr: bool,
) -> Option<*mut FlowValue> {
    if p.is_tcp() && p.has_flag(TCP_SYN) {
        return None;
    }
    // A closed flow's entry stays a while; a new connection on the same
    // client tuple (a client reusing its port at once) is half-open until
    // promoted, and its packets go there, not to the old flow.
    flows(dsr, p.proto).get_ptr_mut(&sc.nval.flow).filter(|f| {
        // SAFETY: map value pointer, valid for this run.
        let flags = unsafe { (**f).flags };
        flags & (flow_flags::CLOSING | flow_flags::ADOPTED) == 0
            || !p.is_tcp()
            || halfopen::find(cfg, &sc.nval.flow).is_none()
    })
}

/// Its backend is dead: the flow (entry `f`) is balanced afresh. A TCP
/// peer then gets a RST from the new backend at once instead of waiting
/// on a dead one; a UDP flow simply carries on there.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn move_off_dead<F: Balanced>(
    ctx: &XdpContext,
    cfg: &KernelConfig,
    service: u32,
    sc: &mut Scratch,
    p: &Packet<F>,
    f: *mut FlowValue,
    flow: &FlowValue,
    backend: &Backend,
    dsr: bool,
) -> Result<FlowValue, u32> {
    if !dsr {
        sc.nkey = nat::flow_key(cfg, flow, backend, p.proto);
        nat::forget(&sc.nkey);
    }
    nat::close(f, flow.backend);
    bump(&BACKEND_STATS, flow.backend, |s| s.flows_moved += 1);
    new_flow(ctx, cfg, service, sc, p, Start::carried_on(dsr))
}

/// Sends a client packet of the DSR flow `request` left in the scratch
/// map (`fwd`) to its backend, in service mode `mode`. Its own BPF
/// function for the same reason as `to_backend`.
#[inline(never)]
fn dsr_send<F: Balanced>(ctx: &XdpContext, p: &Packet<F>, cfg: &KernelConfig, mode: u32) -> u32 {
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's element, used by this run only.
    let id = unsafe { (*sc).fwd.backend };
    let Some(backend) = BACKENDS.get(id) else {
        return xdp_action::XDP_DROP;
    };
    if mode == service_mode::DSR_L2 {
        return dsr::l2(ctx, p, cfg, id, backend);
    }
    F::encap(ctx, p, cfg, id, backend)
}

/// Translates a client packet of the flow `request` left in the scratch
/// map (`fwd`, its key in `nval.flow`) to its NAT tuple and sends it. A
/// BPF function of its own, called after `request` returned: its frame
/// and `request`'s are never on the stack together (an IPv6 packet's did
/// not fit).
#[inline(never)]
fn to_backend<F: Balanced>(ctx: &XdpContext, p: &Packet<F>, cfg: &KernelConfig) -> u32 {
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's element, used by this run only.
    let sc = unsafe { &*sc };
    let flow = &sc.fwd;
    let Some(backend) = BACKENDS.get(flow.backend) else {
        return xdp_action::XDP_DROP;
    };
    translate(ctx, p, cfg, flow, backend, &sc.nval.flow)
}

/// A packet of no established flow (its key in `sc.nval.flow`). A TCP SYN,
/// or any UDP datagram, opens a half-open flow (in tables of its own, so a
/// flood of them never evicts an established flow); the client's ACK of
/// the backend's SYN-ACK, or its next datagram after the backend's first
/// answer, promotes it (proof that the client is where it says it is);
/// anything else of a half-open flow goes to its backend as it is; the
/// rest is not ours. Returns the flow and, once established, its table
/// entry.
///
/// DSR (`dsr`): the balancer never sees the backend's answers, so a TCP
/// flow is promoted by the client's first ACK (a spoofed SYN flood still
/// only takes half-open slots), and UDP flows go to the flow table at once.
#[inline(always)]
fn handshake<F: Balanced>(
    ctx: &XdpContext,
    cfg: &KernelConfig,
    service: u32,
    sc: &mut Scratch,
    p: &Packet<F>,
    dsr: bool,
) -> Result<(FlowValue, Option<*mut FlowValue>), u32> {
    let tcp = p.is_tcp();
    if tcp && p.has_flag(TCP_SYN) {
        return new_flow(ctx, cfg, service, sc, p, Start::syn(dsr)).map(|f| (f, None));
    }
    let Some((slot, h)) = halfopen::find_hashed(cfg, &sc.nval.flow) else {
        if tcp {
            // A segment of a connection another balancer opened (the
            // router moved it here): with Maglev this balancer picks the
            // backend that one did, and the flow carries on. Only in DSR,
            // where the backend sees the client's own address.
            if dsr && maglev(service) {
                bump(&SERVICE_STATS, service, |s| s.taken_over += 1);
                return new_flow(ctx, cfg, service, sc, p, Start::carried_on(dsr))
                    .map(|f| (f, None));
            }
            bump(&SERVICE_STATS, service, |s| s.pass_no_flow += 1);
            return Err(guard::pass::<F>(p.dst()));
        }
        return new_flow(ctx, cfg, service, sc, p, Start::datagram(dsr)).map(|f| (f, None));
    };
    // SAFETY: map value pointer, copied out at once.
    let half = unsafe { (*slot).flow };
    let answered = half.flags & flow_flags::SYNACK_SEEN != 0;
    let promote_now = if dsr {
        p.has_flag(TCP_ACK)
    } else if tcp {
        answered && p.has_flag(TCP_ACK) && p.ack == half.synack_seq.wrapping_add(1)
    } else {
        answered
    };
    if promote_now {
        return promote(cfg, service, sc, (slot, h), &half, (p.proto, p.seq), dsr);
    }
    // Early packets: same backend, no promotion.
    Ok((half, None))
}

/// The first packet of a flow a peer balancer shared (`ADOPTED`): the
/// connection was moved here, and from now on it is this balancer's.
#[inline(always)]
fn adopt(f: *mut FlowValue, mut v: FlowValue, service: u32) -> FlowValue {
    v.flags &= !flow_flags::ADOPTED;
    // SAFETY: map value pointer, valid for this run.
    unsafe { (*f).flags = v.flags };
    bump(&SERVICE_STATS, service, |s| {
        s.taken_over += 1;
        s.flows_new += 1;
    });
    bump(&BACKEND_STATS, v.backend, |s| s.flows_new += 1);
    v
}

/// Whether `service` picks new flows from its Maglev table.
#[inline(always)]
fn maglev(service: u32) -> bool {
    // SAFETY: a map value pointer, read at once.
    TUNING
        .get_ptr(service)
        .is_some_and(|t| unsafe { (*t).maglev_size } != 0)
}

/// Moves a half-open flow (in `slot`, with its key's hash; the key in
/// `sc.nval.flow`) into the flow tables and frees its half-open slots.
#[inline(always)]
fn promote(
    cfg: &KernelConfig,
    service: u32,
    sc: &mut Scratch,
    (slot, h): (*mut HalfOpen, u64),
    half: &FlowValue,
    (proto, client_seq): (u8, u32),
    dsr: bool,
) -> Result<(FlowValue, Option<*mut FlowValue>), u32> {
    let Some(backend) = BACKENDS.get(half.backend) else {
        return Err(xdp_action::XDP_DROP);
    };
    let mut flow = *half;
    flow.flags &= !flow_flags::SYNACK_SEEN;
    if dsr {
        // SAFETY: plain helper call.
        ackclock::handshake(&mut flow, half.backend, unsafe { bpf_ktime_get_ns() });
    } else {
        sc.nkey = nat::flow_key(cfg, half, backend, proto);
        sc.nval.backend = half.backend;
        // Each side's place in its sequence space, for `seqwin`: the
        // backend's after its SYN-ACK, the client's from this ACK.
        sc.nval.backend_seq = if proto == PROTO_TCP {
            half.synack_seq.wrapping_add(1)
        } else {
            0
        };
        flow.synack_seq = if proto == PROTO_TCP { client_seq } else { 0 };
        nat::mark_used(cfg, half.backend, half.snat, half.nat_port_be);
        if nat_table(proto).insert(&sc.nkey, &sc.nval, 0).is_err() {
            bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
            return Err(xdp_action::XDP_DROP);
        }
        // The NAT entry now answers for the tuple: free its half-open
        // slot (only if still this flow's); the client slot goes once the
        // flow table has the flow.
        halfopen::forget_nat(cfg, &sc.nkey);
    }
    let table = flows(dsr, proto);
    let entry = match table.get_ptr_mut(&sc.nval.flow) {
        // An earlier connection on this client tuple: its NAT tuple must
        // not catch anything more, and its entry becomes this flow's.
        Some(old) => {
            // SAFETY: map value pointer, valid for this run.
            let o = unsafe { *old };
            // (Not a flow that is over: its tuple may be another's now.)
            if !dsr
                && !nat::over(&o)
                && (o.nat_port_be != flow.nat_port_be
                    || o.snat != flow.snat
                    || o.backend != flow.backend)
            {
                if let Some(b) = BACKENDS.get(o.backend) {
                    sc.nkey = nat::flow_key(cfg, &o, b, proto);
                    nat::forget(&sc.nkey);
                }
            }
            // A copy, not an assignment (a call of the object's memmove).
            put(old, &flow);
            old
        }
        None => {
            if table.insert(&sc.nval.flow, &flow, 0).is_err() {
                bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
                return Err(xdp_action::XDP_DROP);
            }
            match table.get_ptr_mut(&sc.nval.flow) {
                Some(e) => e,
                None => return Err(xdp_action::XDP_DROP),
            }
        }
    };
    halfopen::empty(cfg, slot, h);
    bump(&SERVICE_STATS, service, |s| s.promoted += 1);
    bump(&BACKEND_STATS, flow.backend, |s| s.flows_new += 1);
    Ok((flow, Some(entry)))
}
