//! Per-CPU counters the XDP program keeps and the control plane sums.
//!
//! Each struct is a flat list of `u64` counters; the macro also implements
//! [`Counters`], so user space can name and add them, and adding a counter
//! is one line here.

/// A flat set of named `u64` counters.
pub trait Counters: Copy + Default {
    /// Adds another CPU's (or snapshot's) counters to these.
    fn accumulate(&mut self, other: &Self);
    /// Calls `f` with each counter's field name and value, in layout order.
    fn for_each(&self, f: impl FnMut(&'static str, u64));
    /// The counters of `values`, in layout order (as `for_each` gives
    /// them); `None` unless there are exactly as many.
    fn from_values(values: &[u64]) -> Option<Self>;
    /// What grew from `before` to these; `None` if any counter went back.
    fn checked_sub(&self, before: &Self) -> Option<Self>;
}

macro_rules! counters {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident,)+ }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name {
            $($(#[$fm])* pub $field: u64,)+
        }
        shared!($name);

        impl Counters for $name {
            fn accumulate(&mut self, other: &Self) {
                $(self.$field = self.$field.wrapping_add(other.$field);)+
            }

            fn for_each(&self, mut f: impl FnMut(&'static str, u64)) {
                $(f(stringify!($field), self.$field);)+
            }

            fn checked_sub(&self, before: &Self) -> Option<Self> {
                Some($name { $($field: self.$field.checked_sub(before.$field)?,)+ })
            }

            fn from_values(values: &[u64]) -> Option<Self> {
                let mut it = values.iter().copied();
                let c = $name { $($field: it.next()?,)+ };
                it.next().is_none().then_some(c)
            }
        }
    };
}

counters!(
    /// Per backend, indexed by backend id.
    BackendStats {
        /// Packets and bytes sent to the backend.
        pkts_to,
        bytes_to,
        /// Packets and bytes the backend sent back (translated to clients).
        pkts_from,
        bytes_from,
        /// Flows assigned to the backend: TCP once the handshake completed,
        /// UDP at the first datagram.
        flows_new,
        /// Flows that saw their first FIN or RST.
        flows_closed,
        /// RST segments sent by the backend.
        rsts_from,
        /// SYNs of new connections forwarded to the backend.
        syns,
        /// SYN-ACKs answering a SYN we forwarded, and the summed
        /// SYN-to-SYN-ACK time of those.
        syn_acks,
        connect_ns,
        /// RSTs answering a SYN (connection refused).
        refused,
        /// Request turns: client data that started a wait for an answer.
        turns,
        /// Turns answered by backend data, and their summed time to first
        /// byte (the histogram is in `LATENCY`).
        answered,
        ttfb_ns,
        /// Turns the backend reset instead of answering.
        reset_turns,
        /// Turns the client reset before an answer came (not the backend's
        /// fault, but not a sample either).
        abandoned,
        /// Flows moved off this backend because it was marked dead.
        flows_moved,
        /// New flows given a NAT tuple less than `TIME_WAIT_NS` after its
        /// last use (this CPU's slice went round too fast: more new flows a
        /// second toward this backend than the port space holds); the
        /// backend may still hold the old connection in TIME_WAIT.
        nat_reuse_early,
        /// NAT tuples passed over for a new connection because the
        /// backend's TIME_WAIT of their last one would refuse its SYN (its
        /// timestamp not newer than the last one the backend saw).
        nat_tw_skipped,
        /// Client SYNs this backend refused (RST) that the balancer sent to
        /// another backend itself: the client never saw the refusal.
        retried_refused,
        /// Client SYNs this backend answered with an ACK of an older
        /// connection on their NAT tuple (its TIME_WAIT refused the SYN, or
        /// it still holds a connection there) that the balancer sent again
        /// itself from another tuple: the client never saw the refusal.
        retried_time_wait,
        /// Client SYNs this backend left unanswered for `syn_timeout_ms`
        /// whose retransmission went to another backend.
        retried_silent,
        /// New flows that passed over this backend at pick time because it
        /// owed an answer for longer than its service's `Tuning` allows.
        skipped_owing,
        /// RSTs and FINs of open source-NAT flows to or from this backend
        /// outside their sender's sequence window (`seqwin`): passed on
        /// for the endpoint to judge, the flow kept open. Spoofed closes,
        /// or a peer's stale ones.
        closes_unproven,
        /// Source-NAT UDP flows of one exchange (not `UDP_CONFIRMED`)
        /// silent for `UDP_UNCONFIRMED_IDLE_NS` whose tuple a new flow took
        /// (also counted in `flows_closed`); the idle sweep's removals of
        /// such flows are counted with the rest in `SWEPT`.
        udp_unconfirmed_freed,
        /// DSR turns whose answer the client acknowledged only with its
        /// next request (the ACK rode on new data): answered, but the wait
        /// holds the client's own time before that request (held-back
        /// ACKs, think time), so it is no sample (`lb::latency::ackclock`).
        unclocked,
    }
);

counters!(
    /// Per service, indexed by service id.
    ServiceStats {
        /// Packets balanced to a backend (client to backend direction).
        /// The program does not count these per service: the control plane
        /// sums them from the service's backends' `pkts_to`/`bytes_to`.
        pkts,
        bytes,
        flows_new,
        /// TCP segments without SYN of an unknown flow: left to the kernel
        /// if the VIP is the host's own, else dropped (`drop_guarded`).
        pass_no_flow,
        /// Dropped: the active ring was empty.
        drop_no_backend,
        /// Dropped: no free NAT port toward the chosen backend.
        drop_nat_ports,
        /// Dropped: the flow or NAT table refused the insert.
        drop_flow_table,
        /// SYNs that opened a half-open flow, and half-open flows promoted
        /// to the flow table by a client ACK of the backend's SYN-ACK.
        half_open,
        promoted,
        /// Half-open flows whose table slot a newer SYN took before the
        /// client's ACK came (under a flood; or a handshake abandoned
        /// earlier, whose slot was still marked taken).
        half_open_lost,
        /// Segments of TCP connections this balancer never saw open (the
        /// router moved them from another balancer), given the Maglev
        /// table's backend in a DSR service, and their flow made here.
        taken_over,
    }
);

counters!(
    /// Whole program, one element.
    GlobalStats {
        /// Passed: neither IPv4 nor IPv6 (ARP, VLAN-tagged, ...), or IPv6
        /// while no IPv6 program is set.
        pass_not_ipv4,
        /// Passed: IPv4 not addressed to a service nor a NAT reply.
        pass_not_service,
        /// Passed: to the SNAT address and NAT port range, but no NAT entry
        /// (the balancer host's own traffic).
        pass_no_nat,
        /// Passed: IPv4 header with options.
        pass_ip_options,
        /// Passed: IPv4 fragment.
        pass_fragment,
        /// Passed: malformed or truncated headers.
        pass_malformed,
        /// Rewritten and handed to the kernel: next hop not resolved yet.
        pass_no_neigh,
        /// Rewritten and handed to the kernel: the FIB gave no usable route.
        pass_no_route,
        /// Sent back out of the same interface.
        tx,
        /// Redirected to another interface.
        redirect,
        /// Ring reads retried because a swap raced with the read.
        ring_retry,
        /// Packets of DSR services sent inside an IP-in-IP header.
        encap,
        /// Dropped, L2 DSR: the backend's neighbour entry is not resolved
        /// yet (the control plane resolves it), or the FIB reaches the
        /// backend only through a gateway (it is not on this segment).
        drop_no_neigh,
        drop_not_onlink,
        /// Dropped, IP-in-IP: no headroom for the outer header.
        drop_encap,
        /// Passed: IPv6 with extension headers (fragments among them),
        /// or not TCP/UDP (ICMPv6, neighbour discovery).
        pass_v6_ext,
        /// Packets too big for IP-in-IP with DF set, answered with ICMP
        /// "fragmentation needed" (the client's path MTU discovery).
        icmp_too_big,
        /// ICMP errors about a source-NATed flow, translated to its client.
        icmp_translated,
        /// Dropped: ICMP errors about a source-NATed flow that cannot be
        /// real (TCP: quoting a sequence number away from the client's;
        /// UDP: not from the backend itself), forged to reach a client.
        icmp_unproven,
        /// Dropped: ICMP messages past the rate of `ICMP_EVERY_NS` and
        /// `ICMP_BURST` (written or translated), so that a flood of
        /// spoofed packets too big, or of errors, is not reflected at the
        /// packet rate.
        icmp_rate_limited,
        /// IP-in-IP packets too big for the path, without DF: handed to
        /// the kernel, which fragments and forwards them.
        encap_fragmented,
        /// Dropped: not balanced (another port or protocol, a ping, a
        /// fragment, a stray segment) but addressed to a VIP or a backend
        /// (`GUARDED`), which the kernel would forward: a routing loop
        /// toward a router whose VIP route points here, or a way around
        /// the services to any backend port.
        drop_guarded,
        /// Dropped: to the SNAT address and NAT port range without a NAT
        /// entry while a migration copies the old program's last flows
        /// (`config_flags::MIGRATING`; otherwise passed, `pass_no_nat`).
        drop_no_nat,
        /// Sent with a TCP or UDP checksum the program finished itself:
        /// the frame came with only the pseudo header's sum, left to an
        /// offload that XDP_TX and redirects do not do (a veth's
        /// CHECKSUM_PARTIAL; `net::partial` in the program).
        csum_finished,
        /// Dropped: such a frame whose segment was too long to finish
        /// (over `partial::MAX_L4` bytes), rather than sent corrupt.
        drop_csum,
    }
);

counters!(
    /// The backend agent's decap program (`huddle agent --decap`), one
    /// element.
    DecapStats {
        /// IP-in-IP packets to a local address, unwrapped and passed on.
        decapped,
        /// IP-in-IP packets to an address not of this host: left alone.
        pass_not_local,
        /// IP-in-IP packets with outer options, fragmented, or with an
        /// inner packet that is not a whole IPv4 header: left alone.
        pass_malformed,
        /// Dropped: IP-in-IP from an outer source outside `--allow` (not a
        /// balancer: anyone could wrap a packet with a trusted inner
        /// source, CVE-2020-10136), or to an inner destination that is not
        /// one of this backend's VIPs.
        drop_foreign_source,
        drop_not_vip,
        /// Requests to a VIP whose arrival was recorded, and answers timed
        /// (first response byte leaving on egress).
        turns,
        answered,
    }
);
