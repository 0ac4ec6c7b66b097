//! Names of the programs, the limits compiled into the maps, and the
//! family and protocol numbers.

use crate::*;

/// Name of the XDP program in the object.
pub const PROGRAM_NAME: &str = "huddle";

/// Name of the IPv6 program the main one tail-calls.
pub const PROGRAM6_NAME: &str = "huddle6";

/// Name of the program both tail-call to finish a checksum left to
/// offload before the frame is sent (verified on its own: its loop,
/// inlined into every path that sends, took the main program past the
/// verifier's 1M instructions).
pub const PROGRAM_CSUM_NAME: &str = "huddle_csum";

/// `TAILS` slots: the IPv6 program, the checksum finisher.
pub const TAIL_V6: u32 = 0;
pub const TAIL_CSUM: u32 = 1;
pub const TAIL_SLOTS: u32 = 2;

/// Services (VIP:port/proto) one balancer can serve at most: the maps
/// are sized at load for `limits.services` of them (`DEFAULT_SERVICES`
/// unless configured), up to this.
pub const MAX_SERVICES: u32 = 4096;

/// Backends over all services at most; a backend id indexes `BACKENDS`.
/// The maps are sized at load for `limits.backends`.
pub const MAX_BACKENDS: u32 = 65_536;

const _: () = assert!(MAX_BACKENDS < MAGLEV_EMPTY);

/// Services the maps hold unless `limits.services` says otherwise (or the
/// configuration has more: then twice what it has).
pub const DEFAULT_SERVICES: u32 = 64;

/// Backends the maps hold unless `limits.backends` says otherwise (or the
/// configuration has more: then twice what it has).
pub const DEFAULT_BACKENDS: u32 = 1024;

/// Entries one ring can hold.
pub const RING_CAPACITY: usize = 256;

/// Flow table entries unless configured otherwise.
pub const DEFAULT_FLOW_TABLE_SIZE: u32 = 131_072;

/// Half-open table slots unless configured otherwise (a power of two).
pub const DEFAULT_HALF_OPEN_SIZE: u32 = 65_536;

/// Entries of a Maglev table unless configured otherwise (a prime; the
/// paper's and Katran's).
pub const DEFAULT_MAGLEV_SIZE: u32 = 65_537;

/// How long a source-NAT UDP flow that has made one exchange only (not
/// `flow_flags::UDP_CONFIRMED`) holds its tuple and its flow-table entry
/// when silent, against its service's `udp_idle_ms` once confirmed. A
/// spoofed pair (a datagram, the backend's answer, a second datagram)
/// then holds a tuple 2 s instead of 30; a real client that waits longer
/// than this between its second datagram and its third starts afresh.
pub const UDP_UNCONFIRMED_IDLE_NS: u64 = 2_000_000_000;

/// A closing flow keeps its NAT port this long, so its last segments
/// (final ACKs, retransmitted FINs) are still translated to it.
pub const NAT_LINGER_NS: u64 = 2_000_000_000;

/// Backends a client's SYN is sent to after the first one refused it or
/// left it unanswered (so at most 1 + this many backends per connection).
pub const MAX_SYN_RETRIES: u8 = 2;

/// NAT tuples a client's SYN is sent from after the first one toward a
/// backend that answered it with an ACK of an older connection (its
/// TIME_WAIT). Without TCP timestamps that is a coin toss per tuple past
/// the capacity, so five tuples leave one SYN in 32 to the client's own
/// resend.
pub const MAX_TUPLE_RETRIES: u8 = 4;

/// Bytes of TCP options a half-open slot keeps of the client's SYN (the
/// most a TCP header carries).
pub const SYN_OPTS: usize = 40;

/// The program writes a kernel log line at most this often per CPU.
pub const LOG_EVERY_NS: u64 = 1_000_000_000;

/// A CPU's kernel log gate (the program's `LOG_GATE`, never pinned): its
/// last line and the lines held back since.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LogGate {
    pub last_ns: u64,
    pub held: u64,
}
shared!(LogGate, 16);

/// A CPU's ICMP gate (the program's `ICMP_GATE`, never pinned): when its
/// next ICMP message is due (a GCRA's theoretical arrival time).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IcmpGate {
    pub due_ns: u64,
}
shared!(IcmpGate, 8);

/// ICMP messages the program sends (those it writes and those it
/// translates to clients): one per `ICMP_EVERY_NS` per CPU, in bursts of
/// up to `ICMP_BURST`, as Linux limits its own (`icmp_msgs_per_sec` 1000,
/// `icmp_msgs_burst` 50).
pub const ICMP_EVERY_NS: u64 = 1_000_000;
pub const ICMP_BURST: u64 = 50;

/// Tries to find a free NAT port before a new flow is refused.
pub const NAT_PORT_TRIES: u32 = 8;

/// How long a backend keeps a closed connection's 4-tuple in TIME_WAIT
/// (Linux: 60 s). A NAT tuple handed out again sooner may meet it.
pub const TIME_WAIT_NS: u64 = 60_000_000_000;

/// SNAT addresses one balancer can use (a power of two: the program masks
/// indexes with it).
pub const MAX_SNAT: usize = 16;

const _: () = assert!(MAX_SNAT.is_power_of_two());

/// CPUs whose NAT port slices the program tells apart; a CPU id at or
/// above the configured count shares the slice of its id modulo it.
pub const MAX_NAT_SLICES: u16 = 1024;

/// Ring slot of `service` for generation `generation` (double buffer).
#[inline(always)]
#[must_use]
pub const fn ring_slot(service: u32, generation: u64) -> u32 {
    service * 2 + (generation & 1) as u32
}

/// Address families, as in `AF_INET`/`AF_INET6`.
pub const FAMILY_V4: u8 = 2;

pub const FAMILY_V6: u8 = 10;

/// IP protocol numbers we balance.
pub const PROTO_TCP: u8 = 6;

pub const PROTO_UDP: u8 = 17;
