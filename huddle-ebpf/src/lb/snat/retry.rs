//! Connection retry in the kernel: a backend that refuses a client's SYN
//! never costs the client its connection. The balancer keeps what it needs
//! of each SYN in the half-open slot (sequence number, window, options);
//! when the backend answers it with a RST, the RST itself is rebuilt into
//! that SYN toward another backend of the ring, and the client sees only
//! the other backend's SYN-ACK, a little later. A backend that answers the
//! SYN with an ACK of an older connection on the NAT tuple (its TIME_WAIT,
//! or a connection a lost NAT table left behind) gets the same SYN again
//! from another tuple of its own. A SYN left unanswered is
//! retried on the client's own retransmission (see `balance::new_flow`).
//! Only half-open flows are retried, whose backend has sent nothing but
//! the refusal: a flow that got any data from its backend never is.

use crate::lb::scratch::{self, Scratch};
use crate::{
    csum,
    lb::forward::send,
    lb::halfopen,
    lb::latency::timing,
    lb::maps::{bump, BACKENDS, BACKEND_STATS},
    lb::select,
    lb::service::Lookup,
    lb::snat::nat,
    lb::snat::timewait,
    mem::put,
    net::family::Family,
    net::parse::{Packet, TCP_SYN},
};
use aya_ebpf::{
    bindings::xdp_action,
    helpers::{
        bpf_ktime_get_ns,
        generated::{
            bpf_xdp_adjust_head, bpf_xdp_adjust_tail, bpf_xdp_get_buff_len, bpf_xdp_store_bytes,
        },
    },
    programs::XdpContext,
};
use huddle_common::headers::{ETH_LEN, TCP_LEN};
use huddle_common::{
    flow_flags, HalfOpen, KernelConfig, MAX_SYN_RETRIES, MAX_TUPLE_RETRIES, PROTO_TCP, SYN_OPTS,
};

/// Step one of a retry, after the backend refused the SYN of the half-open
/// flow whose keys `reply` left in the scratch map (`nval.flow` the
/// client's, `nkey` the refusing backend's NAT tuple): move the flow to
/// another backend of the ring with a NAT tuple of its own, or (when
/// `reply` left `retry_tuple` set: only the tuple was refused) to another
/// tuple of the same backend. Returns its
/// slot, or null for no retry (retries used up, no other backend, no free
/// tuple): then nothing changed. Touches no packet data, so the caller's
/// packet pointers stay valid (a BPF function that changes packet data
/// invalidates them all in its caller, on every path).
#[inline(never)]
pub fn plan<F: Lookup>(cfg: &KernelConfig) -> *mut HalfOpen {
    let none = core::ptr::null_mut();
    let Some(sc) = scratch::get() else {
        return none;
    };
    // SAFETY: this CPU's element, used by this run only.
    let sc = unsafe { &mut *sc };
    let tuple = tuple_only(sc);
    let Some(slot) = halfopen::find(cfg, &sc.nval.flow) else {
        return none;
    };
    // SAFETY: a map value pointer, valid for this run.
    let s = unsafe { &mut *slot };
    let used_up = if tuple {
        s.syn.tuples_tried() >= MAX_TUPLE_RETRIES
    } else {
        s.syn.backends_tried() >= MAX_SYN_RETRIES
    };
    if used_up {
        return none;
    }
    let old = s.flow.backend;
    let service = s.flow.service;
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    let id = if tuple {
        old
    } else {
        select::choose(service, old, now, cfg.maglev_seed)
    };
    let Some(backend) = BACKENDS.get(id) else {
        return none;
    };
    // The refusing backend's NAT slot must catch nothing more.
    halfopen::forget_nat(cfg, &sc.nkey);
    sc.nval.backend = id;
    sc.nval.backend_seq = 0;
    // Both kinds of retry reach the tuple walk alike (the backend id read
    // back from memory, the kind not kept in a register across it), so the
    // verifier checks the walk once, not once per kind. Measured: 946,878
    // instructions verified of the 1M limit before, 546,185 after.
    // SAFETY: a field of this CPU's scratch element.
    let id = unsafe { core::ptr::read_volatile(&sc.nval.backend) };
    let syn_ts = timewait::tsval(&s.syn);
    let Some(got) = nat::allocate::<F>(cfg, id, backend, PROTO_TCP, sc, true, now, syn_ts) else {
        return none;
    };
    s.flow.backend = id;
    s.flow.nat_port_be = got.port_be;
    s.flow.snat = got.snat;
    s.flow.flags = flow_flags::SYN_WAIT;
    s.flow.turn_ns = now;
    let tuple = tuple_only(sc);
    if tuple {
        s.syn.tried_tuple();
    } else {
        s.syn.tried_backend();
    }
    halfopen::write_nat(cfg, service, sc);
    timing::start_first(flow_flags::SYN_WAIT, id, now);
    bump(&BACKEND_STATS, old, |st| {
        if tuple {
            st.retried_time_wait += 1;
        } else {
            st.retried_refused += 1;
        }
    });
    bump(&BACKEND_STATS, id, |st| st.syns += 1);
    slot
}

/// Whether `reply` found only the NAT tuple refused (`Scratch::retry_tuple`),
/// read from memory each time.
#[inline(always)]
fn tuple_only(sc: &Scratch) -> bool {
    // SAFETY: a field of this CPU's scratch element.
    unsafe { core::ptr::read_volatile(&sc.retry_tuple) != 0 }
}

/// Step two: rebuild the packet (the refusing RST) as the client's SYN of
/// the half-open flow in `slot`, toward the backend `plan` gave it, and
/// send it. Dropped only if the packet cannot be resized (the client's own
/// retransmission then reaches the new backend).
#[inline(never)]
pub fn resend<F: Family>(ctx: &XdpContext, cfg: &KernelConfig, slot: *mut HalfOpen) -> u32 {
    // SAFETY: a map value pointer from `plan`, valid for this run.
    let s = unsafe { &mut *slot };
    let id = s.flow.backend;
    let Some(backend) = BACKENDS.get(id) else {
        return xdp_action::XDP_DROP;
    };
    let opt_len = usize::from(s.syn.opt_len) & 0x3c;
    if opt_len > SYN_OPTS {
        return xdp_action::XDP_DROP;
    }
    if !resize(ctx, F::OPTS_AT + opt_len) {
        return xdp_action::XDP_DROP;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + F::OPTS_AT > end {
        return xdp_action::XDP_DROP;
    }
    let tcp_len = (TCP_LEN + opt_len) as u16;
    let ip = (data + ETH_LEN) as *mut u8;
    let tcp = (data + ETH_LEN + F::IP_LEN) as *mut u8;
    let sport = s.flow.nat_port_be.to_ne_bytes();
    let dport = backend.port_be.to_ne_bytes();
    let tcph = syn_header(s, sport, dport, tcp_len);
    // SAFETY: the Ethernet, IP and TCP headers were checked to lie inside
    // the packet just above.
    unsafe {
        // The frame may start elsewhere now: its EtherType too (the
        // addresses are `send`'s).
        put(ip.sub(2).cast::<[u8; 2]>(), &F::ETHERTYPE);
        // Pseudo header (from the IP header), the TCP header, the options.
        let mut l4_sum = F::syn_ip(
            ip,
            F::narrow(nat::snat_addr(cfg, s.flow.snat)),
            F::narrow(&backend.addr),
            tcp_len,
        ) + csum::words(&tcph);
        let mut i = 0;
        while i < SYN_OPTS / 2 {
            if 2 * i < opt_len {
                l4_sum += u64::from(u16::from_ne_bytes([
                    s.syn.opts[2 * i],
                    s.syn.opts[2 * i + 1],
                ]));
            }
            i += 1;
        }
        put(tcp.cast::<[u8; TCP_LEN]>(), &tcph);
        tcp.add(16)
            .cast::<u16>()
            .write_unaligned(csum::apply(0xffff, l4_sum));
        if opt_len > 0
            && bpf_xdp_store_bytes(
                ctx.ctx.cast(),
                F::OPTS_AT as u32,
                s.syn.opts.as_mut_ptr().cast(),
                opt_len as u32,
            ) != 0
        {
            return xdp_action::XDP_DROP;
        }
    }
    // `store_bytes` changed packet data: fresh pointers.
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + F::OPTS_AT > end {
        return xdp_action::XDP_DROP;
    }
    let p: Packet<F> = Packet {
        eth: data as *mut _,
        ip: (data + ETH_LEN) as *mut _,
        l4: (data + ETH_LEN + F::IP_LEN) as *mut u8,
        proto: PROTO_TCP,
        sport,
        dport,
        tcp_flags: TCP_SYN,
        tot_len: (F::IP_LEN as u16) + tcp_len,
        payload_len: 0,
        seq: s.syn.isn,
        ack: 0,
    };
    // Written afresh, with a full checksum.
    send(ctx, &p, Some(id), cfg, false)
}

/// Makes the frame `want` bytes long. Room for the options at the head:
/// XDP guarantees headroom, while a small RST's buffer (the backend
/// stack's own) often has no tailroom (measured: growing the tail failed
/// for most refusals on a veth). Every byte is written afresh after, so
/// where the frame starts does not matter. A padded frame is trimmed at
/// the tail.
#[inline(always)]
fn resize(ctx: &XdpContext, want: usize) -> bool {
    let want = want as i32;
    // SAFETY: plain helper calls (the verifier allows no arithmetic on the
    // packet's end pointer, so the length comes from the kernel).
    let have = unsafe { bpf_xdp_get_buff_len(ctx.ctx.cast()) } as i32;
    let rc = if want > have {
        unsafe { bpf_xdp_adjust_head(ctx.ctx.cast(), have - want) }
    } else if want < have {
        unsafe { bpf_xdp_adjust_tail(ctx.ctx.cast(), want - have) }
    } else {
        0
    };
    rc == 0
}

/// The TCP header of the client's SYN kept in `s`, from its NAT tuple
/// (`sport`) to the backend (`dport`), its checksum still zero.
#[inline(always)]
fn syn_header(s: &HalfOpen, sport: [u8; 2], dport: [u8; 2], tcp_len: u16) -> [u8; TCP_LEN] {
    let seq = s.syn.isn.to_be_bytes();
    let window = s.syn.window_be.to_ne_bytes();
    [
        sport[0],
        sport[1],
        dport[0],
        dport[1],
        seq[0],
        seq[1],
        seq[2],
        seq[3],
        0,
        0,
        0,
        0,
        ((tcp_len / 4) as u8) << 4,
        TCP_SYN,
        window[0],
        window[1],
        0,
        0,
        0,
        0,
    ]
}
