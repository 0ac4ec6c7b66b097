//! The one interface between the control plane and the kernel: loading and
//! attaching the XDP program, writing services, backends and rings, and
//! reading counters.

pub mod attach;
pub mod guard;
pub mod keys;
pub mod limits;
pub mod load;
pub mod migrate;
pub mod nat;
pub mod rings;
pub mod services;
pub mod stale;
pub mod stats;
pub mod sweep;
#[cfg(test)]
mod tests;
pub mod walk;

use crate::{
    config::{PortRange, Service},
    kernel::mmap::MappedArray,
};
use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::{links::PinnedLink, xdp::XdpLinkId},
    Ebpf,
};
use huddle_common::{
    maps, Backend, BackendStats, GlobalStats, KernelConfig, Latency, NatCursor, NatKey, Pulse,
    Ring, ServiceKey, ServiceKey6, ServiceStats, ServiceValue, Tuning,
};
use keys::*;
use std::{
    collections::HashMap as StdHashMap,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};
use sweep::Sweeper;

/// One DSR Maglev service as the data plane has it now.
#[derive(Clone, Debug)]
pub struct MaglevTable {
    /// Service id in the kernel.
    pub service: u32,
    pub vip: SocketAddr,
    pub proto: u8,
    /// The live table (backend ids).
    pub entries: Vec<u32>,
    /// Backend id -> address.
    pub backends: StdHashMap<u32, SocketAddr>,
    /// The flow hash's seed (`KernelConfig::maglev_seed`).
    pub seed: u64,
}

/// How long a retired ring slot is left alone before it is rewritten. A
/// packet reads a ring within microseconds; this is orders of magnitude
/// more, and the kernel side re-checks the generation anyway.
pub const SLOT_REUSE_GUARD: Duration = Duration::from_millis(2);

/// Writes `v` to every element of array map `name`.
fn fill<T: aya::Pod>(ebpf: &Ebpf, name: &str, v: T) -> Result<()> {
    let mut a = Array::<MapData, T>::try_from(reopen(ebpf, name)?)?;
    for i in 0..a.len() {
        a.set(i, v, 0)
            .with_context(|| format!("writing element {i} of {name}"))?;
    }
    Ok(())
}

/// Name of the pinned XDP link in the pin folder.
pub const LINK_PIN: &str = "link";

/// Removes everything pinned in `dir`: the link (the program detaches once
/// no process holds it) and the maps (freed with their last user). Returns
/// what was removed.
pub fn unpin(dir: &Path) -> Result<usize> {
    let mut n = 0;
    for name in std::iter::once(LINK_PIN).chain(maps::ALL) {
        let p = dir.join(name);
        if p.exists() {
            std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
            n += 1;
        }
    }
    // An older build's maps a migration had set aside, if it stopped.
    migrate::remove_aside(dir)?;
    if dir.exists() {
        std::fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(n)
}

/// Mode the program ended up attached in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachedMode {
    Native,
    Generic,
    /// Took over the link a previous run pinned (its mode unchanged).
    Adopted,
}

impl AttachedMode {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            AttachedMode::Native => "native",
            AttachedMode::Generic => "generic",
            AttachedMode::Adopted => "adopted",
        }
    }
}

/// A service as programmed into the kernel.
#[derive(Clone, Debug)]
pub struct ServiceSlot {
    pub id: u32,
    pub service: Service,
    /// Backend ids, parallel to `service.backends`.
    pub backend_ids: Vec<u32>,
    /// The live ring (backend ids) and its generation.
    pub ring: Vec<u32>,
    pub generation: u64,
    last_swap: Option<Instant>,
    /// Where the service's two Maglev tables start in `MAGLEV` (Maglev
    /// services only; `Tuning::maglev_base`).
    pub maglev_base: u32,
}

/// The loaded program and its maps, one struct per concern.
pub struct Dataplane {
    ebpf: Ebpf,
    /// Possible CPUs: per-CPU map values have one entry each.
    cpus: usize,
    pub services: Vec<ServiceSlot>,
    /// Where and how it is attached, and its pins.
    pub attach: Attachment,
    /// What the kernel is told about this balancer as a whole.
    pub settings: Settings,
    /// Services, backends and rings.
    maps: ServiceMaps,
    /// Counters and latency, per CPU.
    stats: StatMaps,
    /// The NAT walk and what it knows of tuples in use.
    nat: NatState,
}

/// Where the program is attached and what outlives the process.
pub struct Attachment {
    link: Option<XdpLinkId>,
    pinned_link: Option<PinnedLink>,
    /// The bpffs folder holding the maps and the link, if pinned.
    pub pins: Option<PathBuf>,
    /// The maps were left by an earlier run and taken over.
    pub adopted: bool,
    pub mode: Option<AttachedMode>,
    /// Why `auto` chose the mode it did, when that needs saying.
    pub mode_note: Option<String>,
    /// An older build's data plane being migrated: finished once this
    /// program runs.
    migration: Option<migrate::Migration>,
}

/// The balancer-wide settings: `CONFIG` and the SNAT addresses and ports.
pub struct Settings {
    /// SNAT addresses, in `Config::snat_addrs` order: IPv4, then IPv6.
    pub snat: Vec<Ipv4Addr>,
    pub snat6: Vec<std::net::Ipv6Addr>,
    pub nat_ports: PortRange,
    config: Array<MapData, KernelConfig>,
    /// The kernel settings as last written (the next-hop generation moves).
    kernel_config: KernelConfig,
}

/// The maps that say where a new flow goes.
struct ServiceMaps {
    services_map: HashMap<MapData, ServiceKey, ServiceValue>,
    services_map6: HashMap<MapData, ServiceKey6, ServiceValue>,
    service_index: Array<MapData, huddle_common::ServiceBucket>,
    backends_map: Array<MapData, Backend>,
    rings: Array<MapData, Ring>,
    ring_gen: Array<MapData, u64>,
    tuning: Array<MapData, Tuning>,
    /// Addresses whose unbalanced traffic is dropped (`guard`).
    guarded: HashMap<MapData, huddle_common::Addr, u8>,
    guard_filter: Array<MapData, huddle_common::GuardFilter>,
    /// The Maglev tables, two per Maglev service (see `swap_ring`).
    maglev: MappedArray,
    /// What the maps were sized for at load.
    limits: limits::MapLimits,
}

/// What the program counts and times.
struct StatMaps {
    backend_stats: PerCpuArray<MapData, BackendStats>,
    service_stats: PerCpuArray<MapData, ServiceStats>,
    global_stats: PerCpuArray<MapData, GlobalStats>,
    latency: PerCpuArray<MapData, Latency>,
    latency_heavy: PerCpuArray<MapData, Latency>,
    connect: PerCpuArray<MapData, Latency>,
    pulse: Array<MapData, Pulse>,
}

/// The NAT walk's cursors and what is known of tuples still in use.
struct NatState {
    swept: Array<MapData, u64>,
    tw_hints: HashMap<MapData, NatKey, huddle_common::TwHint>,
    tw_hints_until: Array<MapData, u64>,
    /// Handles of its own on the maps the idle sweep needs (see `Sweeper`).
    sweeper: Option<Sweeper>,
    nat_cursor: PerCpuArray<MapData, NatCursor>,
    /// `NAT_CURSOR` was made by this load: every backend's cursor starts.
    fresh_cursors: bool,
    /// Where an earlier run's NAT walk stood (`start_cursor`).
    resume: Option<walk::NatWalk>,
}

/// A second handle on map `name` of `ebpf` (its fd duplicated).
fn reopen(ebpf: &Ebpf, name: &str) -> Result<aya::maps::Map> {
    let map = ebpf
        .map(name)
        .with_context(|| format!("map {name} missing from the XDP object"))?;
    let data = match map {
        aya::maps::Map::LruHashMap(m) | aya::maps::Map::HashMap(m) | aya::maps::Map::Array(m) => m,
        _ => bail!("map {name} has an unexpected type"),
    };
    let fd = std::os::fd::AsFd::as_fd(data.fd())
        .try_clone_to_owned()
        .with_context(|| format!("duplicating the fd of map {name}"))?;
    Ok(aya::maps::Map::from_map_data(MapData::from_fd(fd)?)?)
}

fn take<T>(ebpf: &mut Ebpf, name: &str) -> Result<T>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .with_context(|| format!("map {name} missing from the XDP object"))?;
    T::try_from(map).with_context(|| format!("map {name} has an unexpected type"))
}
