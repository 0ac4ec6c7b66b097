//! Source-NAT tuples: which (SNAT address, port) a new flow gets toward
//! its backend, and freeing the tuples of finished flows.
//!
//! Each CPU owns a slice of the port range and walks it, per backend, with
//! a cursor (`NAT_CURSOR`): a tuple comes back only after every other one of
//! the slice (times the SNAT addresses) has been handed out. A random pick
//! would soon hand out a tuple whose last connection the backend still
//! holds in TIME_WAIT (60 s on Linux); half the time that connection's
//! PAWS or sequence check then refuses the new SYN with an ACK of the old
//! connection, the client answers RST and resends its SYN a timer tick
//! later (TCP_TIMEOUT_MIN, 8 ms at HZ=250): a 10 ms latency tail. Walking
//! in order gives every tuple the longest rest the port space allows, and
//! no two CPUs ever share a cursor or a tuple.

use crate::lb::scratch::Scratch;
use crate::{
    lb::maps::{bump, BACKEND_STATS, NAT_CURSOR, NAT_USED, TW_HINTS, TW_HINTS_UNTIL, TW_REUSED},
    lb::service::Lookup,
    lb::snat::timewait,
    lb::tables::{flows, nat_table},
};
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_smp_processor_id, bpf_ktime_get_ns},
};
use huddle_common::{
    flow_flags, nat_used, Addr, Backend, FlowValue, KernelConfig, NatCursor, NatKey, MAX_SNAT,
    NAT_LINGER_NS, NAT_PORT_TRIES, NAT_USED_BACKENDS, NAT_USED_LINE, PROTO_TCP, PROTO_UDP,
    TIME_WAIT_NS, UDP_UNCONFIRMED_IDLE_NS,
};

/// The tuple a new flow got: SNAT address index and port (network order).
pub struct Tuple {
    pub snat: u8,
    pub port_be: u16,
}

/// The SNAT address with index `i` (always below `MAX_SNAT`, a power of
/// two: the mask is what the verifier needs to see, a comparison LLVM may
/// turn into a select it cannot follow).
#[inline(always)]
pub fn snat_addr(cfg: &KernelConfig, i: u8) -> &Addr {
    &cfg.snat_addrs[usize::from(i) & (MAX_SNAT - 1)]
}

/// `used`'s `op` that reads the byte; any other `op` is a `nat_used`
/// value to write.
const ASK: u32 = 0x100;

/// Reads (`ASK`) or writes (`op`, a `nat_used` value) the `NAT_USED` byte
/// of backend `id`'s tuple of SNAT address index `snat` and port
/// `nat_port_min + port_off`. Returns the byte read (with the filter off,
/// or for a write, `MAYBE`: every tuple may be in use). A BPF function of
/// its own: its branches stay out of its callers' verifier states
/// (inlined in the request path, it took the program past the
/// 1M-instruction limit).
#[inline(never)]
fn used(cfg: &KernelConfig, id: u32, snat: u32, port_off: u32, op: u32) -> u32 {
    let per = cfg.nat_used_per_backend;
    // The lowest ids, which the control plane hands out first.
    if per == 0 || id >= NAT_USED_BACKENDS {
        return u32::from(nat_used::MAYBE);
    }
    let stride = u32::from(cfg.slices) * u32::from(cfg.slice_ports);
    let i = id
        .wrapping_mul(per)
        .wrapping_add(snat.wrapping_mul(stride))
        .wrapping_add(port_off);
    let Some(line) = NAT_USED.get_ptr_mut(i / NAT_USED_LINE as u32) else {
        return u32::from(nat_used::MAYBE);
    };
    // SAFETY: a byte inside the element (the mask keeps it there), valid
    // for this run.
    unsafe {
        let b = line.cast::<u8>().add((i as usize) & (NAT_USED_LINE - 1));
        if op == ASK {
            return u32::from(*b);
        }
        *b = op as u8;
    }
    u32::from(nat_used::MAYBE)
}

/// `used` for backend `id`'s tuple of SNAT address index `snat` and port
/// `port_be`.
#[inline(always)]
fn used_port(cfg: &KernelConfig, id: u32, snat: u8, port_be: u16, op: u32) -> u32 {
    let off = u32::from(u16::from_be(port_be).wrapping_sub(cfg.nat_port_min));
    used(cfg, id, u32::from(snat), off, op)
}

/// Notes that `NAT` is about to hold an entry for backend `id`'s tuple of
/// SNAT address index `snat` and port `port_be` (before the insert: a
/// walk that reads the byte as clear must find no entry).
#[inline(always)]
pub fn mark_used(cfg: &KernelConfig, id: u32, snat: u8, port_be: u16) {
    used_port(cfg, id, snat, port_be, u32::from(nat_used::MAYBE));
}

/// Hands out the next free tuple of this CPU's slice toward backend `id`,
/// leaving its NAT key in `sc.nkey`. Outside a handshake (`half` false:
/// UDP, a moved flow) it is recorded at once for `sc.nval`'s flow in the
/// NAT table; a half-open flow's goes to its half-open slot. `now` is the
/// clock. `syn_ts`: the new SYN's timestamp (0: none, or not a SYN); a
/// tuple whose last connection the backend holds in TIME_WAIT with a
/// timestamp not older is passed over (`timewait`), except on the last
/// tries. `None`: every tuple tried is held by a live flow.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn allocate<F: Lookup>(
    cfg: &KernelConfig,
    id: u32,
    backend: &Backend,
    proto: u8,
    sc: &mut Scratch,
    half: bool,
    now: u64,
    syn_ts: u32,
) -> Option<Tuple> {
    let cursor = NAT_CURSOR.get_ptr_mut(id)?;
    // SAFETY: plain helper call.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let ports = u32::from(cfg.slice_ports).max(1);
    // This family's SNAT addresses: `first..first + addrs`.
    let (first, addrs) = F::snat_range(cfg);
    let addrs = addrs.clamp(1, MAX_SNAT as u32);
    // One slice per possible CPU; `checked_rem` only guards the divisor
    // for the compiler (a panic path would not pass the verifier).
    let slice = if cpu < u32::from(cfg.slices) {
        cpu
    } else {
        cpu.checked_rem(u32::from(cfg.slices)).unwrap_or(0)
    };
    let base = u32::from(cfg.nat_port_min) + slice * ports;
    // SAFETY: this CPU's element of a per-CPU array; the program is not
    // re-entered on one CPU while it runs.
    let c = unsafe { &mut *cursor };
    if c.round_ns == 0 {
        c.round_ns = now;
    }
    let (nval, nkey) = (&sc.nval, &mut sc.nkey);
    *nkey = NatKey::new(
        *snat_addr(cfg, first as u8),
        backend.addr,
        backend.port_be,
        0,
        proto,
        F::FAMILY,
    );
    // The walk's next tuple, if the filter says `NAT` holds nothing for
    // it, or (for a handshake) only a finished flow's entry, silent long
    // enough: no lookup there (its bucket is a cold cache line, the
    // dearest part of a new flow; the filter's line is the one the last
    // SYN toward this backend read). The finished flow's entries stay:
    // the promotion overwrites its `NAT` one, the LRU evicts its flow; its
    // packets are no longer translated (`over`), and a reply the new
    // handshake gets is looked for in the half-open table first.
    let (a, off) = peek(c, ports, addrs);
    let byte = used(cfg, id, first + a, slice * ports + off, ASK) as u8;
    if byte == nat_used::FREE || (half && proto == PROTO_TCP && nat_used::quiet(byte, now)) {
        let (a, off, early) = step(c, ports, addrs, now);
        nkey.local = *snat_addr(cfg, (first + a) as u8);
        nkey.nat_port_be = ((base + off) as u16).to_be();
        if let Reclaim::Free = unused(nkey, syn_ts, now) {
            // Its byte stays: clear, or the finished flow's until the
            // promotion marks it.
            return taken(cfg, id, half, nkey, nval, (first + a) as u8, early, false);
        }
        bump(&BACKEND_STATS, id, |s| s.nat_tw_skipped += 1);
    }
    for i in 0..NAT_PORT_TRIES {
        let (a, off, early) = step(c, ports, addrs, now);
        nkey.local = *snat_addr(cfg, (first + a) as u8);
        nkey.nat_port_be = ((base + off) as u16).to_be();
        // Never a tuple an established flow still holds (`reclaim` looks
        // it up once and frees it if its flow is over). The last tries
        // take a tuple whatever its TIME_WAIT says: a SYN that may wait a
        // retransmission beats one dropped.
        let ts = if i + TW_LENIENT_TRIES < NAT_PORT_TRIES {
            syn_ts
        } else {
            0
        };
        match reclaim(nkey, ts, now) {
            Reclaim::Free => {}
            Reclaim::Held => continue,
            Reclaim::TimeWait => {
                bump(&BACKEND_STATS, id, |s| s.nat_tw_skipped += 1);
                continue;
            }
        }
        return taken(cfg, id, half, nkey, nval, (first + a) as u8, early, true);
    }
    // Every tuple tried is held by a live flow.
    None
}

/// The free tuple `nkey` (SNAT address index `snat`) handed to a flow
/// toward backend `id`, counted if its last use was less than TIME_WAIT
/// ago (`early`): outside a handshake (`half` false) recorded at once in
/// `NAT` for `nval` (`None` if that fails); a half-open flow's clears its
/// `NAT_USED` byte if `reclaimed` (`reclaim` left `NAT` with nothing for
/// it, and a half-open flow puts nothing there until it is promoted).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn taken(
    cfg: &KernelConfig,
    id: u32,
    half: bool,
    nkey: &NatKey,
    nval: &huddle_common::NatValue,
    snat: u8,
    early: u32,
    reclaimed: bool,
) -> Option<Tuple> {
    if early != 0 {
        bump(&BACKEND_STATS, id, |s| s.nat_reuse_early += 1);
    }
    let got = Tuple {
        snat,
        port_be: nkey.nat_port_be,
    };
    if half {
        if reclaimed {
            used_port(cfg, id, got.snat, got.port_be, u32::from(nat_used::FREE));
        }
    } else {
        mark_used(cfg, id, got.snat, got.port_be);
        if nat_table(nkey.proto)
            .insert(nkey, nval, u64::from(BPF_NOEXIST))
            .is_err()
        {
            return None;
        }
    }
    Some(got)
}

/// One step of a walk at cursor `c` over `ports` ports times `addrs`
/// SNAT addresses: the tuple it hands out (address index, port offset)
/// and whether its last use was less than TIME_WAIT ago (the round it was
/// last handed out in was that short).
#[inline(always)]
fn step(c: &mut NatCursor, ports: u32, addrs: u32, now: u64) -> (u32, u32, u32) {
    let early = c.early;
    let (a, off) = peek(c, ports, addrs);
    if off + 1 < ports {
        c.port = off + 1;
        c.addr = a;
    } else if a + 1 < addrs {
        c.port = 0;
        c.addr = a + 1;
    } else {
        // The round is over: if it took less than TIME_WAIT the next one
        // reuses tuples the backend may still hold.
        c.port = 0;
        c.addr = 0;
        c.early = u32::from(now.wrapping_sub(c.round_ns) < TIME_WAIT_NS);
        c.round_ns = now;
    }
    (a, off, early)
}

/// The tuple cursor `c` stands on (address index, port offset), kept
/// inside the walk.
#[inline(always)]
fn peek(c: &NatCursor, ports: u32, addrs: u32) -> (u32, u32) {
    (
        if c.addr < addrs { c.addr } else { 0 },
        if c.port < ports { c.port } else { 0 },
    )
}

/// `reclaim` for a tuple `NAT` holds nothing for: only the last run's
/// TIME_WAIT hints can keep it.
#[inline(always)]
fn unused(key: &NatKey, syn_ts: u32, now: u64) -> Reclaim {
    if syn_ts != 0 && hinted_refusal(key, syn_ts, now) {
        Reclaim::TimeWait
    } else {
        Reclaim::Free
    }
}

/// Tries at the end of `allocate` that ignore TIME_WAIT.
const TW_LENIENT_TRIES: u32 = 1;

/// What `reclaim` found of a tuple (a `u8` across the BPF call).
#[repr(u8)]
enum Reclaim {
    /// Free now.
    Free,
    /// A live flow holds it.
    Held,
    /// Its last connection's TIME_WAIT on the backend would refuse the SYN.
    TimeWait,
}

/// Frees the NAT entry `key` if the flow holding it is over: gone from
/// the flow table, closing (FIN or RST seen) for `NAT_LINGER_NS`, or no
/// longer using this port. NAT entries are not removed when flows end (the
/// last packets of a close still need translating), so without this a
/// backend's ports would fill with finished flows long before the LRU
/// tables evict them. A tuple whose last flow the backend closed first
/// less than `TIME_WAIT_NS` ago, with a client timestamp not older than
/// `syn_ts` (non-zero), stays as it is. A BPF function of its own: the
/// tables it picks by protocol (`UDP_NAT` or `NAT`) stay out of the
/// allocation loop's verifier states (inlined, they took the request
/// path from 663k verified instructions to 771k).
#[inline(never)]
fn reclaim(key: &NatKey, syn_ts: u32, now: u64) -> Reclaim {
    // SAFETY: copied out at once.
    let (nat, table) = (nat_table(key.proto), flows(false, key.proto));
    let Some(old) = (unsafe { nat.get(key) }).copied() else {
        return gone(key, syn_ts, now);
    };
    // The flow the entry names, if it still holds this tuple (its client
    // tuple may since have been reused by a flow with another one).
    // SAFETY: as above.
    let owner = unsafe { table.get(&old.flow) }
        .copied()
        .filter(|f| f.nat_port_be == key.nat_port_be && f.backend == old.backend);
    if let Some(f) = owner {
        if f.flags & flow_flags::CLOSING == 0 {
            // A UDP flow of one exchange, silent a while: maybe a
            // spoofer's, and its tuple is worth more to a real client.
            let stale = key.proto == PROTO_UDP
                && f.flags & flow_flags::UDP_CONFIRMED == 0
                && now.saturating_sub(f.stamp_ns) >= UDP_UNCONFIRMED_IDLE_NS;
            if !stale {
                return Reclaim::Held;
            }
            bump(&BACKEND_STATS, old.backend, |s| {
                s.udp_unconfirmed_freed += 1;
                s.flows_closed += 1;
            });
            let _ = table.remove(&old.flow);
            let _ = nat.remove(key);
            return Reclaim::Free;
        }
        let closed = now.wrapping_sub(f.stamp_ns);
        if closed < NAT_LINGER_NS {
            return Reclaim::Held;
        }
        if f.flags & flow_flags::BACKEND_TIME_WAIT != 0
            && timewait::refuses(f.stamp_ns, f.synack_seq, syn_ts, now)
        {
            return Reclaim::TimeWait;
        }
        let _ = table.remove(&old.flow);
        let _ = nat.remove(key);
        return Reclaim::Free;
    }
    // Its flow entry is another connection's now (the client reused its
    // tuple): what the backend may hold is in `TW_REUSED`.
    let _ = nat.remove(key);
    gone(key, syn_ts, now)
}

/// `reclaim` for a tuple whose flow entry is gone or another's: the last
/// run's hints, then `TW_REUSED`.
#[inline(always)]
fn gone(key: &NatKey, syn_ts: u32, now: u64) -> Reclaim {
    if let Reclaim::TimeWait = unused(key, syn_ts, now) {
        return Reclaim::TimeWait;
    }
    // SAFETY: copied out at once.
    let Some(h) = (unsafe { TW_REUSED.get(key) }).copied() else {
        return Reclaim::Free;
    };
    if timewait::refuses(h.closed_ns, h.tsval, syn_ts, now) {
        return Reclaim::TimeWait;
    }
    // Past its TIME_WAIT, or this SYN ends it (or carries no timestamp:
    // taken as the last tries take one): of no more use.
    let _ = TW_REUSED.remove(key);
    Reclaim::Free
}

/// The NAT key of an existing flow toward backend `addr`:`port_be`.
#[inline(always)]
pub fn flow_key(cfg: &KernelConfig, flow: &FlowValue, backend: &Backend, proto: u8) -> NatKey {
    NatKey::new(
        *snat_addr(cfg, flow.snat),
        backend.addr,
        backend.port_be,
        flow.nat_port_be,
        proto,
        backend.family,
    )
}

/// Counts a flow closed the first time either side sends FIN or RST, and
/// starts its NAT tuple's linger time.
#[inline(always)]
pub fn close(f: *mut FlowValue, backend: u32) {
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

/// Whether the last run, before a fresh start, left `key`'s tuple in a
/// TIME_WAIT that refuses a SYN with timestamp `syn_ts` (`TW_HINTS`; only
/// looked up in the minute after such a start).
#[inline(always)]
fn hinted_refusal(key: &NatKey, syn_ts: u32, now: u64) -> bool {
    // SAFETY: a map value pointer, read at once.
    let until = TW_HINTS_UNTIL.get_ptr(0).map_or(0, |u| unsafe { *u });
    if now >= until {
        return false;
    }
    // SAFETY: copied out at once.
    match unsafe { TW_HINTS.get(key) }.copied() {
        Some(h) => timewait::refuses(h.closed_ns, h.tsval, syn_ts, now),
        None => false,
    }
}

/// `close` for a FIN or RST from the backend (`fin`: a FIN): a backend
/// that closes first keeps the tuple in TIME_WAIT.
#[inline(always)]
pub fn close_by_backend(f: *mut FlowValue, backend: u32, fin: bool) {
    // SAFETY: a map value pointer from a lookup in this run.
    unsafe {
        if fin && (*f).flags & flow_flags::CLOSING == 0 {
            (*f).flags |= flow_flags::BACKEND_TIME_WAIT;
            // Until now the SYN-ACK's sequence number: no timestamp yet.
            (*f).synack_seq = 0;
        }
    }
    close(f, backend);
}

/// Marks the source-NAT TCP flow `f` finished on both sides (the
/// backend's FIN after the client's, or a RST in window), unless the
/// backend holds it in TIME_WAIT (it closed first).
#[inline(always)]
pub fn finish(f: *mut FlowValue) {
    // SAFETY: a map value pointer from a lookup in this run.
    unsafe {
        if (*f).flags & (flow_flags::CLOSING | flow_flags::BACKEND_TIME_WAIT) == flow_flags::CLOSING
        {
            (*f).flags |= flow_flags::DONE;
        }
    }
}

/// A packet of the source-NAT flow `f` toward backend `id`: if the flow
/// is finished, its stamp and its tuple's `NAT_USED` byte say it was
/// heard of now, so its tuple is not taken while it still talks.
#[inline(always)]
pub fn heard(cfg: &KernelConfig, f: *mut FlowValue, id: u32) {
    // SAFETY: a map value pointer from a lookup in this run.
    unsafe {
        if (*f).flags & flow_flags::DONE != 0 {
            let now = bpf_ktime_get_ns();
            (*f).stamp_ns = now;
            used_port(
                cfg,
                id,
                (*f).snat,
                (*f).nat_port_be,
                u32::from(nat_used::done(now)),
            );
        }
    }
}

/// Whether `flow` is a finished flow silent past `NAT_LINGER_NS`: its
/// tuple may be another flow's now, so none of its packets is translated
/// and its entries are nobody's to remove.
#[inline(always)]
pub fn over(flow: &FlowValue) -> bool {
    // SAFETY: plain helper call.
    flow.flags & flow_flags::DONE != 0
        && unsafe { bpf_ktime_get_ns() }.saturating_sub(flow.stamp_ns) >= NAT_LINGER_NS
}

/// Removes NAT entry `key` (of a flow that could not be recorded, or that
/// a new one replaces).
#[inline(always)]
pub fn forget(key: &NatKey) {
    let _ = nat_table(key.proto).remove(key);
}
