//! The packets-per-second generator's settings (`huddle bench`).

/// Settings of the packet generator in the baseline object (`gen`,
/// `bounce`): where to redirect frames, over how many client ports to
/// spread them, and whether `bounce` is to let its frames die.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenConfig {
    pub ifindex: u32,
    pub flows: u32,
    /// First client port, host order.
    pub base_port: u16,
    pub _pad: u16,
    /// Non-zero: `bounce` drops what it receives (ends a round).
    pub stop: u32,
}
shared!(GenConfig, 16);

/// Value of the packet generator's `GEN_NAT` table (key: the frame's
/// addresses and ports as two words): a bare NAT forwarder's whole state
/// for a flow, its rewrite worked out beforehand.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenNat {
    /// New source and destination addresses, as they lie in the header.
    pub addrs: [u8; 8],
    /// New source and destination ports, as they lie in the header.
    pub ports: [u8; 4],
    /// One's-complement changes of the IP and the TCP checksum.
    pub ip_diff: u32,
    pub l4_diff: u32,
    /// Destination and source MAC.
    pub macs: [u8; 12],
}
shared!(GenNat, 32);

/// Bytes of the generator's frame template (Ethernet, IPv4, TCP, some
/// payload).
pub const GEN_FRAME: usize = 64;
