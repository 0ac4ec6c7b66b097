//! The service a packet is addressed to: a VIP:port/protocol, or one of
//! the balancer's SNAT addresses. IPv4 keys are found in the direct-mapped
//! `SERVICE_INDEX` (one slot, one compare), IPv6 keys in a hash table.

use crate::{
    lb::maps::{SERVICES, SERVICES6, SERVICE_INDEX},
    net::{
        family::{Family, V4, V6},
        parse::Packet,
    },
};
use huddle_common::{
    service_slot, KernelConfig, ServiceKey, ServiceKey6, ServiceValue, SERVICE_INDEX_BITS,
    SERVICE_KIND_SNAT, SERVICE_KIND_VIP,
};

/// The service lookup, per family.
pub trait Lookup: Family {
    /// The service (VIP:port/proto) `p` is addressed to, if any.
    fn vip(p: &Packet<Self>, cfg: &KernelConfig) -> Option<ServiceValue>;
    /// Whether `p` is addressed to one of the balancer's SNAT addresses.
    fn to_snat(p: &Packet<Self>, cfg: &KernelConfig) -> bool;
    /// This family's SNAT addresses in `KernelConfig::snat_addrs`: first index
    /// and count.
    fn snat_range(cfg: &KernelConfig) -> (u32, u32);
}

impl V4 {
    /// `SERVICES`' value for `key`, from the live half of `SERVICE_INDEX`
    /// (or from `SERVICES` itself while no half is live).
    #[inline(always)]
    fn service(cfg: &KernelConfig, key: &ServiceKey) -> Option<ServiceValue> {
        let half = u32::from(cfg.service_half);
        if half == 0 {
            // SAFETY: copied out at once (values are replaced whole).
            return unsafe { SERVICES.get(key) }.copied();
        }
        let word = key.word();
        let mul = cfg.service_mul[usize::from(half == 2)];
        let slot = ((half - 1) << SERVICE_INDEX_BITS) | service_slot(word, mul);
        let b = SERVICE_INDEX.get(slot)?;
        // A half is rewritten only while the other is live, so the bucket
        // is read whole; its entries are filled from the first.
        let [e0, e1, e2, e3] = &b.entries;
        if e0.key.word() == word {
            Some(e0.value)
        } else if e1.key.word() == word {
            Some(e1.value)
        } else if e2.key.word() == word {
            Some(e2.value)
        } else if e3.key.word() == word {
            Some(e3.value)
        } else {
            None
        }
    }
}

impl Lookup for V4 {
    #[inline(always)]
    fn vip(p: &Packet<V4>, cfg: &KernelConfig) -> Option<ServiceValue> {
        let key = ServiceKey {
            addr: *p.dst(),
            port_be: u16::from_ne_bytes(p.dport),
            proto: p.proto,
            kind: SERVICE_KIND_VIP,
        };
        V4::service(cfg, &key)
    }

    #[inline(always)]
    fn to_snat(p: &Packet<V4>, cfg: &KernelConfig) -> bool {
        let key = ServiceKey {
            addr: *p.dst(),
            port_be: 0,
            proto: 0,
            kind: SERVICE_KIND_SNAT,
        };
        V4::service(cfg, &key).is_some()
    }

    #[inline(always)]
    fn snat_range(cfg: &KernelConfig) -> (u32, u32) {
        (0, u32::from(cfg.snat_count))
    }
}

impl V6 {
    #[inline(always)]
    fn lookup(addr: &[u8; 16], port_be: u16, proto: u8, kind: u8) -> Option<ServiceValue> {
        let key = ServiceKey6 {
            addr: *addr,
            port_be,
            proto,
            kind,
            _pad: 0,
        };
        // SAFETY: copied out at once (values are replaced whole).
        unsafe { SERVICES6.get(&key) }.copied()
    }

    /// Whether `addr` is one of the balancer's IPv6 SNAT addresses.
    #[inline(always)]
    pub fn is_snat(addr: &[u8; 16]) -> bool {
        V6::lookup(addr, 0, 0, SERVICE_KIND_SNAT).is_some()
    }
}

impl Lookup for V6 {
    #[inline(always)]
    fn vip(p: &Packet<V6>, _cfg: &KernelConfig) -> Option<ServiceValue> {
        V6::lookup(
            p.dst(),
            u16::from_ne_bytes(p.dport),
            p.proto,
            SERVICE_KIND_VIP,
        )
    }

    #[inline(always)]
    fn to_snat(p: &Packet<V6>, _cfg: &KernelConfig) -> bool {
        V6::is_snat(p.dst())
    }

    #[inline(always)]
    fn snat_range(cfg: &KernelConfig) -> (u32, u32) {
        (u32::from(cfg.snat_count), u32::from(cfg.snat6_count))
    }
}
