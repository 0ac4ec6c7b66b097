//! `GUARDED`: the VIPs and backend addresses the services name, less this
//! host's own addresses, so the program drops traffic to them it does not
//! balance instead of handing it to a kernel that forwards (see the
//! program's `lb::guard`).

use super::keys::ip_bytes;
use super::*;
use crate::{config::Config, sys::addresses};
use huddle_common::{guard_bit, guard_kind, Addr, GuardFilter, GUARD_BITS, MAX_GUARDED};
use std::{collections::BTreeMap, net::IpAddr};
use tracing::warn;

/// What `GUARDED` should hold for `cfg`: each address with its kinds,
/// less `local` (the kernel delivers those, never forwards them).
pub fn wanted(cfg: &Config, local: &[IpAddr]) -> BTreeMap<Addr, u8> {
    let mut want = BTreeMap::new();
    for s in &cfg.services {
        *want.entry(ip_bytes(s.vip.ip())).or_insert(0) |= guard_kind::VIP;
        for b in &s.backends {
            *want.entry(ip_bytes(b.ip())).or_insert(0) |= guard_kind::BACKEND;
        }
    }
    for ip in local {
        want.remove(&ip_bytes(*ip));
    }
    want
}

impl Dataplane {
    /// Makes `GUARDED` say what `cfg` names now. An address of this host
    /// is left out as it is at this call (a reload looks again).
    pub(super) fn write_guarded(&mut self, cfg: &Config) -> Result<()> {
        let local: Vec<IpAddr> = match addresses::ip_addrs() {
            Ok(a) => a.into_iter().map(|(_, ip)| ip).collect(),
            Err(e) => {
                warn!("cannot list this host's addresses ({e:#}): every VIP and backend address is guarded");
                Vec::new()
            }
        };
        let want = wanted(cfg, &local);
        let had: BTreeMap<Addr, u8> = self.maps.guarded.iter().filter_map(Result::ok).collect();
        let old: Vec<Addr> = had.keys().copied().collect();
        // The filter stays a superset of the map: both sets' bits while
        // the map changes, then the new set's.
        let union = filter(old.iter().chain(want.keys()));
        self.maps
            .guard_filter
            .set(0, union, 0)
            .context("writing GUARD_FILTER")?;
        let map = &mut self.maps.guarded;
        for k in old.iter().filter(|k| !want.contains_key(*k)) {
            map.remove(k).context("removing a GUARDED address")?;
        }
        // Only what changed: a reload at 65,536 backends rewrote them all.
        for (k, v) in want.iter().take(MAX_GUARDED as usize) {
            if had.get(k) != Some(v) {
                map.insert(k, v, 0).context("writing GUARDED")?;
            }
        }
        self.maps
            .guard_filter
            .set(0, filter(want.keys()), 0)
            .context("writing GUARD_FILTER")
    }
}

/// The filter with a bit set for each address.
fn filter<'a>(addrs: impl Iterator<Item = &'a Addr>) -> GuardFilter {
    let mut f: GuardFilter = [0; 1 << (GUARD_BITS - 6)];
    for a in addrs {
        let bit = guard_bit(a);
        f[(bit >> 6) as usize] |= 1 << (bit & 63);
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vips_and_backends_are_guarded_but_not_the_hosts_own_addresses() {
        let cfg = crate::config::ConfigFile::parse(
            "interface = \"eth0\"\n\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.1.0.1:8080\", \"10.1.0.2:8080\"]\n\n\
             [[service]]\nvip = \"10.0.0.1:443\"\nbackends = [\"10.1.0.1:8443\", \"10.0.0.9:8443\"]\n",
        )
        .unwrap()
        .validate()
        .unwrap();
        let local: Vec<IpAddr> = vec!["10.0.0.9".parse().unwrap()];
        let want = wanted(&cfg, &local);
        let at = |s: &str| want.get(&ip_bytes(s.parse().unwrap())).copied();
        assert_eq!(at("10.0.0.1"), Some(guard_kind::VIP));
        assert_eq!(at("10.1.0.1"), Some(guard_kind::BACKEND));
        assert_eq!(at("10.1.0.2"), Some(guard_kind::BACKEND));
        assert_eq!(at("10.0.0.9"), None, "the host's own address");
        assert_eq!(want.len(), 3);
        let f = filter(want.keys());
        for a in want.keys() {
            let bit = guard_bit(a);
            assert_ne!(f[(bit >> 6) as usize] & (1 << (bit & 63)), 0);
        }
        assert_eq!(f.iter().map(|w| w.count_ones()).sum::<u32>(), 3);
    }
}
