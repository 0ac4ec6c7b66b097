//! A new flow: its SYN's half-open slot (a retransmission, or one whose
//! backend never answered), the backend, the NAT tuple, and the records
//! of both directions. Called by `balance` for SYNs, for flows carried on
//! from another balancer, and for first datagrams.

use crate::lb::scratch::Scratch;
use crate::{
    lb::balanced::Balanced,
    lb::halfopen,
    lb::latency::timing,
    lb::loglimit,
    lb::maps::{bump, BACKENDS, BACKEND_STATS, SERVICE_STATS},
    lb::select,
    lb::snat::nat,
    lb::snat::timewait,
    lb::tables::flows,
    lb::window,
    net::parse::Packet,
    net::tcp,
};
use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns, programs::XdpContext};
use aya_log_ebpf::warn;
use huddle_common::{
    flow_flags, short_tag, verdict::NO_BACKEND, FlowValue, HalfOpen, KernelConfig, MAX_SYN_RETRIES,
    NAT_PORT_TRIES,
};

/// How a new flow starts.
#[derive(Clone, Copy)]
pub struct Start {
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
    pub fn syn(dsr: bool) -> Start {
        Start {
            timed: true,
            half_open: true,
            dsr,
        }
    }

    /// A flow that was open before (moved off a dead backend, or taken
    /// over from another balancer): straight into the flow tables, untimed.
    pub fn carried_on(dsr: bool) -> Start {
        Start {
            timed: false,
            half_open: false,
            dsr,
        }
    }

    /// The first datagram of a UDP flow: timed and half-open until the
    /// client sends again, except in DSR, where no answer comes back.
    pub fn datagram(dsr: bool) -> Start {
        Start {
            timed: !dsr,
            half_open: !dsr,
            dsr,
        }
    }
}

/// Picks a backend and a NAT tuple for a new flow (its key in
/// `sc.nval.flow`) and records both directions, as `start` says. Errors
/// carry the verdict for the packet. The steps: the SYN's half-open slot
/// (a retransmission?), the backend, the NAT tuple, then the records.
#[inline(always)]
pub fn new_flow<F: Balanced>(
    ctx: &XdpContext,
    cfg: &KernelConfig,
    service: u32,
    sc: &mut Scratch,
    p: &Packet<F>,
    start: Start,
) -> Result<FlowValue, u32> {
    let (half, dsr) = (start.half_open, start.dsr);
    // Only a SYN needs the hash: other new flows go to the flow table.
    let h = if half {
        sc.nval.flow.hash(cfg.hash_seed)
    } else {
        0
    };
    let slot = if half { Some(slot_of(cfg, h)?) } else { None };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    let (avoid, retries) = match earlier(cfg, service, sc, p, slot, h, dsr, now)? {
        Earlier::Same(flow) => return Ok(flow),
        Earlier::Silent { avoid, retries } => (avoid, retries),
        Earlier::None => (NO_BACKEND, 0),
    };
    let mut backend_id = select::choose(service, avoid, now, cfg.maglev_seed);
    if backend_id == NO_BACKEND {
        // Only the silent backend is left: a fresh tuple toward it.
        backend_id = avoid;
    }
    let Some(backend) = BACKENDS.get(backend_id) else {
        bump(&SERVICE_STATS, service, |s| s.drop_no_backend += 1);
        return Err(xdp_action::XDP_DROP);
    };
    sc.nval.backend = backend_id;
    sc.nval.backend_seq = 0;
    let proto = sc.nval.flow.proto;
    let tcp_half = half && p.is_tcp() && !dsr;
    let (nat_port_be, snat) = if dsr {
        // No NAT port: the word keeps the client's `window` record.
        (window::first_dsr_record(p.is_tcp(), p.seq), 0)
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
            // Every tuple tried is held by a live flow: worth a record, at
            // most one a second (a flood of flows would write one a packet).
            if let Some(held) = loglimit::may_log(now) {
                warn!(
                    ctx,
                    "no free NAT tuple toward backend {} after {} tries ({} more such refusals on this CPU since its last line)",
                    backend_id,
                    NAT_PORT_TRIES,
                    held
                );
            }
            bump(&SERVICE_STATS, service, |s| s.drop_nat_ports += 1);
            return Err(xdp_action::XDP_DROP);
        };
        (tuple.port_be, tuple.snat)
    };
    let flow = FlowValue {
        backend: backend_id,
        service,
        nat_port_be,
        flags: if start.timed {
            timing::first_flags(p)
        } else {
            0
        },
        snat,
        synack_seq: 0,
        stamp_ns: now,
        turn_ns: now,
    };
    record(sc, p, service, &flow, slot.map(|_| h), dsr)?;
    if start.timed {
        timing::start_first(flow.flags, backend_id, now);
    }
    Ok(flow)
}

/// A SYN's half-open slot and its short tag, which alone tells most SYNs
/// that the slot is not theirs (the slot itself is usually a cache miss).
#[inline(always)]
fn slot_of(cfg: &KernelConfig, h: u64) -> Result<(*mut HalfOpen, *mut u32), u32> {
    match (
        halfopen::client_slot(cfg, h),
        halfopen::short_tag_of(cfg, h),
    ) {
        (Some(s), Some(t)) => Ok((s, t)),
        _ => Err(xdp_action::XDP_DROP),
    }
}

/// What a SYN's half-open slot says of it.
enum Earlier {
    /// Nothing: a new connection.
    None,
    /// A retransmission: it goes where the first SYN went.
    Same(FlowValue),
    /// A retransmission whose backend never answered: to another one,
    /// `retries` backends tried after the first.
    Silent { avoid: u32, retries: u8 },
}

/// Whether the slot (with its short tag) holds this SYN's connection, and
/// what that means for it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn earlier<F: Balanced>(
    cfg: &KernelConfig,
    service: u32,
    sc: &mut Scratch,
    p: &Packet<F>,
    slot: Option<(*mut HalfOpen, *mut u32)>,
    h: u64,
    dsr: bool,
    now: u64,
) -> Result<Earlier, u32> {
    // SAFETY (short tag): map value pointer, valid for this run.
    let Some((s, _)) = slot
        .filter(|(s, t)| unsafe { **t } == short_tag(h) && halfopen::holds(*s, h, &sc.nval.flow))
    else {
        return Ok(Earlier::None);
    };
    // SAFETY: map value pointer, valid for this run.
    let (flow, tried) = unsafe { ((*s).flow, (*s).syn.backends_tried()) };
    let Some(backend) = BACKENDS.get(flow.backend) else {
        return Err(xdp_action::XDP_DROP);
    };
    sc.nkey = nat::flow_key(cfg, &flow, backend, p.proto);
    // In DSR the SYN-ACK never crosses the balancer: a retransmitted SYN
    // may follow one that is on its way (the client would then have a
    // connection with one backend and send to another), so it always goes
    // where the first went.
    let silent = !dsr
        && flow.flags & flow_flags::SYN_WAIT != 0
        && cfg.syn_timeout_ns != 0
        && now.wrapping_sub(flow.turn_ns) >= cfg.syn_timeout_ns
        && tried < MAX_SYN_RETRIES;
    if !silent {
        // Same backend, same tuple; its NAT slot is written again in case
        // a colliding SYN took it meanwhile.
        if !dsr {
            sc.nval.backend = flow.backend;
            sc.nval.backend_seq = 0;
            halfopen::write_nat(cfg, service, sc);
        }
        return Ok(Earlier::Same(flow));
    }
    // Its backend never answered: the client's retransmission goes to
    // another one, and a late answer from the first finds no NAT slot.
    halfopen::forget_nat(cfg, &sc.nkey);
    bump(&BACKEND_STATS, flow.backend, |st| st.retried_silent += 1);
    Ok(Earlier::Silent {
        avoid: flow.backend,
        retries: tried + 1,
    })
}

/// Records a new flow: in the half-open table once the packet is rewritten
/// (`half_open` holds its hash), else in the flow table at once.
#[inline(always)]
fn record<F: Balanced>(
    sc: &mut Scratch,
    p: &Packet<F>,
    service: u32,
    flow: &FlowValue,
    half_open: Option<u64>,
    dsr: bool,
) -> Result<(), u32> {
    let backend_id = flow.backend;
    let tcp_half = half_open.is_some() && p.is_tcp() && !dsr;
    if let Some(h) = half_open {
        // Written by `halfopen::commit` once the packet is rewritten.
        sc.fwd = *flow;
        sc.pending_hash = h;
        sc.pending = halfopen::PENDING_CLIENT
            | if dsr { 0 } else { halfopen::PENDING_NAT }
            | if tcp_half { halfopen::PENDING_SYN } else { 0 };
        bump(&SERVICE_STATS, service, |s| s.half_open += 1);
        if p.is_tcp() {
            bump(&BACKEND_STATS, backend_id, |s| s.syns += 1);
        }
    } else {
        if flows(dsr, p.proto).insert(&sc.nval.flow, flow, 0).is_err() {
            if !dsr {
                nat::forget(&sc.nkey);
            }
            bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
            return Err(xdp_action::XDP_DROP);
        }
        bump(&SERVICE_STATS, service, |s| s.flows_new += 1);
        bump(&BACKEND_STATS, backend_id, |s| s.flows_new += 1);
    }
    Ok(())
}
