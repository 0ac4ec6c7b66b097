//! How many services, backends and Maglev services the maps hold: sized
//! at load, so a balancer of four backends does not pay for 65,536 (about
//! 6 KiB of kernel memory a backend slot on two CPUs, most of it three
//! per-CPU latency histograms). A pinned data plane keeps its sizes.

use crate::config::{counts, Config};
use anyhow::{bail, Context, Result};
use aya::EbpfLoader;
use huddle_common::{
    maglev_elements, maps, DEFAULT_BACKENDS, DEFAULT_SERVICES, MAX_BACKENDS, MAX_SERVICES, MAX_SNAT,
};
use std::path::Path;

/// Maps sized by the service count (`RINGS` holds two per service).
const PER_SERVICE: [&str; 5] = [
    maps::RING_GEN,
    maps::RR_CURSOR,
    maps::TUNING,
    maps::SERVICE_STATS,
    maps::RINGS,
];

/// Maps indexed by backend id.
const PER_BACKEND: [&str; 10] = [
    maps::BACKENDS,
    maps::NEXT_HOP,
    maps::NAT_CURSOR,
    maps::SWEPT,
    maps::BACKEND_STATS,
    maps::LATENCY,
    maps::LATENCY_HEAVY,
    maps::HEAVY,
    maps::CONNECT,
    maps::PULSE,
];

/// What the maps of one data plane hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapLimits {
    pub services: u32,
    pub backends: u32,
    /// Services with `selection = "maglev"` (two tables each).
    pub maglev_services: u32,
    /// Entries of each Maglev table.
    pub maglev_size: u32,
}

impl MapLimits {
    /// For `cfg`: its `max_*` settings, else the defaults or, for a
    /// configuration past them, twice what it has (room to grow by reload);
    /// a data plane pinned in `pins` keeps the sizes it was made with.
    pub fn of(cfg: &Config, pins: Option<&Path>) -> Result<MapLimits> {
        let (services, backends, maglev) = counts(&cfg.services);
        let room =
            |n: usize, default: u32, max: u32| (n as u32).saturating_mul(2).clamp(default, max);
        let mut l = MapLimits {
            services: cfg
                .limits
                .services
                .unwrap_or(room(services, DEFAULT_SERVICES, MAX_SERVICES)),
            backends: cfg
                .limits
                .backends
                .unwrap_or(room(backends, DEFAULT_BACKENDS, MAX_BACKENDS)),
            maglev_services: 0,
            maglev_size: cfg.maglev_table_size,
        };
        l.maglev_services = cfg
            .limits
            .maglev_services
            .unwrap_or(room(maglev, 2, l.services))
            .min(l.services);
        if let Some(dir) = pins {
            if let Some(n) = pinned(dir, maps::RING_GEN)? {
                l.services = n;
            }
            if let Some(n) = pinned(dir, maps::BACKENDS)? {
                l.backends = n;
            }
        }
        l.fits(cfg)?;
        Ok(l)
    }

    /// Whether `cfg` fits these maps (a reload cannot resize them).
    pub fn fits(&self, cfg: &Config) -> Result<()> {
        let (services, backends, maglev) = counts(&cfg.services);
        let restart = "the running maps were sized at start: set it and restart with `huddle stop` first (which drops every flow), or remove others";
        if services > self.services as usize {
            bail!(
                "max_services: {services} services configured, the maps hold {}; {restart}",
                self.services
            );
        }
        if backends > self.backends as usize {
            bail!(
                "max_backends: {backends} backends configured, the maps hold {}; {restart}",
                self.backends
            );
        }
        if maglev > self.maglev_services as usize {
            bail!(
                "max_maglev_services: {maglev} services with selection = \"maglev\", the Maglev tables hold {}; {restart}",
                self.maglev_services
            );
        }
        Ok(())
    }

    /// Elements of the `MAGLEV` map.
    #[must_use]
    pub fn maglev_elements(&self) -> u32 {
        maglev_elements(self.maglev_size, self.maglev_services.max(1))
    }

    /// Sizes each map of `loader` by these limits.
    pub fn size(&self, loader: &mut EbpfLoader) {
        for name in PER_SERVICE
            .iter()
            .chain(&PER_BACKEND)
            .chain([&maps::MAGLEV])
        {
            if let Some(n) = self.pinned_size(name) {
                loader.map_max_entries(name, n);
            }
        }
        // VIPs and SNAT addresses; the guard's every VIP and backend.
        loader.map_max_entries(maps::SERVICES, self.services + MAX_SNAT as u32);
        loader.map_max_entries(maps::SERVICES6, self.services + MAX_SNAT as u32);
        loader.map_max_entries(maps::GUARDED, self.services + self.backends);
    }

    /// The size `name` must have when pinned, if these limits set it.
    #[must_use]
    pub fn pinned_size(&self, name: &str) -> Option<u32> {
        if name == maps::RINGS {
            Some(2 * self.services)
        } else if PER_SERVICE.contains(&name) {
            Some(self.services)
        } else if PER_BACKEND.contains(&name) {
            Some(self.backends)
        } else if name == maps::MAGLEV {
            Some(self.maglev_elements())
        } else if name == maps::TAILS {
            // Pinned by a build with fewer programs: made afresh.
            Some(huddle_common::TAIL_SLOTS)
        } else {
            None
        }
    }
}

/// The size of map `name` pinned in `dir`, if it is.
fn pinned(dir: &Path, name: &str) -> Result<Option<u32>> {
    let pin = dir.join(name);
    if !pin.exists() {
        return Ok(None);
    }
    let info = aya::maps::MapInfo::from_pin(&pin)
        .with_context(|| format!("reading the pinned map {}", pin.display()))?;
    Ok(Some(info.max_entries()))
}
