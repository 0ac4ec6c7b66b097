//! What `huddle run` checks before it binds or loads anything, each
//! failure one line naming what to change: privileges, the interface, the
//! SNAT addresses, the NAT port range, and every backend's route.

use crate::{
    config::{Config, Mode},
    sys::host,
};
use anyhow::{bail, Context, Result};
use std::{
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

/// What the host gives the balancer.
pub(super) struct HostFacts {
    pub ifindex: u32,
    /// Source NAT addresses, IPv4 and IPv6 (empty: no service needs them).
    pub snat: Vec<Ipv4Addr>,
    pub snat6: Vec<Ipv6Addr>,
}

/// Privileges, the interface, the SNAT addresses and the NAT ports.
pub(super) fn host(cfg: &Config) -> Result<HostFacts> {
    host::check_privileges()?;
    let ifindex = crate::sys::addresses::ifindex(&cfg.interface)?;
    let snat = snat_v4(cfg)?;
    let ipip4 = cfg
        .services
        .iter()
        .any(|s| s.mode == Mode::DsrIpip && s.vip.is_ipv4());
    if ipip4 && snat.is_empty() && cfg.encap_prefix.is_none() {
        bail!(
            "interface {} has no IPv4 address for the outer source of dsr-ipip packets; set encap_prefix",
            cfg.interface
        );
    }
    let snat6 = snat_v6(cfg)?;
    nat_ports(cfg, &snat)?;
    Ok(HostFacts {
        ifindex,
        snat,
        snat6,
    })
}

/// Every backend reachable, and `dsr-l2` ones on the segment.
pub(super) fn backends(cfg: &Config) -> Result<()> {
    check_reachable(cfg)?;
    check_dsr(cfg)?;
    if let Some(w) = neighbour_room(cfg) {
        tracing::warn!("{w}");
    }
    Ok(())
}

/// The kernel's neighbour entries one host holds, over all its network
/// namespaces, unless `net.ipv4.neigh.default.gc_thresh3` says otherwise.
const GC_THRESH3_DEFAULT: usize = 1024;

/// A warning when this balancer's on-link IPv4 backends (each needs a
/// neighbour entry, kept fresh by probes and traffic) come near the
/// kernel's limit: measured (hc-scale), 1,024 of them filled the table,
/// and the balancer could no longer answer its clients' ARP.
fn neighbour_room(cfg: &Config) -> Option<String> {
    let table = fs::read_to_string("/proc/net/route").ok()?;
    let on_link: std::collections::BTreeSet<Ipv4Addr> = cfg
        .services
        .iter()
        .flat_map(|s| &s.backends)
        .filter_map(|b| match b.ip() {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        })
        .filter(|ip| {
            matches!(
                crate::sys::addresses::route_of(&table, *ip),
                Some((_, None))
            )
        })
        .collect();
    // Only the host's first namespace has the setting; elsewhere it
    // applies all the same.
    let limit = fs::read_to_string("/proc/sys/net/ipv4/neigh/default/gc_thresh3")
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok());
    neighbour_warning(on_link.len(), limit)
}

/// The warning for `on_link` neighbour backends under a table of `limit`
/// entries (`None`: unreadable here, so the default), if they leave less
/// than 256 entries for the rest.
fn neighbour_warning(on_link: usize, limit: Option<usize>) -> Option<String> {
    let room = limit.unwrap_or(GC_THRESH3_DEFAULT);
    (on_link + 256 > room).then(|| {
        format!(
            "{on_link} backends are on-link neighbours, and the kernel keeps at most {room} neighbour entries over the whole host{}: past that, ARP for clients and backends fails and nothing is forwarded. Raise net.ipv4.neigh.default.gc_thresh3 (and gc_thresh2) on the host, for example to {}, or reach the backends through a router",
            if limit.is_none() {
                " (the default; this namespace cannot read the host's setting)"
            } else {
                ""
            },
            (on_link * 2).next_power_of_two().max(4096)
        )
    })
}

/// Whether a source-NAT service of this family (IPv6 or not) is configured.
fn snat_family(cfg: &Config, v6: bool) -> bool {
    cfg.services
        .iter()
        .any(|s| s.mode == Mode::Snat && s.vip.is_ipv6() == v6)
}

/// The IPv4 source NAT addresses: configured ones must be this host's.
fn snat_v4(cfg: &Config) -> Result<Vec<Ipv4Addr>> {
    Ok(if cfg.snat_ips.is_empty() {
        match crate::sys::addresses::interface_ipv4(&cfg.interface)? {
            Some(ip) => vec![ip],
            None if !snat_family(cfg, false) => Vec::new(),
            None => bail!(
                "interface {} has no IPv4 address; pass --snat-ip",
                cfg.interface
            ),
        }
    } else {
        let local = crate::sys::addresses::ipv4_addrs()?;
        for ip in &cfg.snat_ips {
            if !local.iter().any(|(_, a)| a == ip) {
                bail!(
                    "snat_ips: {ip} is not an address of this host, so backends' replies to it would not reach the balancer; add it (`ip addr add {ip}/32 dev {}`) or leave it out",
                    cfg.interface
                );
            }
        }
        cfg.snat_ips.clone()
    })
}

/// The IPv6 source NAT addresses, likewise.
fn snat_v6(cfg: &Config) -> Result<Vec<Ipv6Addr>> {
    Ok(if cfg.snat_ips6.is_empty() {
        match crate::sys::addresses::interface_ipv6(&cfg.interface)? {
            _ if !snat_family(cfg, true) => Vec::new(),
            Some(ip) => vec![ip],
            None => bail!(
                "interface {} has no global IPv6 address for the IPv6 services' source NAT; add one or set snat_ips6",
                cfg.interface
            ),
        }
    } else {
        let local = crate::sys::addresses::ipv6_addrs()?;
        for ip in &cfg.snat_ips6 {
            if !local.iter().any(|(_, a)| a == ip) {
                bail!(
                    "snat_ips6: {ip} is not an address of this host, so backends' replies to it would not reach the balancer; add it (`ip addr add {ip}/128 dev {}`) or leave it out",
                    cfg.interface
                );
            }
        }
        cfg.snat_ips6.clone()
    })
}

/// NAT ports outside the kernel's ephemeral range, and no VIP inside them.
fn nat_ports(cfg: &Config, snat: &[Ipv4Addr]) -> Result<()> {
    let ephemeral = crate::sys::sysctls::ephemeral_ports()?;
    if cfg.nat_ports.overlaps(&ephemeral) {
        bail!(
            "nat_ports {} overlap the kernel's ephemeral ports {ephemeral} (net.ipv4.ip_local_port_range); \
             choose --nat-ports outside them so NAT never collides with the host's own connections",
            cfg.nat_ports
        );
    }
    for s in &cfg.services {
        if snat.iter().any(|a| s.vip.ip() == *a)
            && (cfg.nat_ports.min..=cfg.nat_ports.max).contains(&s.vip.port())
        {
            bail!(
                "VIP {} lies in the SNAT address's NAT port range {}",
                s.name(),
                cfg.nat_ports
            );
        }
    }
    Ok(())
}

/// Refuses backends this host has no route to (a UDP connect sends nothing
/// but asks the kernel for a route). Errors name the field. Each address
/// is asked once, on one socket a family: at 65,536 backends a socket a
/// backend was most of a reload's time.
fn check_reachable(cfg: &Config) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    let (mut v4, mut v6) = (None, None);
    for (i, s) in cfg.services.iter().enumerate() {
        for (j, b) in s.backends.iter().enumerate() {
            if !seen.insert(b.ip()) {
                continue;
            }
            let slot = if b.is_ipv4() { &mut v4 } else { &mut v6 };
            let sock = match slot {
                Some(s) => s,
                None => slot.insert(
                    crate::sys::addresses::udp_for(b.ip()).context("opening a UDP socket")?,
                ),
            };
            if let Err(e) = sock.connect(b) {
                bail!(
                    "service[{i}].backends[{j}]: backend {b} is unreachable from this host ({e})"
                );
            }
        }
    }
    Ok(())
}

/// Refuses a `dsr-l2` backend that is not a neighbour on the interface:
/// only its MAC address changes, so it must be on the balancer's segment.
fn check_dsr(cfg: &Config) -> Result<()> {
    let l2 = cfg.services.iter().any(|s| s.mode == Mode::DsrL2);
    if !l2 {
        return Ok(());
    }
    let table = fs::read_to_string("/proc/net/route").context("reading /proc/net/route")?;
    let table6 = fs::read_to_string("/proc/net/ipv6_route").unwrap_or_default();
    for (i, s) in cfg.services.iter().enumerate() {
        if s.mode != Mode::DsrL2 {
            continue;
        }
        for (j, b) in s.backends.iter().enumerate() {
            let ip = b.ip();
            let route = match ip {
                IpAddr::V4(v4) => crate::sys::addresses::route_of(&table, v4)
                    .map(|(i, gw)| (i, gw.map(IpAddr::V4))),
                IpAddr::V6(v6) => crate::sys::addresses::route6_of(&table6, v6)
                    .map(|(i, gw)| (i, gw.map(IpAddr::V6))),
            };
            match route {
                Some((iface, None)) if iface == cfg.interface => {}
                Some((iface, gw)) => bail!(
                    "service[{i}].backends[{j}]: backend {ip} is not on the segment of {} (the route goes {}on {iface}); dsr-l2 changes only the destination MAC, so the backend must be a neighbour: move it to this segment or use mode = \"dsr-ipip\"",
                    cfg.interface,
                    gw.map(|g| format!("via {g} ")).unwrap_or_default()
                ),
                None => bail!(
                    "service[{i}].backends[{j}]: backend {ip}: no route from this host"
                ),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn near_the_neighbour_limit_it_says_what_to_raise() {
        assert!(super::neighbour_warning(700, None).is_none());
        let w = super::neighbour_warning(800, None).expect("near the default");
        assert!(
            w.contains("at most 1024") && w.contains("cannot read"),
            "{w}"
        );
        assert!(w.contains("gc_thresh3") && w.contains("4096"), "{w}");
        assert!(super::neighbour_warning(3000, Some(8192)).is_none());
        let w = super::neighbour_warning(8000, Some(8192)).expect("near a raised one");
        assert!(w.contains("16384") && !w.contains("cannot read"), "{w}");
    }
}
