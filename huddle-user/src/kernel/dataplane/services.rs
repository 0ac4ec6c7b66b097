//! Services, SNAT addresses and backends written into the maps, and the
//! reconcile of a new config against what runs.

use super::*;
use crate::{
    config::{Config, Selection},
    kernel::service_index,
};
use anyhow::{Context, Result};
use huddle_common::{
    ring_slot, ServiceKey, ServiceValue, RING_CAPACITY, SERVICE_INDEX_SLOTS, SERVICE_KIND_SNAT,
    SERVICE_KIND_VIP,
};
use std::{
    collections::{HashMap as StdHashMap, HashSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Instant,
};
use tracing::{info, warn};

impl Dataplane {
    /// Makes `SERVICES` name exactly this run's SNAT addresses, so replies
    /// to them are translated (and an adopted map forgets old ones).
    pub(super) fn program_snat(&mut self) -> Result<()> {
        let want: Vec<SvcKey> = self
            .settings
            .snat
            .iter()
            .map(|ip| snat_key(IpAddr::V4(*ip)))
            .chain(
                self.settings
                    .snat6
                    .iter()
                    .map(|ip| snat_key(IpAddr::V6(*ip))),
            )
            .collect();
        for k in self.svc_keys(SERVICE_KIND_SNAT) {
            if !want.contains(&k) {
                self.svc_remove(&k)
                    .context("removing an old SNAT address")?;
            }
        }
        // Ids are indexes in `Config::snat_addrs`: IPv4 ones, then IPv6.
        for (i, k) in want.iter().enumerate() {
            let v = ServiceValue {
                id: i as u32,
                mode: 0,
            };
            self.svc_insert(k, v).context("writing a SNAT address")?;
        }
        Ok(())
    }

    /// The keys of `kind` in both service maps.
    pub(super) fn svc_keys(&self, kind: u8) -> Vec<SvcKey> {
        let v4 = self
            .maps
            .services_map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.kind == kind)
            .map(SvcKey::V4);
        let v6 = self
            .maps
            .services_map6
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.kind == kind)
            .map(SvcKey::V6);
        v4.chain(v6).collect()
    }

    pub(super) fn svc_get(&self, k: &SvcKey) -> Option<ServiceValue> {
        match k {
            SvcKey::V4(k) => self.maps.services_map.get(k, 0).ok(),
            SvcKey::V6(k) => self.maps.services_map6.get(k, 0).ok(),
        }
    }

    pub(super) fn svc_insert(&mut self, k: &SvcKey, v: ServiceValue) -> Result<()> {
        match k {
            SvcKey::V4(k) => self.maps.services_map.insert(k, v, 0)?,
            SvcKey::V6(k) => self.maps.services_map6.insert(k, v, 0)?,
        }
        Ok(())
    }

    pub(super) fn svc_remove(&mut self, k: &SvcKey) -> Result<()> {
        match k {
            SvcKey::V4(k) => self.maps.services_map.remove(k)?,
            SvcKey::V6(k) => self.maps.services_map6.remove(k)?,
        }
        Ok(())
    }

    /// Writes the kernel settings as they now stand in `kernel_config`.
    pub(super) fn write_config(&mut self) -> Result<()> {
        self.settings
            .config
            .set(0, self.settings.kernel_config, 0)
            .context("writing CONFIG")
    }

    /// The outer source of IPv6-in-IPv6 packets (an address of this host).
    pub fn set_encap6(&mut self, src: std::net::Ipv6Addr) -> Result<()> {
        self.settings.kernel_config.encap6_src = src.octets();
        self.write_config()
    }

    /// Moves the next-hop generation on: every CPU asks the FIB again for
    /// each backend's next hop on its next packet (a changed neighbour is
    /// picked up within one call of this).
    pub fn refresh_next_hops(&mut self) -> Result<()> {
        self.settings.kernel_config.hop_generation =
            self.settings.kernel_config.hop_generation.wrapping_add(1);
        self.write_config()
    }

    /// Makes the maps say what `cfg` says, keeping the ids of services and
    /// backends already there (live flows name backends by id) and the
    /// live ring of each kept service (the huddle decides changes).
    pub fn reconcile(&mut self, cfg: &Config) -> Result<()> {
        // Swap guards carry over a reload.
        let last_swaps: StdHashMap<u32, Instant> = self
            .services
            .iter()
            .filter_map(|s| s.last_swap.map(|t| (s.id, t)))
            .collect();
        let reloading = !self.services.is_empty();
        self.sync_settings(cfg)?;
        self.services.clear();
        let (old_services, want) = self.service_ids(cfg)?;
        let mut slots = self.backend_slots()?;
        let bases = self.maglev_bases(cfg, &want)?;
        for ((key, sid), service) in want.iter().zip(&cfg.services) {
            let ids = self.write_backends(*sid, service, &mut slots)?;
            let placed = Placed {
                kept: old_services.contains_key(key),
                maglev_base: bases.get(sid).copied().unwrap_or(0),
            };
            self.place_service(*key, *sid, service, ids, placed, &last_swaps)?;
        }
        for (k, id) in old_services {
            if !want.iter().any(|(w, _)| *w == k) {
                self.svc_remove(&k)
                    .with_context(|| format!("removing service id {id}"))?;
                info!("service id {id} is no longer configured: removed");
            }
        }
        if self.attach.adopted || reloading {
            let gone = slots
                .old
                .values()
                .filter(|id| !slots.kept.contains(id))
                .count();
            if gone > 0 {
                info!(
                    "{gone} backend(s) no longer configured: out of every ring, their flows drain"
                );
            }
        }
        self.write_guarded(cfg)?;
        self.publish_services()
    }

    /// The SYN timeout and the IP-in-IP outer source, into `CONFIG` when
    /// they changed.
    fn sync_settings(&mut self, cfg: &Config) -> Result<()> {
        let syn_timeout_ns = cfg.huddle.syn_timeout.as_nanos() as u64;
        // An IPv6-only balancer may have no IPv4 address at all (then no
        // IPv4 dsr-ipip service either: the daemon refuses one).
        let own = self
            .settings
            .snat
            .first()
            .copied()
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        let (encap_src, encap_vary) = encap_source(cfg.encap_prefix, own);
        if self.settings.kernel_config.syn_timeout_ns != syn_timeout_ns
            || self.settings.kernel_config.encap_src != encap_src
            || self.settings.kernel_config.encap_vary != encap_vary
        {
            self.settings.kernel_config.syn_timeout_ns = syn_timeout_ns;
            self.settings.kernel_config.encap_src = encap_src;
            self.settings.kernel_config.encap_vary = encap_vary;
            self.write_config()?;
        }
        Ok(())
    }

    /// The services in the maps now (key -> id), and each configured one
    /// with its id: kept where it was, else the lowest free.
    fn service_ids(&self, cfg: &Config) -> Result<ServiceIds> {
        let old: StdHashMap<SvcKey, u32> = self
            .svc_keys(SERVICE_KIND_VIP)
            .into_iter()
            .filter_map(|k| self.svc_get(&k).map(|v| (k, v.id)))
            .collect();
        let keys: Vec<SvcKey> = cfg
            .services
            .iter()
            .map(|s| service_key(s.vip, s.proto))
            .collect();
        let mut used: HashSet<u32> = keys.iter().filter_map(|k| old.get(k).copied()).collect();
        let mut want = Vec::new();
        for k in keys {
            let id = match old.get(&k) {
                Some(id) => *id,
                None => {
                    let n = self.maps.limits.services;
                    let id = (0..n).find(|i| !used.contains(i)).with_context(|| {
                        format!("max_services: the maps hold {n} services; restart with more")
                    })?;
                    used.insert(id);
                    id
                }
            };
            want.push((k, id));
        }
        Ok((old, want))
    }

    /// Where each Maglev service's two tables start in `MAGLEV`: a kept
    /// service keeps its place (the running program reads it there), a new
    /// one takes the lowest free.
    fn maglev_bases(&self, cfg: &Config, want: &[(SvcKey, u32)]) -> Result<StdHashMap<u32, u32>> {
        let (size, places) = (
            self.maps.limits.maglev_size,
            self.maps.limits.maglev_services,
        );
        let stride = 2 * size;
        let maglev: Vec<u32> = want
            .iter()
            .zip(&cfg.services)
            .filter(|(_, s)| s.selection == Selection::Maglev)
            .map(|((_, sid), _)| *sid)
            .collect();
        let mut bases = StdHashMap::new();
        let mut taken = HashSet::new();
        for sid in &maglev {
            let t = self.maps.tuning.get(sid, 0).unwrap_or_default();
            let place = t.maglev_base / stride;
            if t.maglev_size == size
                && t.maglev_base.is_multiple_of(stride)
                && place < places
                && taken.insert(place)
            {
                bases.insert(*sid, t.maglev_base);
            }
        }
        for sid in maglev {
            if bases.contains_key(&sid) {
                continue;
            }
            let place = (0..places).find(|p| !taken.contains(p)).with_context(|| {
                format!("max_maglev_services: the Maglev tables hold {places} services")
            })?;
            taken.insert(place);
            bases.insert(sid, place * stride);
        }
        Ok(bases)
    }

    /// Backend slots as the map has them now (in one batch read: one
    /// lookup a slot was 131,072 system calls a reload at 65,536 backends).
    fn backend_slots(&self) -> Result<Slots> {
        let n = self.maps.limits.backends;
        let values: Vec<Backend> = match crate::kernel::batch::plain(&self.maps.backends_map, 0, n)
        {
            Ok(v) if v.len() == n as usize => v,
            _ => (0..n)
                .map(|id| self.maps.backends_map.get(&id, 0))
                .collect::<Result<_, _>>()?,
        };
        let mut slots = Slots::default();
        for (id, b) in values.iter().enumerate() {
            let id = id as u32;
            if b.family == 0 {
                slots.free.push(id);
            } else {
                slots.old.insert((b.service, backend_addr(b)), id);
            }
        }
        // `take` pops the lowest first: the ids `NAT_USED` covers.
        slots.free.reverse();
        slots.values = values;
        Ok(slots)
    }

    /// Writes service `sid`'s backends into their slots; their ids.
    fn write_backends(
        &mut self,
        sid: u32,
        service: &Service,
        slots: &mut Slots,
    ) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for addr in &service.backends {
            let (id, known) = slots.take(sid, *addr)?;
            // A backend new to this slot walks its NAT tuples from where
            // the clock says, not from where a slot's last run stopped.
            if !known || self.nat.fresh_cursors {
                self.start_cursor(id, *addr)?;
            }
            let mut v = backend_value(*addr);
            v.service = sid;
            // A reload writes only what changed.
            if slots.values.get(id as usize) != Some(&v) {
                self.maps
                    .backends_map
                    .set(id, v, 0)
                    .with_context(|| format!("writing backend {addr}"))?;
            }
            ids.push(id);
        }
        Ok(ids)
    }

    /// Service `sid` with backends `ids`: its slot, first ring, tuning and
    /// `SERVICES` entry. A kept service (`kept`) keeps its live ring.
    fn place_service(
        &mut self,
        key: SvcKey,
        sid: u32,
        service: &Service,
        ids: Vec<u32>,
        placed: Placed,
        last_swaps: &StdHashMap<u32, Instant>,
    ) -> Result<()> {
        let kept = placed.kept;
        let generation = self.maps.ring_gen.get(&sid, 0)?;
        let actual: Vec<u32> = if kept {
            let r = self.maps.rings.get(&ring_slot(sid, generation), 0)?;
            r.backends[..(r.len as usize).min(RING_CAPACITY)].to_vec()
        } else {
            Vec::new()
        };
        // A kept service keeps its live ring (less backends gone from
        // the config) until the huddle says otherwise; a new one starts
        // with every backend.
        let live: Vec<u32> = actual
            .iter()
            .copied()
            .filter(|id| ids.contains(id))
            .collect();
        let first = if live.is_empty() { ids.clone() } else { live };
        self.services.push(ServiceSlot {
            id: sid,
            service: service.clone(),
            ring: actual.clone(),
            backend_ids: ids,
            generation,
            last_swap: last_swaps.get(&sid).copied(),
            maglev_base: placed.maglev_base,
        });
        // A Maglev table is written afresh every time: the selection or
        // a weight may have changed, or the map been made anew.
        if first != actual || service.selection == Selection::Maglev {
            self.swap_ring(self.services.len() - 1, &first)?;
        }
        // The selection is in the pass-over limits, which keep theirs.
        let limits = self.maps.tuning.get(&sid, 0).unwrap_or_default();
        self.set_tuning(sid, limits)?;
        let value = ServiceValue {
            id: sid,
            mode: service.mode.number(),
        };
        self.svc_insert(&key, value)
            .with_context(|| format!("writing service {}", service.name()))
    }

    /// Writes `SERVICES`' IPv4 entries into the half of `SERVICE_INDEX`
    /// that is not live, with that half's multiplier, then makes it live.
    /// A packet that read the old half number finds the old half intact.
    pub(super) fn publish_services(&mut self) -> Result<()> {
        let entries: Vec<(ServiceKey, ServiceValue)> = self
            .maps
            .services_map
            .iter()
            .filter_map(Result::ok)
            .collect();
        let Some(placed) = service_index::place(&entries) else {
            warn!(
                "no layout of the service index gives each of the {} IPv4 services and SNAT addresses a place: every packet looks its service up in the hash table (8-16 ns more)",
                entries.len()
            );
            self.settings.kernel_config.service_half = 0;
            return self.write_config();
        };
        let half = if self.settings.kernel_config.service_half == 1 {
            2
        } else {
            1
        };
        self.settings.kernel_config.service_mul[usize::from(half == 2)] = placed.mul;
        self.write_config()?;
        let base = u32::from(half - 1) * SERVICE_INDEX_SLOTS;
        for (i, e) in placed.slots.iter().enumerate() {
            self.maps
                .service_index
                .set(base + i as u32, *e, 0)
                .context("writing SERVICE_INDEX")?;
        }
        self.settings.kernel_config.service_half = half;
        self.write_config()
    }
}

/// The services in the maps now (key -> id), and each configured one with
/// its id.
type ServiceIds = (StdHashMap<SvcKey, u32>, Vec<(SvcKey, u32)>);

/// The backend slots a reconcile hands out.
#[derive(Default)]
struct Slots {
    /// In use before: (service id, address) -> backend id.
    old: StdHashMap<(u32, SocketAddr), u32>,
    /// Every slot's value as read, by id.
    values: Vec<Backend>,
    /// Never used, highest first (`take` pops the lowest).
    free: Vec<u32>,
    /// In use before and not kept, taken only when no slot is free.
    retired: Vec<u32>,
    /// Given to a configured backend by this reconcile.
    kept: HashSet<u32>,
}

/// How a service is placed: whether it was there before, and where its
/// Maglev tables start.
struct Placed {
    kept: bool,
    maglev_base: u32,
}

impl Slots {
    /// The slot of `addr` in service `sid`, and whether it had it before.
    fn take(&mut self, sid: u32, addr: SocketAddr) -> Result<(u32, bool)> {
        let known = self.old.get(&(sid, addr)).copied();
        let id = match known {
            Some(id) => id,
            // Never-used slots first: a retired slot may still be named by
            // flows draining to its old backend.
            None => match self.free.pop() {
                Some(id) => id,
                None => {
                    if self.retired.is_empty() {
                        self.retired = self
                            .old
                            .values()
                            .copied()
                            .filter(|id| !self.kept.contains(id))
                            .collect();
                        self.retired.sort_unstable();
                    }
                    self.retired.pop().context("no free backend slot")?
                }
            },
        };
        self.kept.insert(id);
        Ok((id, known.is_some()))
    }
}
