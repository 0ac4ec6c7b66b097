//! Map keys and values built from addresses: services' and SNAT
//! addresses' keys, backends, and the 16-byte address form.

use crate::config::Proto;
use huddle_common::{
    addr_v4, Backend, ServiceKey, ServiceKey6, FAMILY_V4, FAMILY_V6, SERVICE_KIND_SNAT,
    SERVICE_KIND_VIP,
};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

/// `Config::encap_src` and `encap_vary` for outer source addresses from
/// `prefix`, or `own` alone.
#[must_use]
pub fn encap_source(prefix: Option<crate::config::Prefix>, own: Ipv4Addr) -> ([u8; 16], u32) {
    match prefix {
        Some(p) => (
            addr_v4(p.addr.octets()),
            u32::from_ne_bytes((!p.mask()).to_be_bytes()),
        ),
        None => (addr_v4(own.octets()), 0),
    }
}

/// A key of `SERVICES` (IPv4) or `SERVICES6`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SvcKey {
    V4(ServiceKey),
    V6(ServiceKey6),
}

/// Service-map key of `ip`:`port_be`/`proto` of `kind`.
fn svc_key(ip: IpAddr, port_be: u16, proto: u8, kind: u8) -> SvcKey {
    match ip {
        IpAddr::V4(v4) => SvcKey::V4(ServiceKey {
            addr: v4.octets(),
            port_be,
            proto,
            kind,
        }),
        IpAddr::V6(v6) => SvcKey::V6(ServiceKey6 {
            addr: v6.octets(),
            port_be,
            proto,
            kind,
            _pad: 0,
        }),
    }
}

/// Map key of a service.
#[must_use]
pub fn service_key(vip: SocketAddr, proto: Proto) -> SvcKey {
    svc_key(
        vip.ip(),
        vip.port().to_be(),
        proto.number(),
        SERVICE_KIND_VIP,
    )
}

/// Map key of a SNAT address.
#[must_use]
pub fn snat_key(ip: IpAddr) -> SvcKey {
    svc_key(ip, 0, 0, SERVICE_KIND_SNAT)
}

/// Map value of a backend.
#[must_use]
pub fn backend_value(addr: SocketAddr) -> Backend {
    Backend {
        addr: ip_bytes(addr.ip()),
        port_be: addr.port().to_be(),
        family: if addr.is_ipv4() { FAMILY_V4 } else { FAMILY_V6 },
        service: 0,
        flags: 0,
    }
}

/// The address of a backend entry.
pub fn backend_addr(b: &Backend) -> SocketAddr {
    SocketAddr::from((ip_of(&b.addr, b.family), u16::from_be(b.port_be)))
}

/// The address a 16-byte map form holds (`ip_bytes` the other way):
/// IPv6 for `FAMILY_V6`, else IPv4 in its first bytes.
#[must_use]
pub fn ip_of(a: &[u8; 16], family: u8) -> IpAddr {
    if family == FAMILY_V6 {
        IpAddr::from(*a)
    } else {
        IpAddr::from([a[0], a[1], a[2], a[3]])
    }
}

/// An address in the 16-byte form map keys hold.
pub fn ip_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => addr_v4(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}
