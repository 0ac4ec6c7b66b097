//! The two directions of a balanced flow: client to backend (pick or find
//! the flow, source-NAT it) and backend to client (translate the reply
//! back). Everything that is neither goes to the kernel untouched.

use crate::{
    forward::send,
    maps::{
        bump, global, BACKENDS, BACKEND_STATS, CONFIG, FLOWS, HALF_OPEN, HALF_OPEN_NAT, NAT,
        SERVICES, SERVICE_STATS,
    },
    parse::{Packet, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    rewrite::{rewrite, Tuple},
    ring, timing,
};
use aya_ebpf::{
    bindings::{xdp_action, BPF_NOEXIST},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::XdpContext,
};
use aya_log_ebpf::warn;
use huddle_common::{
    addr_v4, backend_flags, flow_flags, Config, FlowKey, FlowValue, NatKey, NatValue, ServiceKey,
    FAMILY_V4, NAT_LINGER_NS, NAT_PORT_TRIES, PROTO_TCP,
};

const EEXIST: i32 = 17;

#[inline(always)]
pub fn balance(ctx: &XdpContext, p: &Packet) -> u32 {
    let Some(cfg) = CONFIG.get(0) else {
        return xdp_action::XDP_PASS;
    };
    let port = u16::from_be_bytes(p.dport);
    if p.dst == v4(&cfg.snat_addr) && port >= cfg.nat_port_min && port <= cfg.nat_port_max {
        return reply(ctx, p, cfg);
    }
    request(ctx, p, cfg)
}

#[inline(always)]
fn v4(a: &[u8; 16]) -> [u8; 4] {
    [a[0], a[1], a[2], a[3]]
}

/// Client to backend.
#[inline(always)]
fn request(ctx: &XdpContext, p: &Packet, cfg: &Config) -> u32 {
    let fkey = FlowKey {
        client: addr_v4(p.src),
        vip: addr_v4(p.dst),
        client_port_be: u16::from_ne_bytes(p.sport),
        vip_port_be: u16::from_ne_bytes(p.dport),
        proto: p.proto,
        family: FAMILY_V4,
        _pad: [0; 2],
    };
    let syn = p.is_tcp() && p.has_flag(TCP_SYN);
    let existing = FLOWS.get_ptr_mut(fkey);
    // SAFETY: map value pointer, valid for this run.
    let established =
        existing.filter(|f| !(syn && unsafe { (**f).flags } & flow_flags::CLOSING != 0));
    // An established flow carries its service: the hot path skips the
    // service lookup. (Flows of a service removed by a reload drain, like
    // a removed backend's.)
    let service = match established {
        // SAFETY: as above.
        Some(f) => unsafe { (*f).service },
        None => {
            let skey = ServiceKey {
                addr: fkey.vip,
                port_be: fkey.vip_port_be,
                proto: p.proto,
                family: FAMILY_V4,
            };
            // SAFETY: the value is copied out at once; the control plane
            // replaces hash values whole, so the copy is never torn.
            match unsafe { SERVICES.get(skey) } {
                Some(s) => s.id,
                None => {
                    global(|s| s.pass_not_service += 1);
                    return xdp_action::XDP_PASS;
                }
            }
        }
    };
    // The flow's table entry, kept so a FIN or RST can mark it without a
    // second lookup; `None` for a flow created by this packet.
    let (mut flow, mut entry) = match established {
        // SAFETY: as above.
        Some(f) => (unsafe { *f }, Some(f)),
        _ => {
            if let Some(old) = existing {
                // A new connection reusing a closed flow's tuple: its old
                // NAT entry must not catch the new flow's replies, and its
                // old entry must not catch the new flow's packets.
                // SAFETY: as above.
                forget_nat(cfg, unsafe { &*old }, p.proto);
                let _ = FLOWS.remove(fkey);
            }
            let opened = if p.is_tcp() {
                handshake(ctx, cfg, service, &fkey, p)
            } else {
                new_flow(ctx, cfg, service, &fkey, p, true, false).map(|f| (f, None))
            };
            match opened {
                Ok(o) => o,
                Err(verdict) => return verdict,
            }
        }
    };
    let Some(mut backend) = BACKENDS.get(flow.backend) else {
        return xdp_action::XDP_DROP;
    };
    if let Some(f) = entry {
        if backend.flags & backend_flags::MOVE_FLOWS != 0 {
            // Its backend is dead: balance the flow afresh. A TCP peer then
            // gets a RST from the new backend at once instead of waiting
            // on a dead one; a UDP flow simply carries on there.
            forget_nat(cfg, &flow, p.proto);
            close(f, flow.backend);
            bump(&BACKEND_STATS, flow.backend, |s| s.flows_moved += 1);
            flow = match new_flow(ctx, cfg, service, &fkey, p, false, false) {
                Ok(f) => f,
                Err(verdict) => return verdict,
            };
            entry = None;
            backend = match BACKENDS.get(flow.backend) {
                Some(b) => b,
                None => return xdp_action::XDP_DROP,
            };
        } else {
            timing::request(f, p, flow.backend);
        }
    }
    if p.has_flag(TCP_FIN | TCP_RST) {
        // Only a new flow (a SYN also carrying FIN or RST) needs a lookup.
        if let Some(f) = entry.or_else(|| FLOWS.get_ptr_mut(fkey)) {
            close(f, flow.backend);
        }
    }
    let bytes = u64::from(p.tot_len);
    bump(&BACKEND_STATS, flow.backend, |s| {
        s.pkts_to += 1;
        s.bytes_to += bytes;
    });
    bump(&SERVICE_STATS, service, |s| {
        s.pkts += 1;
        s.bytes += bytes;
    });
    rewrite(
        p,
        &Tuple {
            src: v4(&cfg.snat_addr),
            dst: v4(&backend.addr),
            sport: flow.nat_port_be.to_ne_bytes(),
            dport: backend.port_be.to_ne_bytes(),
        },
    );
    send(ctx, p, Some(flow.backend))
}

/// A TCP packet of no established flow. A SYN opens a half-open flow (in
/// its own tables, so a flood of them never evicts an established flow);
/// the client's ACK of the backend's SYN-ACK promotes it; anything else of
/// a half-open flow goes to its backend as it is; the rest is not ours.
/// Returns the flow and, once established, its table entry.
#[inline(always)]
fn handshake(
    ctx: &XdpContext,
    cfg: &Config,
    service: u32,
    fkey: &FlowKey,
    p: &Packet,
) -> Result<(FlowValue, Option<*mut FlowValue>), u32> {
    let syn = p.has_flag(TCP_SYN);
    if let Some(e) = HALF_OPEN.get_ptr_mut(fkey) {
        // SAFETY: map value pointer, copied out at once.
        let half = unsafe { *e };
        let acks_synack = half.flags & flow_flags::SYNACK_SEEN != 0
            && p.has_flag(TCP_ACK)
            && p.ack == half.synack_seq.wrapping_add(1);
        if !syn && acks_synack {
            return promote(cfg, service, fkey, &half);
        }
        // A retransmitted SYN, or early packets: same backend, no promotion.
        return Ok((half, None));
    }
    if !syn {
        bump(&SERVICE_STATS, service, |s| s.pass_no_flow += 1);
        return Err(xdp_action::XDP_PASS);
    }
    new_flow(ctx, cfg, service, fkey, p, true, true).map(|f| (f, None))
}

/// Moves a half-open flow and its NAT entry into the flow tables.
#[inline(always)]
fn promote(
    cfg: &Config,
    service: u32,
    fkey: &FlowKey,
    half: &FlowValue,
) -> Result<(FlowValue, Option<*mut FlowValue>), u32> {
    let Some(backend) = BACKENDS.get(half.backend) else {
        return Err(xdp_action::XDP_DROP);
    };
    let nkey = nat_key(
        cfg,
        backend.addr,
        backend.port_be,
        half.nat_port_be,
        PROTO_TCP,
    );
    // SAFETY: copied out at once.
    let holder = unsafe { HALF_OPEN_NAT.get(nkey) }.copied();
    let Some(nat) = holder.filter(|h| h.flow == *fkey) else {
        // A newer half-open flow took the port (only under a flood).
        bump(&SERVICE_STATS, service, |s| s.half_open_lost += 1);
        let _ = HALF_OPEN.remove(fkey);
        return Err(xdp_action::XDP_DROP);
    };
    let mut flow = *half;
    flow.flags &= !flow_flags::SYNACK_SEEN;
    if NAT.insert(nkey, nat, 0).is_err() || FLOWS.insert(fkey, flow, 0).is_err() {
        bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
        return Err(xdp_action::XDP_DROP);
    }
    let _ = HALF_OPEN_NAT.remove(nkey);
    let _ = HALF_OPEN.remove(fkey);
    bump(&SERVICE_STATS, service, |s| s.promoted += 1);
    bump(&BACKEND_STATS, flow.backend, |s| s.flows_new += 1);
    Ok((flow, FLOWS.get_ptr_mut(fkey)))
}

#[inline(always)]
fn nat_key(
    cfg: &Config,
    backend: [u8; 16],
    backend_port_be: u16,
    nat_port_be: u16,
    proto: u8,
) -> NatKey {
    NatKey {
        backend,
        local: cfg.snat_addr,
        backend_port_be,
        nat_port_be,
        proto,
        family: FAMILY_V4,
        _pad: [0; 2],
    }
}

/// Picks a backend and a NAT port for a new flow and records both
/// directions: in the half-open tables (`half`, a TCP SYN) or the flow
/// tables. `time` starts timing its first wait. Errors carry the verdict
/// for the packet.
#[inline(always)]
fn new_flow(
    ctx: &XdpContext,
    cfg: &Config,
    service: u32,
    fkey: &FlowKey,
    p: &Packet,
    time: bool,
    half: bool,
) -> Result<FlowValue, u32> {
    let Some(backend_id) = ring::pick(service) else {
        bump(&SERVICE_STATS, service, |s| s.drop_no_backend += 1);
        return Err(xdp_action::XDP_DROP);
    };
    let Some(backend) = BACKENDS.get(backend_id) else {
        bump(&SERVICE_STATS, service, |s| s.drop_no_backend += 1);
        return Err(xdp_action::XDP_DROP);
    };
    let mut nkey = nat_key(cfg, backend.addr, backend.port_be, 0, fkey.proto);
    let nval = NatValue {
        flow: *fkey,
        backend: backend_id,
        _pad: 0,
    };
    let span = u32::from(cfg.nat_port_max.wrapping_sub(cfg.nat_port_min)) + 1;
    let mut port = None;
    // A port only another half-open flow holds: taken if nothing is free.
    let mut stealable = None;
    for _ in 0..NAT_PORT_TRIES {
        // SAFETY: plain helper call.
        let r = unsafe { bpf_get_prandom_u32() };
        let candidate = cfg.nat_port_min.wrapping_add((r % span) as u16);
        nkey.nat_port_be = candidate.to_be();
        // Never a port an established flow still holds (`reclaim` looks
        // it up once and frees it if its flow is over).
        if !reclaim(&nkey) {
            continue;
        }
        let res = if half {
            HALF_OPEN_NAT.insert(nkey, nval, u64::from(BPF_NOEXIST))
        } else {
            NAT.insert(nkey, nval, u64::from(BPF_NOEXIST))
        };
        match res {
            Ok(()) => {
                port = Some(nkey.nat_port_be);
                break;
            }
            Err(e) if e == -EEXIST => stealable = Some(nkey.nat_port_be),
            Err(_) => {
                bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
                return Err(xdp_action::XDP_DROP);
            }
        }
    }
    if port.is_none() && half {
        if let Some(steal) = stealable {
            nkey.nat_port_be = steal;
            if HALF_OPEN_NAT.insert(nkey, nval, 0).is_ok() {
                port = Some(steal);
            }
        }
    }
    let Some(nat_port_be) = port else {
        warn!(
            ctx,
            "no free NAT port toward backend {} after {} tries", backend_id, NAT_PORT_TRIES
        );
        bump(&SERVICE_STATS, service, |s| s.drop_nat_ports += 1);
        return Err(xdp_action::XDP_DROP);
    };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    let flow = FlowValue {
        backend: backend_id,
        service,
        nat_port_be,
        flags: if time {
            timing::first_wait(p, backend_id, now)
        } else {
            0
        },
        _pad: 0,
        synack_seq: 0,
        stamp_ns: now,
        turn_ns: now,
    };
    let inserted = if half {
        HALF_OPEN.insert(fkey, flow, 0)
    } else {
        FLOWS.insert(fkey, flow, 0)
    };
    if inserted.is_err() {
        if half {
            let _ = HALF_OPEN_NAT.remove(nkey);
        } else {
            let _ = NAT.remove(nkey);
        }
        bump(&SERVICE_STATS, service, |s| s.drop_flow_table += 1);
        return Err(xdp_action::XDP_DROP);
    }
    if half {
        bump(&SERVICE_STATS, service, |s| s.half_open += 1);
        bump(&BACKEND_STATS, backend_id, |s| s.syns += 1);
    } else {
        bump(&SERVICE_STATS, service, |s| s.flows_new += 1);
        bump(&BACKEND_STATS, backend_id, |s| s.flows_new += 1);
    }
    Ok(flow)
}

/// Frees the NAT entry `key` if the flow holding it is over: gone from
/// the flow table, closing (FIN or RST seen) for `NAT_LINGER_NS`, or no
/// longer using this port. NAT entries are not removed when flows end (the
/// last packets of a close still need translating), so without this a
/// backend's ports would fill with finished flows long before the LRU
/// tables evict them. Returns whether the port is free now.
#[inline(always)]
fn reclaim(key: &NatKey) -> bool {
    // SAFETY: copied out at once.
    let Some(old) = (unsafe { NAT.get(key) }).copied() else {
        return true;
    };
    // The flow the entry names, if it still holds this port (its tuple may
    // since have been reused by a flow with another port).
    // SAFETY: as above.
    let owner = unsafe { FLOWS.get(old.flow) }
        .copied()
        .filter(|f| f.nat_port_be == key.nat_port_be && f.backend == old.backend);
    if let Some(f) = owner {
        if f.flags & flow_flags::CLOSING == 0 {
            return false;
        }
        // SAFETY: plain helper call.
        let now = unsafe { bpf_ktime_get_ns() };
        if now.wrapping_sub(f.stamp_ns) < NAT_LINGER_NS {
            return false;
        }
        let _ = FLOWS.remove(old.flow);
    }
    let _ = NAT.remove(key);
    true
}

/// Removes the NAT entry of an old flow that a new one replaces.
#[inline(always)]
fn forget_nat(cfg: &Config, old: &FlowValue, proto: u8) {
    let Some(backend) = BACKENDS.get(old.backend) else {
        return;
    };
    let key = nat_key(cfg, backend.addr, backend.port_be, old.nat_port_be, proto);
    let _ = NAT.remove(key);
}

/// Counts a flow closed the first time either side sends FIN or RST, and
/// starts its NAT port's linger time.
#[inline(always)]
fn close(f: *mut FlowValue, backend: u32) {
    // SAFETY: a map value pointer from a lookup in this run. Two CPUs
    // racing here at most count one close twice; the flag is advisory.
    unsafe {
        if (*f).flags & flow_flags::CLOSING == 0 {
            (*f).flags |= flow_flags::CLOSING;
            (*f).stamp_ns = bpf_ktime_get_ns();
            bump(&BACKEND_STATS, backend, |s| s.flows_closed += 1);
        }
    }
}

/// Backend to client: translate a reply back, or leave the balancer host's
/// own traffic alone.
#[inline(always)]
fn reply(ctx: &XdpContext, p: &Packet, cfg: &Config) -> u32 {
    let nkey = NatKey {
        backend: addr_v4(p.src),
        local: cfg.snat_addr,
        backend_port_be: u16::from_ne_bytes(p.sport),
        nat_port_be: u16::from_ne_bytes(p.dport),
        proto: p.proto,
        family: FAMILY_V4,
        _pad: [0; 2],
    };
    // SAFETY: copied out at once.
    let (nat, half) = match unsafe { NAT.get(nkey) }.copied() {
        Some(n) => (n, false),
        // SAFETY: as above.
        None => match unsafe { HALF_OPEN_NAT.get(nkey) }.copied() {
            Some(n) => (n, true),
            None => {
                global(|s| s.pass_no_nat += 1);
                return xdp_action::XDP_PASS;
            }
        },
    };
    let bytes = u64::from(p.tot_len);
    let rst = p.has_flag(TCP_RST);
    bump(&BACKEND_STATS, nat.backend, |s| {
        s.pkts_from += 1;
        s.bytes_from += bytes;
        if rst {
            s.rsts_from += 1;
        }
    });
    let closing = p.has_flag(TCP_FIN | TCP_RST);
    if closing || p.has_flag(TCP_SYN) || p.payload_len > 0 {
        // The flow, if it is still this backend's (it may have moved).
        let entry = if half {
            HALF_OPEN.get_ptr_mut(nat.flow)
        } else {
            FLOWS.get_ptr_mut(nat.flow)
        };
        let flow = entry.filter(|f| {
            // SAFETY: map value pointer, valid for this run.
            let f = unsafe { &**f };
            f.backend == nat.backend && f.nat_port_be == nkey.nat_port_be
        });
        if let Some(f) = flow.filter(|_| half && p.has_flag(TCP_SYN) && p.has_flag(TCP_ACK)) {
            // The client's ACK must acknowledge exactly this to promote it.
            // SAFETY: as above.
            unsafe {
                (*f).synack_seq = p.seq;
                (*f).flags |= flow_flags::SYNACK_SEEN;
            }
        }
        timing::reply(flow, p, nat.backend);
        if closing && !half {
            if let Some(f) = flow {
                close(f, nat.backend);
            }
        }
    }
    rewrite(
        p,
        &Tuple {
            src: v4(&nat.flow.vip),
            dst: v4(&nat.flow.client),
            sport: nat.flow.vip_port_be.to_ne_bytes(),
            dport: nat.flow.client_port_be.to_ne_bytes(),
        },
    );
    send(ctx, p, None)
}
