//! Header lengths and EtherTypes, for every program and for the frames
//! user space builds: defined here once.

/// Ethernet header.
pub const ETH_LEN: usize = 14;
/// IPv4 header without options.
pub const IP_LEN: usize = 20;
/// IPv6 fixed header.
pub const IP6_LEN: usize = 40;
/// TCP header without options.
pub const TCP_LEN: usize = 20;
/// UDP header.
pub const UDP_LEN: usize = 8;
/// ICMP and ICMPv6 header (type, code, checksum, 4 bytes of rest).
pub const ICMP_LEN: usize = 8;
/// EtherType of IPv4, as the frame holds it.
pub const ETH_P_IP: [u8; 2] = [0x08, 0x00];
/// EtherType of IPv6, as the frame holds it.
pub const ETH_P_IPV6: [u8; 2] = [0x86, 0xdd];
