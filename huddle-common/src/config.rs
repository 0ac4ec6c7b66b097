//! The data plane's settings the daemon writes (`CONFIG`, `TUNING`).

use crate::*;

/// The layouts of this build's maps, recorded in `KernelConfig::layout`.
/// Raise it with any change to a pinned map's key, value or meaning, and
/// teach `dataplane::migrate` the step from the one before. 1: the
/// previous release (`fabdcf1`), which recorded none.
pub const LAYOUT_VERSION: u32 = 2;

/// Data plane settings, one element in `CONFIG`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelConfig {
    /// Source addresses of translated packets toward backends (the pool
    /// NAT tuples are drawn from): `snat_count` IPv4 ones, then
    /// `snat6_count` IPv6 ones.
    pub snat_addrs: [Addr; MAX_SNAT],
    pub snat_count: u16,
    pub family: u8,
    /// Which half of `SERVICE_INDEX` is live (1 or 2); 0: none, every
    /// packet asks `SERVICES` itself.
    pub service_half: u8,
    /// Inclusive NAT port range, host order.
    pub nat_port_min: u16,
    pub nat_port_max: u16,
    /// Ports in each CPU's slice of the range, and how many slices (one
    /// per possible CPU): CPU c walks `nat_port_min + c * slice_ports ..`
    /// and no two CPUs ever hand out the same tuple.
    pub slice_ports: u16,
    pub slices: u16,
    pub snat6_count: u16,
    /// `config_flags` bits.
    pub flags: u16,
    /// Bumped by the control plane every second: a cached next hop from
    /// an older generation is asked of the FIB again (no clock read per
    /// packet).
    pub hop_generation: u64,
    /// Slots of the half-open tables minus one (their size is a power of
    /// two).
    pub half_open_mask: u32,
    /// Bits of `encap_src` (as it lies in memory) that each flow sets from
    /// its client address and port: the outer source of IP-in-IP packets
    /// varies per flow, so a backend's NIC spreads flows over its queues.
    pub encap_vary: u32,
    /// Secret seed of the half-open tables' hash, so nobody outside can
    /// aim SYNs at one slot. Kept across restarts (the slots stay valid).
    pub hash_seed: u64,
    /// A client's SYN retransmitted this long after the first one, with no
    /// SYN-ACK or RST from the backend in between, goes to another backend
    /// (0: never).
    pub syn_timeout_ns: u64,
    /// Outer source address of IP-in-IP packets (IPv4: the first 4 bytes),
    /// before the per-flow bits of `encap_vary`.
    pub encap_src: Addr,
    /// Outer source address of IPv6-in-IPv6 packets (the flow label, not
    /// the address, varies per flow).
    pub encap6_src: Addr,
    /// Tuples per backend id in `NAT_USED` (`nat_used_per_backend`); 0:
    /// no such filter, every new flow looks its tuple up in `NAT`.
    pub nat_used_per_backend: u32,
    /// The map layouts of the build that wrote this (`LAYOUT_VERSION`),
    /// for the next build's start over the pinned maps. The program never
    /// reads it.
    pub layout: u32,
    /// Each `SERVICE_INDEX` half's hash multiplier: written before the
    /// half goes live and never while it is, so a packet that read
    /// `service_half` finds the multiplier that placed that half.
    pub service_mul: [u64; 2],
    /// Secret seed of the 5-tuple hash that indexes Maglev tables: the
    /// same on every balancer of a cluster (drawn from its key), unknown to
    /// clients, so nobody can choose source ports that land on a chosen
    /// backend.
    pub maglev_seed: u64,
}
shared!(KernelConfig, 16 * MAX_SNAT + 112);

impl KernelConfig {
    /// Splits the inclusive range `min..=max` into one slice per CPU.
    /// Returns `(slice_ports, slices)`; a range smaller than the CPU count
    /// gets as many one-port slices as it has ports.
    #[must_use]
    pub fn slices_for(min: u16, max: u16, cpus: u16) -> (u16, u16) {
        let span = u32::from(max.saturating_sub(min)) + 1;
        let slices = u32::from(cpus.clamp(1, MAX_NAT_SLICES)).min(span);
        ((span / slices) as u16, slices as u16)
    }
}

/// Per service, written by the control plane every tick from the ring's
/// own answer times: a backend that has owed an answer for longer than
/// these is passed over for new flows (0: never), before the control plane
/// has even judged it hung.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tuning {
    /// Oldest unanswered request turn (`Pulse::turn_wait_ns`).
    pub turn_skip_ns: u64,
    /// Oldest unanswered SYN (`Pulse::syn_wait_ns`).
    pub syn_skip_ns: u64,
    /// 1: of the ring's next two entries a new flow takes the one that
    /// has owed an answer for less time (least outstanding work, measured
    /// in time); 0: plain round robin.
    pub two_choices: u32,
    /// Nonzero: new flows take the service's Maglev table of this many
    /// entries (`MAGLEV`), indexed by a hash of the 5-tuple every balancer
    /// computes alike; 0: the ring's round robin.
    pub maglev_size: u32,
    /// Entry of `MAGLEV` where the service's first table starts (its
    /// second follows it): its place among the Maglev services, fixed for
    /// the service's life.
    pub maglev_base: u32,
    pub _pad: u32,
}
shared!(Tuning, 32);

/// Bits of `KernelConfig::flags`.
pub mod config_flags {
    /// A migration is under way (`dataplane::migrate`): a backend's packet
    /// to the NAT port range that no NAT entry explains is dropped, not
    /// handed to the kernel, until the flows and handshakes the old
    /// program made in its last moments are copied in. The kernel would
    /// answer RST and close the backend's side; dropped, the backend
    /// sends again and finds them. Cleared once they are.
    pub const MIGRATING: u16 = 1;
    /// Attached in generic (skb) mode: a frame keeps its checksum-offload
    /// state through XDP_TX and redirects, so a checksum left to offload
    /// stays so (the rewrite keeps its partial sum right) and is not
    /// finished: finished, a device that offloads would sum it again.
    pub const SKB_MODE: u16 = 2;
}
