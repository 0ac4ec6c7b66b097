//! The backend agent's decap object (`decap`): its program, its maps and
//! what they hold.

use crate::*;

/// The XDP program.
pub const PROGRAM: &str = "decap";
/// `HashMap<Addr, u32>`: this host's addresses; only IP-in-IP packets
/// to one of them are unwrapped.
pub const LOCAL: &str = "DECAP_LOCAL";
/// `PerCpuArray<DecapStats>` of one element.
pub const STATS: &str = "DECAP_STATS";
/// Addresses `LOCAL` holds at most.
pub const MAX_LOCAL: u32 = 256;
/// `LpmTrie<[u8; 4], u32>` and `LpmTrie<[u8; 16], u32>`: the outer
/// sources (the balancers) whose packets are unwrapped; the rest dropped.
pub const ALLOW4: &str = "DECAP_ALLOW4";
pub const ALLOW6: &str = "DECAP_ALLOW6";
/// Prefixes each of them holds at most.
pub const MAX_ALLOW: u32 = 64;
/// `HashMap<Addr, u32>`: the inner destinations a wrapped packet may have
/// (the VIPs this backend serves, else its own addresses); the rest
/// dropped.
pub const INNER: &str = "DECAP_INNER";
/// The TC program on egress that sees each request's first answer
/// byte leave.
pub const TTFB_PROGRAM: &str = "ttfb_out";
/// `HashMap<Addr, u32>`: the VIPs this backend serves by DSR, each
/// with its index in `TTFB`.
pub const VIPS: &str = "AGENT_VIPS";
/// `LruHashMap<TurnKey, u64>`: when each connection's pending request
/// arrived (`bpf_ktime_get_ns`).
pub const TURNS: &str = "AGENT_TURNS";
/// `PerCpuArray<AgentTtfb>` indexed by VIP index.
pub const TTFB: &str = "AGENT_TTFB";
/// VIPs one agent times.
pub const MAX_VIPS: u32 = 16;
/// Connections with a pending request it tracks at once.
pub const MAX_TURNS: u32 = 65_536;

/// Key of the agent's `AGENT_TURNS`: a connection to a VIP as the client
/// sends it (addresses and ports in network order).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TurnKey {
    pub client: Addr,
    pub vip: Addr,
    pub client_port_be: u16,
    pub vip_port_be: u16,
    pub _pad: u32,
}
shared!(TurnKey, 40);

/// The agent's time to first byte of one VIP, per CPU: the histogram, the
/// summed time and the count of its samples.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgentTtfb {
    pub sum_ns: u64,
    pub count: u64,
    pub hist: Latency,
}
shared!(AgentTtfb, 16 + 8 * LATENCY_BUCKETS);
