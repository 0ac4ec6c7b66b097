//! Interfaces, their addresses and routes, and resolved neighbours for
//! the backends.

use anyhow::{bail, Context, Result};
use std::{
    ffi::{CStr, CString},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
};
use tracing::debug;

/// Index of interface `name`, or a clear error if it does not exist.
pub fn ifindex(name: &str) -> Result<u32> {
    let c = CString::new(name).context("interface name contains NUL")?;
    // SAFETY: `c` is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("interface {name:?} does not exist in this network namespace");
    }
    Ok(idx)
}

/// First IPv4 address of interface `name`.
pub fn interface_ipv4(name: &str) -> Result<Option<Ipv4Addr>> {
    Ok(ipv4_addrs()?
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, a)| a))
}

/// First global IPv6 address of interface `name` (not link-local).
pub fn interface_ipv6(name: &str) -> Result<Option<Ipv6Addr>> {
    Ok(ipv6_addrs()?
        .into_iter()
        .find(|(n, a)| n == name && !a.is_unicast_link_local() && !a.is_loopback())
        .map(|(_, a)| a))
}

/// Every IPv6 address of this namespace's interfaces, with the interface.
pub fn ipv6_addrs() -> Result<Vec<(String, Ipv6Addr)>> {
    Ok(ip_addrs()?
        .into_iter()
        .filter_map(|(n, a)| match a {
            IpAddr::V6(v6) => Some((n, v6)),
            IpAddr::V4(_) => None,
        })
        .collect())
}

/// Every IPv4 address of this namespace's interfaces, with the interface.
pub fn ipv4_addrs() -> Result<Vec<(String, Ipv4Addr)>> {
    Ok(ip_addrs()?
        .into_iter()
        .filter_map(|(n, a)| match a {
            IpAddr::V4(v4) => Some((n, v4)),
            IpAddr::V6(_) => None,
        })
        .collect())
}

/// Every address of this namespace's interfaces, both families, with the
/// interface.
pub fn ip_addrs() -> Result<Vec<(String, IpAddr)>> {
    Ok(ifaddrs()?.into_iter().map(|(n, a, _)| (n, a)).collect())
}

/// The addresses of interface `name` with their prefix lengths: the
/// subnets it is on.
pub fn interface_prefixes(name: &str) -> Result<Vec<(IpAddr, u8)>> {
    Ok(ifaddrs()?
        .into_iter()
        .filter(|(n, _, _)| n == name)
        .map(|(_, a, l)| (a, l))
        .collect())
}

/// Prefix length of a netmask (its set bits).
fn mask_len(mask: *const libc::sockaddr) -> u8 {
    if mask.is_null() {
        return 0;
    }
    // SAFETY: non-null sockaddr of the same family as its address; the
    // family is read before the cast.
    unsafe {
        match i32::from((*mask).sa_family) {
            libc::AF_INET => (*mask.cast::<libc::sockaddr_in>())
                .sin_addr
                .s_addr
                .count_ones() as u8,
            libc::AF_INET6 => (*mask.cast::<libc::sockaddr_in6>())
                .sin6_addr
                .s6_addr
                .iter()
                .map(|b| b.count_ones() as u8)
                .sum(),
            _ => 0,
        }
    }
}

/// Every address of this namespace's interfaces: (interface, address,
/// prefix length).
fn ifaddrs() -> Result<Vec<(String, IpAddr, u8)>> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `addrs` with a list we free below.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getifaddrs");
    }
    let mut found = Vec::new();
    let mut cur = addrs;
    while !cur.is_null() {
        // SAFETY: `cur` walks the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: non-null, NUL-terminated name from the kernel.
        let ifname = unsafe { CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: non-null sockaddr; family read before the cast.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        if family == libc::AF_INET {
            // SAFETY: AF_INET addresses are sockaddr_in.
            let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
            found.push((
                ifname.to_string_lossy().into_owned(),
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
                mask_len(ifa.ifa_netmask),
            ));
        } else if family == libc::AF_INET6 {
            // SAFETY: AF_INET6 addresses are sockaddr_in6.
            let sin6 = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
            found.push((
                ifname.to_string_lossy().into_owned(),
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                mask_len(ifa.ifa_netmask),
            ));
        }
    }
    // SAFETY: frees the list from getifaddrs exactly once.
    unsafe { libc::freeifaddrs(addrs) };
    Ok(found)
}

/// Makes the kernel resolve each backend's link-layer address ahead of
/// traffic, so the XDP program finds it in the FIB. An empty datagram to the
/// discard port is enough to start resolution; nothing needs to answer.
pub fn warm_neighbours(backends: &[SocketAddr]) {
    // Once an address, from one socket a family: a socket a backend was
    // 65,536 of them a reload at 4,096 x 16 (on 256 addresses).
    let ips: std::collections::BTreeSet<IpAddr> = backends.iter().map(SocketAddr::ip).collect();
    let (mut v4, mut v6) = (None, None);
    for ip in ips {
        let slot = if ip.is_ipv4() { &mut v4 } else { &mut v6 };
        if slot.is_none() {
            *slot = Some(udp_for(ip).and_then(|sock| {
                sock.set_nonblocking(true)?;
                Ok(sock)
            }));
        }
        let r = match slot {
            Some(Ok(sock)) => sock.send_to(&[], SocketAddr::new(ip, 9)).map(drop),
            Some(Err(e)) => Err(std::io::Error::new(e.kind(), e.to_string())),
            None => Ok(()),
        };
        if let Err(e) = r {
            debug!("neighbour warm-up toward {ip}: {e}");
        }
    }
}

/// A UDP socket of `ip`'s family, on any address and port.
pub fn udp_for(ip: IpAddr) -> std::io::Result<UdpSocket> {
    if ip.is_ipv4() {
        UdpSocket::bind("0.0.0.0:0")
    } else {
        UdpSocket::bind("[::]:0")
    }
}

/// The route the main table gives `ip` (from /proc/net/route text): its
/// interface and gateway (`None`: on-link), longest prefix first, then
/// lowest metric.
#[must_use]
pub fn route_of(table: &str, ip: Ipv4Addr) -> Option<(String, Option<Ipv4Addr>)> {
    let ip = u32::from(ip);
    let hex = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::from_be);
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
            let (dest, gw, flags, metric, mask) = (
                hex(f.get(1)?)?,
                hex(f.get(2)?)?,
                u32::from_str_radix(f.get(3)?, 16).ok()?,
                f.get(6)?.parse::<u32>().ok()?,
                hex(f.get(7)?)?,
            );
            // RTF_UP, and the destination matches.
            (flags & 1 == 1 && ip & mask == dest & mask)
                .then(|| (mask.count_ones(), metric, f[0].to_string(), gw))
        })
        .min_by_key(|(bits, metric, _, _)| (std::cmp::Reverse(*bits), *metric))
        .map(|(_, _, iface, gw)| (iface, (gw != 0).then(|| Ipv4Addr::from(gw))))
}

/// As `route_of`, for IPv6 (from /proc/net/ipv6_route text).
#[must_use]
pub fn route6_of(table: &str, ip: Ipv6Addr) -> Option<(String, Option<Ipv6Addr>)> {
    let want = u128::from(ip);
    let hex = |s: &str| u128::from_str_radix(s, 16).ok();
    table
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // dest plen src plen next_hop metric refcnt use flags iface
            let (dest, plen, gw, metric, flags) = (
                hex(f.first()?)?,
                u32::from_str_radix(f.get(1)?, 16).ok()?,
                hex(f.get(4)?)?,
                u32::from_str_radix(f.get(5)?, 16).ok()?,
                u32::from_str_radix(f.get(8)?, 16).ok()?,
            );
            let mask = if plen == 0 {
                0
            } else {
                u128::MAX << (128 - plen.min(128))
            };
            // RTF_UP, not a rejecting route, the destination matches.
            (flags & 1 == 1 && flags & 0x200 == 0 && want & mask == dest & mask)
                .then(|| (plen, metric, f.get(9).unwrap_or(&"").to_string(), gw))
        })
        .filter(|(_, _, iface, _)| iface != "lo")
        .min_by_key(|(plen, metric, _, _)| (std::cmp::Reverse(*plen), *metric))
        .map(|(_, _, iface, gw)| (iface, (gw != 0).then(|| Ipv6Addr::from(gw))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_matched_longest_prefix_first() {
        let t =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
eth0\t00000000\tFE00D50A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
eth0\t0000D50A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
eth1\t0063D50A\t0100D50A\t0003\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert_eq!(route_of(t, ip("10.213.0.11")), Some(("eth0".into(), None)));
        assert_eq!(
            route_of(t, ip("10.213.99.5")),
            Some(("eth1".into(), Some(ip("10.213.0.1"))))
        );
        assert_eq!(
            route_of(t, ip("8.8.8.8")),
            Some(("eth0".into(), Some(ip("10.213.0.254"))))
        );
    }
}
