//! The per-CPU scratch map, reached only through here: the BPF stack
//! holds 512 bytes for the whole call chain, so the keys and values one
//! packet's lookups need, and what one step hands the next, live in this
//! CPU's element instead. Each field says who writes it and who reads it.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use huddle_common::{FlowKey, FlowValue, NatKey, NatValue, SynCopy};

/// Per-CPU room for the keys a packet builds: the BPF stack holds 512
/// bytes for the whole call chain, and these alone are 128.
#[map]
pub static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// The keys and values of one packet's lookups and inserts.
#[repr(C)]
pub struct Scratch {
    /// The NAT entry of the packet's flow; `nval.flow` is the flow's key.
    pub nval: NatValue,
    pub nkey: NatKey,
    /// The flow `request` handed to `to_backend` to translate and send.
    pub fwd: FlowValue,
    /// An IPv6 packet too big once wrapped: the frame's Ethernet addresses
    /// as it arrived and the MTU to name (see `icmp6::too_big`).
    pub macs: [u8; 12],
    pub mtu: u32,
    /// Nonzero: the refusal `reply` handed to `retry::plan` refused only
    /// the NAT tuple (a TIME_WAIT's ACK), not the backend. In memory, not
    /// an argument: see `retry::plan`.
    pub retry_tuple: u32,
    /// Half-open slots a new flow still has to write (`halfopen::PENDING_*`
    /// bits): written by `halfopen::commit` after the packet, not before.
    pub pending: u32,
    /// A TCP segment's options (a SYN's, kept for its half-open slot, or a
    /// closing flow's, for its timestamp; see `timewait`).
    pub syn: SynCopy,
    /// The pending flow's hash (`nval.flow` is its key, `fwd` its flow).
    pub pending_hash: u64,
    /// A frame's checksum to finish (`forward::finished` writes it, the
    /// checksum program reads it).
    pub csum: CsumJob,
}

/// Where a checksum left to offload lies in the frame, and how the frame
/// leaves once it is finished.
#[repr(C)]
pub struct CsumJob {
    /// Offset of the TCP or UDP header in the frame, and its segment's length.
    pub l4_off: u32,
    pub l4_len: u32,
    /// The protocol (TCP or UDP).
    pub proto: u32,
    /// Where to redirect the frame, or 0: XDP_TX.
    pub ifindex: u32,
}

/// This CPU's scratch element, for a step that fills or reads several of
/// its fields. `None` never happens for a one-element per-CPU array; the
/// verifier needs the check.
#[inline(always)]
pub fn get() -> Option<*mut Scratch> {
    SCRATCH.get_ptr_mut(0)
}

/// The key of the flow being balanced (`nval.flow`), which `request` and
/// `retry` set before a backend is chosen, for the pick that hashes it
/// (Maglev).
#[inline(always)]
pub fn flow_key() -> Option<*const FlowKey> {
    let sc = SCRATCH.get_ptr(0)?;
    // SAFETY: a field of this CPU's element; no reference is made.
    Some(unsafe { core::ptr::addr_of!((*sc).nval.flow) })
}
