//! The testbeds' addresses: all in 10.213.0.0/16 (fd00:213::/32), inside
//! namespaces the testbed makes.

use std::net::{Ipv4Addr, Ipv6Addr};

pub const LB_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);

/// The same hosts on IPv6: fd00:213::/64 (balancer ::1, client ::2,
/// backends ::11 and up), VIPs in fd00:213:100::/64.
pub const LB_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 1);

pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 2);

pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0x100, 0, 0, 0, 0, 1);

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);

pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 213, 100, 1);

pub const HTTP_PORT: u16 = 8080;

pub const UDP_PORT: u16 = 5353;

/// Address of backend `i` (0-based).
#[must_use]
pub fn backend_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, 11 + i as u8)
}

/// IPv6 address of backend `i`.
#[must_use]
pub fn backend_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x11 + i as u16)
}
