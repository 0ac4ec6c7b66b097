//! The two directions of a balanced flow: client to backend (pick or find
//! the flow, then source-NAT it or send it by DSR) and backend to client
//! (translate the reply back). Everything that is neither goes to the
//! kernel untouched. Written once for both address families (`balanced::Balanced`); the reply direction is `reply`.
//!
//! Every packet costs one small lookup first (`SERVICE_INDEX`, an array
//! slot; `SERVICES6` for IPv6): its destination is a VIP:port/proto, a SNAT
//! address, or not ours, and traffic that is not ours leaves right there.

use crate::lb::scratch::{self, Scratch};
use crate::{
    lb::balanced::Balanced,
    lb::dsr,
    lb::forward::send,
    lb::halfopen,
    lb::latency::ackclock,
    lb::latency::timing,
    lb::maps::{bump, global, BACKENDS, BACKEND_STATS, CONFIG, FLOWS, NAT, SERVICE_STATS, TUNING},
    lb::reply::{back, reply},
    lb::select,
    lb::snat::nat,
    lb::snat::retry,
    lb::snat::rewrite::Tuple,
    lb::snat::timewait,
    mem::put,
    net::parse::{Packet, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    net::tcp,
};
use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_ktime_get_ns, generated::bpf_ktime_get_coarse_ns},
    programs::XdpContext,
};
use aya_log_ebpf::warn;
use huddle_common::{
    backend_flags, flow_flags, service_mode, short_tag,
    verdict::{FORWARD, FORWARD_NEW, NO_BACKEND, RETRY, TOO_BIG},
    Config, FlowKey, FlowValue, HalfOpen, MAX_SYN_RETRIES, NAT_PORT_TRIES,
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
        Some(s) if s.mode == service_mode::SNAT => match request::<F, false>(ctx, p, cfg, s.id) {
            FORWARD => to_backend(ctx, p, cfg),
            FORWARD_NEW => {
                let verdict = to_backend(ctx, p, cfg);
                halfopen::commit(cfg);
                verdict
            }
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
        None => {
            global(|s| s.pass_not_service += 1);
            xdp_action::XDP_PASS
        }
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
    cfg: &Config,
    service: u32,
) -> u32 {
    let dsr = DSR;
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's element, used by this run only.
    let sc = unsafe { &mut *sc };
    sc.nval.flow = FlowKey::new(
        &F::wide(p.src()),
        &F::wide(p.dst()),
        u16::from_ne_bytes(p.sport),
        u16::from_ne_bytes(p.dport),
        p.proto,
        F::FAMILY,
    );
    // A SYN always starts a connection: it never looks in the flow table
    // (a flow left there by an earlier connection on this tuple is
    // replaced when the new one is promoted).
    let existing = if p.is_tcp() && p.has_flag(TCP_SYN) {
        None
    } else {
        // A closed flow's entry stays a while; a new connection on the same
        // client tuple (a client reusing its port at once) is half-open
        // until promoted, and its packets go there, not to the old flow.
        FLOWS.get_ptr_mut(&sc.nval.flow).filter(|f| {
            // SAFETY: map value pointer, valid for this run.
            let flags = unsafe { (**f).flags };
            flags & (flow_flags::CLOSING | flow_flags::ADOPTED) == 0
                || !p.is_tcp()
                || halfopen::find(cfg, &sc.nval.flow).is_none()
        })
    };
    // The flow's table entry, kept so a FIN or RST can mark it without a
    // second lookup; `None` for a flow not (yet) in the flow table.
    let (mut flow, mut entry) = match existing {
        // SAFETY: map value pointer, valid for this run.
        Some(f) => match unsafe { *f } {
            v if v.flags & flow_flags::ADOPTED != 0 => (adopt(f, v, service), Some(f)),
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
            // Its backend is dead: balance the flow afresh. A TCP peer then
            // gets a RST from the new backend at once instead of waiting
            // on a dead one; a UDP flow simply carries on there.
            if !dsr {
                sc.nkey = nat::flow_key(cfg, &flow, backend, p.proto);
                nat::forget(&sc.nkey);
            }
            nat::close(f, flow.backend);
            bump(&BACKEND_STATS, flow.backend, |s| s.flows_moved += 1);
            flow = match new_flow(ctx, cfg, service, sc, p, Start::carried_on(dsr)) {
                Ok(f) => f,
                Err(verdict) => return verdict,
            };
            entry = None;
        } else {
            if !p.is_tcp() {
                // A UDP flow's last activity, for its idle timeout.
                // SAFETY: map value pointer, valid for this run.
                unsafe { (*f).stamp_ns = bpf_ktime_get_coarse_ns() };
            }
            if dsr {
                ackclock::request(f, p, flow.backend);
            } else {
                timing::request(f, p, flow.backend);
                if flow.flags & flow_flags::BACKEND_TIME_WAIT != 0 && p.is_tcp() {
                    timewait::note_client(ctx, p, f);
                }
            }
        }
    }
    if p.has_flag(TCP_FIN | TCP_RST) {
        // Only a flow created by this packet needs a lookup.
        if let Some(f) = entry.or_else(|| FLOWS.get_ptr_mut(&sc.nval.flow)) {
            nat::close(f, flow.backend);
        }
    }
    let bytes = u64::from(p.tot_len);
    bump(&BACKEND_STATS, flow.backend, |s| {
        s.pkts_to += 1;
        s.bytes_to += bytes;
    });
    sc.fwd = flow;
    if sc.pending != 0 {
        FORWARD_NEW
    } else {
        FORWARD
    }
}

/// Sends a client packet of the DSR flow `request` left in the scratch
/// map (`fwd`) to its backend, in service mode `mode`. Its own BPF
/// function for the same reason as `to_backend`.
#[inline(never)]
fn dsr_send<F: Balanced>(ctx: &XdpContext, p: &Packet<F>, cfg: &Config, mode: u32) -> u32 {
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
fn to_backend<F: Balanced>(ctx: &XdpContext, p: &Packet<F>, cfg: &Config) -> u32 {
    let Some(sc) = scratch::get() else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: this CPU's element, used by this run only.
    let sc = unsafe { &*sc };
    let flow = &sc.fwd;
    let Some(backend) = BACKENDS.get(flow.backend) else {
        return xdp_action::XDP_DROP;
    };
    F::rewrite(
        p,
        &Tuple {
            src: F::narrow(nat::snat_addr(cfg, flow.snat)),
            dst: F::narrow(&backend.addr),
            was_src: &sc.nval.flow.client,
            was_dst: &sc.nval.flow.vip,
            sport: flow.nat_port_be.to_ne_bytes(),
            dport: backend.port_be.to_ne_bytes(),
        },
    );
    send(ctx, p, Some(flow.backend), cfg.hop_generation)
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
    cfg: &Config,
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
            return Err(xdp_action::XDP_PASS);
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
        return promote(cfg, service, sc, (slot, h), &half, p.proto, dsr);
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
    cfg: &Config,
    service: u32,
    sc: &mut Scratch,
    (slot, h): (*mut HalfOpen, u64),
    half: &FlowValue,
    proto: u8,
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
        sc.nval._pad = 0;
        nat::mark_used(cfg, half.backend, half.snat, half.nat_port_be);
        if NAT.insert(&sc.nkey, &sc.nval, 0).is_err() {
            bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
            return Err(xdp_action::XDP_DROP);
        }
        // The NAT entry now answers for the tuple: free its half-open
        // slot (only if still this flow's); the client slot goes once the
        // flow table has the flow.
        halfopen::forget_nat(cfg, &sc.nkey);
    }
    let entry = match FLOWS.get_ptr_mut(&sc.nval.flow) {
        // An earlier connection on this client tuple: its NAT tuple must
        // not catch anything more, and its entry becomes this flow's.
        Some(old) => {
            // SAFETY: map value pointer, valid for this run.
            let o = unsafe { *old };
            if !dsr
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
            if FLOWS.insert(&sc.nval.flow, &flow, 0).is_err() {
                bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
                return Err(xdp_action::XDP_DROP);
            }
            match FLOWS.get_ptr_mut(&sc.nval.flow) {
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

/// How a new flow starts.
#[derive(Clone, Copy)]
struct Start {
    /// Time its first wait (the SYN-ACK, or the first answer).
    timed: bool,
    /// Keep it in the half-open slots until its handshake completes (a
    /// TCP SYN), not in the flow tables.
    half_open: bool,
    /// Direct server return: no NAT tuple.
    dsr: bool,
}

impl Start {
    /// A TCP SYN: timed, half-open until the handshake completes.
    fn syn(dsr: bool) -> Start {
        Start {
            timed: true,
            half_open: true,
            dsr,
        }
    }

    /// A flow that was open before (moved off a dead backend, or taken
    /// over from another balancer): straight into the flow tables, untimed.
    fn carried_on(dsr: bool) -> Start {
        Start {
            timed: false,
            half_open: false,
            dsr,
        }
    }

    /// The first datagram of a UDP flow: timed and half-open until the
    /// client sends again, except in DSR, where no answer comes back.
    fn datagram(dsr: bool) -> Start {
        Start {
            timed: !dsr,
            half_open: !dsr,
            dsr,
        }
    }
}

/// Picks a backend and a NAT tuple for a new flow (its key in
/// `sc.nval.flow`) and records both directions, as `start` says. Errors
/// carry the verdict for the packet.
#[inline(always)]
fn new_flow<F: Balanced>(
    ctx: &XdpContext,
    cfg: &Config,
    service: u32,
    sc: &mut Scratch,
    p: &Packet<F>,
    start: Start,
) -> Result<FlowValue, u32> {
    let Start {
        timed: time,
        half_open: half,
        dsr,
    } = start;
    // Only a SYN needs the hash: other new flows go to the flow table.
    let h = if half {
        sc.nval.flow.hash(cfg.hash_seed)
    } else {
        0
    };
    // The slot and its short tag, which alone tells most SYNs that the
    // slot is not theirs (the slot itself is usually a cache miss).
    let slot = if half {
        match (
            halfopen::client_slot(cfg, h),
            halfopen::short_tag_of(cfg, h),
        ) {
            (Some(s), Some(t)) => Some((s, t)),
            _ => return Err(xdp_action::XDP_DROP),
        }
    } else {
        None
    };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    // The backend a retransmitted SYN must not go back to, and how many
    // backends this connection has tried after its first.
    let mut avoid = NO_BACKEND;
    let mut retries = 0;
    // SAFETY (short tag): map value pointer, valid for this run.
    if let Some((s, _)) = slot
        .filter(|(s, t)| unsafe { **t } == short_tag(h) && halfopen::holds(*s, h, &sc.nval.flow))
    {
        // SAFETY: map value pointer, valid for this run.
        let (flow, tried) = unsafe { ((*s).flow, (*s).syn.backends_tried()) };
        let Some(backend) = BACKENDS.get(flow.backend) else {
            return Err(xdp_action::XDP_DROP);
        };
        sc.nkey = nat::flow_key(cfg, &flow, backend, p.proto);
        // In DSR the SYN-ACK never crosses the balancer: a retransmitted
        // SYN may follow one that is on its way (the client would then
        // have a connection with one backend and send to another), so it
        // always goes where the first went.
        let silent = !dsr
            && flow.flags & flow_flags::SYN_WAIT != 0
            && cfg.syn_timeout_ns != 0
            && now.wrapping_sub(flow.turn_ns) >= cfg.syn_timeout_ns
            && tried < MAX_SYN_RETRIES;
        if !silent {
            // A retransmitted SYN: same backend, same tuple; its NAT slot
            // is written again in case a colliding SYN took it meanwhile.
            if !dsr {
                sc.nval.backend = flow.backend;
                sc.nval._pad = 0;
                halfopen::write_nat(cfg, service, sc);
            }
            return Ok(flow);
        }
        // Its backend never answered: the client's retransmission goes to
        // another one, and a late answer from the first finds no NAT slot.
        if !dsr {
            halfopen::forget_nat(cfg, &sc.nkey);
        }
        bump(&BACKEND_STATS, flow.backend, |st| st.retried_silent += 1);
        avoid = flow.backend;
        retries = tried + 1;
    }
    let mut backend_id = select::choose(service, avoid, now);
    if backend_id == NO_BACKEND {
        // Only the silent backend is left: a fresh tuple toward it.
        backend_id = avoid;
    }
    let Some(backend) = BACKENDS.get(backend_id) else {
        bump(&SERVICE_STATS, service, |s| s.drop_no_backend += 1);
        return Err(xdp_action::XDP_DROP);
    };
    sc.nval.backend = backend_id;
    sc.nval._pad = 0;
    let proto = sc.nval.flow.proto;
    let tcp_half = half && p.is_tcp() && !dsr;
    let (nat_port_be, snat) = if dsr {
        (0, 0)
    } else {
        // The SYN's options, for its half-open slot and its timestamp,
        // which picks a tuple whose TIME_WAIT (if any) will accept it.
        let syn_ts = if tcp_half {
            tcp::keep_syn(ctx, p, core::ptr::addr_of_mut!(sc.syn), retries);
            timewait::tsval(&sc.syn)
        } else {
            0
        };
        let Some(tuple) =
            nat::allocate::<F>(cfg, backend_id, backend, proto, sc, half, now, syn_ts)
        else {
            // Rare (every tuple tried is held by a live flow): worth a record.
            warn!(
                ctx,
                "no free NAT tuple toward backend {} after {} tries", backend_id, NAT_PORT_TRIES
            );
            bump(&SERVICE_STATS, service, |s| s.drop_nat_ports += 1);
            return Err(xdp_action::XDP_DROP);
        };
        (tuple.port_be, tuple.snat)
    };
    let flow = FlowValue {
        backend: backend_id,
        service,
        nat_port_be,
        flags: if time { timing::first_flags(p) } else { 0 },
        snat,
        synack_seq: 0,
        stamp_ns: now,
        turn_ns: now,
    };
    if slot.is_some() {
        // Written by `halfopen::commit` once the packet is rewritten.
        sc.fwd = flow;
        sc.pending_hash = h;
        sc.pending = halfopen::PENDING_CLIENT
            | if dsr { 0 } else { halfopen::PENDING_NAT }
            | if tcp_half { halfopen::PENDING_SYN } else { 0 };
        bump(&SERVICE_STATS, service, |s| s.half_open += 1);
        if p.is_tcp() {
            bump(&BACKEND_STATS, backend_id, |s| s.syns += 1);
        }
    } else {
        if FLOWS.insert(&sc.nval.flow, &flow, 0).is_err() {
            if !dsr {
                nat::forget(&sc.nkey);
            }
            bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
            return Err(xdp_action::XDP_DROP);
        }
        bump(&SERVICE_STATS, service, |s| s.flows_new += 1);
        bump(&BACKEND_STATS, backend_id, |s| s.flows_new += 1);
    }
    if time {
        timing::start_first(flow.flags, backend_id, now);
    }
    Ok(flow)
}
