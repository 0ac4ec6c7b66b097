//! The one interface between the control plane and the kernel: loading and
//! attaching the XDP program, writing services, backends and rings, and
//! reading counters.

pub mod walk;

use crate::{
    config::{Config, PortRange, Proto, Selection, Service, XdpMode},
    kernel::maglev,
    kernel::mmap::MappedArray,
    kernel::object,
    kernel::service_index,
};
use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray, PerCpuValues},
    programs::{
        links::{FdLink, PinnedLink},
        xdp::{XdpLink, XdpLinkId},
        Xdp,
    },
    Ebpf, EbpfLoader,
};
use huddle_common::{
    addr_v4, maps, ring_slot, Backend, BackendStats, Config as KernelConfig, Counters, FlowKey,
    FlowValue, GlobalStats, Latency, NatCursor, NatKey, NatValue, Pulse, Ring, ServiceEntry,
    ServiceKey, ServiceKey6, ServiceStats, ServiceValue, Tuning, FAMILY_V4, FAMILY_V6, MAX_SNAT,
    PROGRAM6_NAME, PROGRAM_NAME, PROTO_UDP, RING_CAPACITY, SERVICE_INDEX_SLOTS, SERVICE_KIND_SNAT,
    SERVICE_KIND_VIP,
};
use huddle_common::{maglev_elements, MAGLEV_EMPTY, MAX_BACKENDS, MAX_SERVICES};
use std::{
    collections::{HashMap as StdHashMap, HashSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};
use tracing::{info, warn};

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

/// The table members of `slot`'s ring `ring` (backend ids): each with
/// its address and weight.
fn members(slot: &ServiceSlot, ring: &[u32]) -> Vec<maglev::Member> {
    ring.iter()
        .filter_map(|id| {
            let j = slot.backend_ids.iter().position(|b| b == id)?;
            Some(maglev::Member {
                id: *id,
                addr: slot.service.backends[j],
                weight: slot.service.options[j].weight,
            })
        })
        .collect()
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
}

/// The loaded program and its maps.
pub struct Dataplane {
    ebpf: Ebpf,
    link: Option<XdpLinkId>,
    pinned_link: Option<PinnedLink>,
    /// The bpffs folder holding the maps and the link, if pinned.
    pub pins: Option<PathBuf>,
    /// The maps were left by an earlier run and taken over.
    pub adopted: bool,
    pub mode: Option<AttachedMode>,
    /// Why `auto` chose the mode it did, when that needs saying.
    pub mode_note: Option<String>,
    /// SNAT addresses, in `Config::snat_addrs` order: IPv4, then IPv6.
    pub snat: Vec<Ipv4Addr>,
    pub snat6: Vec<std::net::Ipv6Addr>,
    pub nat_ports: PortRange,
    config: Array<MapData, KernelConfig>,
    /// The kernel settings as last written (the next-hop generation moves).
    kernel_config: KernelConfig,
    services_map: HashMap<MapData, ServiceKey, ServiceValue>,
    services_map6: HashMap<MapData, ServiceKey6, ServiceValue>,
    service_index: Array<MapData, ServiceEntry>,
    backends_map: Array<MapData, Backend>,
    rings: Array<MapData, Ring>,
    ring_gen: Array<MapData, u64>,
    backend_stats: PerCpuArray<MapData, BackendStats>,
    service_stats: PerCpuArray<MapData, ServiceStats>,
    global_stats: PerCpuArray<MapData, GlobalStats>,
    latency: PerCpuArray<MapData, Latency>,
    connect: PerCpuArray<MapData, Latency>,
    pulse: Array<MapData, Pulse>,
    tuning: Array<MapData, Tuning>,
    /// The Maglev tables, two per service (see `swap_ring`).
    maglev: MappedArray,
    pub maglev_size: u32,
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
    /// Possible CPUs: per-CPU map values have one entry each.
    cpus: usize,
    pub services: Vec<ServiceSlot>,
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

/// Removes established UDP flows that stayed silent past their service's
/// idle timeout, with their NAT entries: their tuples are free again and
/// they stop counting as active. The program keeps each UDP flow's last
/// datagram time in `FlowValue::stamp_ns`; it never removes flows itself.
pub struct Sweeper {
    flows: HashMap<MapData, FlowKey, FlowValue>,
    nat: HashMap<MapData, NatKey, NatValue>,
    backends: Array<MapData, Backend>,
    swept: Array<MapData, u64>,
    snat_addrs: [huddle_common::Addr; MAX_SNAT],
}

impl Sweeper {
    /// One pass: every UDP flow of a service in `idle_ns` (service id ->
    /// idle timeout) silent for longer than that at `now_ns`
    /// (CLOCK_MONOTONIC). Returns how many it removed.
    pub fn sweep(&mut self, now_ns: u64, idle_ns: &StdHashMap<u32, u64>) -> Result<u64> {
        if idle_ns.is_empty() {
            return Ok(0);
        }
        let mut idle = Vec::new();
        for entry in self.flows.iter() {
            let Ok((k, v)) = entry else { continue };
            let Some(limit) = idle_ns.get(&v.service) else {
                continue;
            };
            if k.proto == PROTO_UDP
                && v.flags & huddle_common::flow_flags::CLOSING == 0
                && now_ns.saturating_sub(v.stamp_ns) > *limit
            {
                idle.push((k, v));
            }
        }
        let mut by_backend: StdHashMap<u32, u64> = StdHashMap::new();
        for (k, v) in &idle {
            // Alive again since the scan read it: leave it.
            match self.flows.get(k, 0) {
                Ok(now) if now.stamp_ns == v.stamp_ns => {}
                _ => continue,
            }
            if self.flows.remove(k).is_err() {
                continue;
            }
            if let Ok(b) = self.backends.get(&v.backend, 0) {
                let key = NatKey::new(
                    self.snat_addrs[usize::from(v.snat) % MAX_SNAT],
                    b.addr,
                    b.port_be,
                    v.nat_port_be,
                    PROTO_UDP,
                    b.family,
                );
                // Only if it still names this flow (the tuple may have been
                // handed to another since).
                if self.nat.get(&key, 0).is_ok_and(|n| n.flow == *k) {
                    let _ = self.nat.remove(&key);
                }
            }
            *by_backend.entry(v.backend).or_default() += 1;
        }
        let mut removed = 0;
        for (id, n) in by_backend {
            let before = self.swept.get(&id, 0).unwrap_or(0);
            self.swept.set(id, before + n, 0)?;
            removed += n;
        }
        Ok(removed)
    }
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

impl Dataplane {
    /// Loads the program and programs every map, without attaching.
    ///
    /// With `pins`, the maps live in that bpffs folder. If an earlier run
    /// left them there (its program still attached), they are adopted:
    /// flows, NAT entries and counters carry on, services and backends keep
    /// their ids, and the configuration is reconciled into them. Without
    /// `pins` (tests, benchmarks) nothing outlives the process, and a
    /// failure leaves nothing behind.
    /// `snat` and `snat6`: the SNAT addresses of each family (at most
    /// `MAX_SNAT` in all).
    pub fn load(
        cfg: &Config,
        snat: &[Ipv4Addr],
        snat6: &[std::net::Ipv6Addr],
        pins: Option<&Path>,
        resume: Option<walk::NatWalk>,
    ) -> Result<Dataplane> {
        if snat.len() + snat6.len() > MAX_SNAT {
            bail!(
                "at most {MAX_SNAT} SNAT addresses in all, not {}",
                snat.len() + snat6.len()
            );
        }
        let cpus = crate::sys::host::possible_cpus()?;
        let (slice_ports, slices) = KernelConfig::slices_for(
            cfg.nat_ports.min,
            cfg.nat_ports.max,
            u16::try_from(cpus).unwrap_or(u16::MAX),
        );
        let snat_total = (snat.len() + snat6.len()) as u16;
        let nat_used = huddle_common::nat_used_per_backend(slice_ports, slices, snat_total);
        if nat_used == 0 {
            info!(
                "{} backends x {} NAT tuples would take more than {} MiB to track: each new flow asks the NAT table whether its tuple is in use (a cold lookup)",
                huddle_common::NAT_USED_BACKENDS,
                u64::from(slice_ports) * u64::from(slices) * u64::from(snat_total),
                huddle_common::MAX_NAT_USED_BYTES >> 20
            );
        }
        let half_open = cfg.half_open_table_size.next_power_of_two();
        let tag_lines = huddle_common::half_open_tag_lines(half_open);
        let mut loader = EbpfLoader::new();
        // HUDDLE_VERIFIER_LOG=1: the verifier's whole log on a refusal
        // (for whoever changes the program).
        if std::env::var_os("HUDDLE_VERIFIER_LOG").is_some() {
            loader
                .verifier_log_level(aya::VerifierLogLevel::VERBOSE | aya::VerifierLogLevel::STATS);
        }
        loader
            .map_max_entries(maps::FLOWS, cfg.flow_table_size)
            .map_max_entries(maps::NAT, cfg.flow_table_size)
            .map_max_entries(maps::HALF_OPEN, half_open)
            .map_max_entries(maps::HALF_OPEN_NAT, half_open)
            .map_max_entries(maps::HALF_OPEN_TAGS, tag_lines)
            .map_max_entries(maps::HALF_OPEN_NAT_TAGS, tag_lines)
            .map_max_entries(maps::MAGLEV, maglev_elements(cfg.maglev_table_size))
            .map_max_entries(maps::NAT_USED, huddle_common::nat_used_lines(nat_used));
        let mut adopted = false;
        let mut fresh_cursors = true;
        if let Some(dir) = pins {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the pin folder {}", dir.display()))?;
            check_pinned_layouts(dir, half_open, maglev_elements(cfg.maglev_table_size))?;
            adopted = dir.join(maps::FLOWS).exists();
            fresh_cursors = !dir.join(maps::NAT_CURSOR).exists();
            for name in maps::ALL {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let mut ebpf = loader
            .load(object::HUDDLE)
            .context("loading the XDP object into the kernel")?;
        load_program(&mut ebpf, PROGRAM_NAME)?;
        // The IPv6 program, which the main one tail-calls for IPv6 frames.
        load_program(&mut ebpf, PROGRAM6_NAME)?;
        {
            let fd = ebpf
                .program(PROGRAM6_NAME)
                .context("IPv6 program missing")?
                .fd()?
                .try_clone()?;
            let mut tails: aya::maps::ProgramArray<&mut MapData> = ebpf
                .map_mut(maps::TAILS)
                .context("TAILS missing")?
                .try_into()?;
            tails.set(0, &fd, 0).context("setting the IPv6 program")?;
        }
        // After the program holds its maps: the logger owns the log map's fd.
        match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(logger) => crate::kernel::logs::forward(logger),
            Err(e) => warn!("kernel log forwarding unavailable: {e}"),
        }
        if adopted {
            if let Some(flows) = ebpf.map(maps::FLOWS) {
                let size = match flows {
                    aya::maps::Map::LruHashMap(m) => m.info().ok().map(|i| i.max_entries()),
                    _ => None,
                };
                if size.is_some_and(|n| n != cfg.flow_table_size) {
                    warn!(
                        "the adopted flow table holds {} entries, not flow_table_size {}: resizing needs `huddle stop` (which drops every flow) and a fresh start",
                        size.unwrap_or(0),
                        cfg.flow_table_size
                    );
                }
            }
        }

        if adopted && nat_used != 0 {
            // The running data plane's NAT entries are not in this fresh
            // filter: every tuple counts as maybe in use until a walk has
            // asked the NAT table about it.
            fill(&ebpf, maps::NAT_USED, [1u8; huddle_common::NAT_USED_LINE])?;
        }
        let mut config: Array<MapData, KernelConfig> = take(&mut ebpf, maps::CONFIG)?;
        let mut snat_addrs = [[0u8; 16]; MAX_SNAT];
        let wide = snat
            .iter()
            .map(|ip| addr_v4(ip.octets()))
            .chain(snat6.iter().map(|ip| ip.octets()));
        for (slot, a) in snat_addrs.iter_mut().zip(wide) {
            *slot = a;
        }
        // An adopted data plane keeps its next-hop generation moving on,
        // and its hash seed (half-open slots in use stay findable).
        let old = config.get(&0, 0).ok().filter(|c| c.hash_seed != 0);
        let hop_generation = old.map_or(0, |c| c.hop_generation) + 1;
        let hash_seed = match old {
            Some(c) => c.hash_seed,
            None => random_seed()?,
        };
        let kernel_config = KernelConfig {
            snat_addrs,
            snat_count: snat.len() as u16,
            family: FAMILY_V4,
            // The live half of an adopted index stays live until
            // `publish_services` has written the other.
            service_half: old.map_or(0, |c| c.service_half),
            nat_port_min: cfg.nat_ports.min,
            nat_port_max: cfg.nat_ports.max,
            slice_ports,
            slices,
            snat6_count: snat6.len() as u16,
            _pad2: 0,
            hop_generation,
            half_open_mask: half_open - 1,
            encap_vary: 0,
            hash_seed,
            syn_timeout_ns: cfg.huddle.syn_timeout.as_nanos() as u64,
            encap_src: [0; 16],
            encap6_src: [0; 16],
            nat_used_per_backend: nat_used,
            _pad3: 0,
            service_mul: old.map_or([0; 2], |c| c.service_mul),
        };
        config.set(0, kernel_config, 0).context("writing CONFIG")?;

        // Before the maps are taken: handles of its own for the sweep.
        let sweeper = Sweeper {
            flows: HashMap::try_from(reopen(&ebpf, maps::FLOWS)?)?,
            nat: HashMap::try_from(reopen(&ebpf, maps::NAT)?)?,
            backends: Array::try_from(reopen(&ebpf, maps::BACKENDS)?)?,
            swept: Array::try_from(reopen(&ebpf, maps::SWEPT)?)?,
            snat_addrs,
        };
        let maglev = match ebpf.take_map(maps::MAGLEV) {
            Some(aya::maps::Map::Array(data)) => {
                MappedArray::new(data, maglev_elements(cfg.maglev_table_size) as usize * 4)?
            }
            _ => bail!("map {} missing from the XDP object", maps::MAGLEV),
        };
        let mut dp = Dataplane {
            maglev,
            maglev_size: cfg.maglev_table_size,
            services_map: take(&mut ebpf, maps::SERVICES)?,
            services_map6: take(&mut ebpf, maps::SERVICES6)?,
            service_index: take(&mut ebpf, maps::SERVICE_INDEX)?,
            backends_map: take(&mut ebpf, maps::BACKENDS)?,
            rings: take(&mut ebpf, maps::RINGS)?,
            ring_gen: take(&mut ebpf, maps::RING_GEN)?,
            backend_stats: take(&mut ebpf, maps::BACKEND_STATS)?,
            service_stats: take(&mut ebpf, maps::SERVICE_STATS)?,
            global_stats: take(&mut ebpf, maps::GLOBAL_STATS)?,
            latency: take(&mut ebpf, maps::LATENCY)?,
            connect: take(&mut ebpf, maps::CONNECT)?,
            nat_cursor: take(&mut ebpf, maps::NAT_CURSOR)?,
            fresh_cursors,
            resume,
            cpus,
            pulse: take(&mut ebpf, maps::PULSE)?,
            tuning: take(&mut ebpf, maps::TUNING)?,
            sweeper: Some(sweeper),
            swept: take(&mut ebpf, maps::SWEPT)?,
            tw_hints: take(&mut ebpf, maps::TW_HINTS)?,
            tw_hints_until: take(&mut ebpf, maps::TW_HINTS_UNTIL)?,
            ebpf,
            link: None,
            pinned_link: None,
            pins: pins.map(Path::to_path_buf),
            adopted,
            mode: None,
            mode_note: None,
            snat: snat.to_vec(),
            snat6: snat6.to_vec(),
            nat_ports: cfg.nat_ports,
            config,
            kernel_config,
            services: Vec::new(),
        };
        dp.program_snat()?;
        dp.reconcile(cfg)?;
        if dp.fresh_cursors {
            let hints = dp
                .resume
                .as_ref()
                .map(|w| w.hints.clone())
                .unwrap_or_default();
            let n = dp.load_tw_hints(&hints, crate::sys::host::monotonic_ns())?;
            if n > 0 {
                info!("{n} NAT tuples the backends may still hold in TIME_WAIT, from the last run, are checked against new SYNs for a minute");
            }
        }
        dp.fresh_cursors = false;
        Ok(dp)
    }

    /// Sets backend `id`'s NAT cursor on every CPU to where a walk of one
    /// round per TIME_WAIT would stand now, as if it had always walked at
    /// that pace. A balancer started afresh (after `huddle stop`, or a
    /// backend given a new slot) then does not hand out the tuples a
    /// previous run used moments ago, which the backends still hold in
    /// TIME_WAIT, as long as that run stayed within the capacity.
    fn start_cursor(&mut self, id: u32, addr: SocketAddr) -> Result<()> {
        let cursor = cursor_at(
            crate::sys::host::monotonic_ns(),
            u64::from(self.kernel_config.slice_ports),
            u64::from(self.kernel_config.snat_count),
        );
        let mut per_cpu = vec![cursor; self.cpus];
        // An earlier run's walk, if it walked the same slices: carry on.
        if let Some(saved) = self.resume.as_ref().filter(|w| {
            w.slice_ports == u32::from(self.kernel_config.slice_ports)
                && w.snat_count == u32::from(self.kernel_config.snat_count)
                && w.cpus == self.cpus
        }) {
            if let Some(pos) = saved.backends.get(&addr.to_string()) {
                for (c, (port, a)) in per_cpu.iter_mut().zip(pos) {
                    c.port = *port;
                    c.addr = *a;
                }
            }
        }
        self.nat_cursor
            .set(id, aya::maps::PerCpuValues::try_from(per_cpu)?, 0)
            .with_context(|| format!("setting the NAT cursor of backend id {id}"))
    }

    /// Writes the last run's TIME_WAIT tuples (those still under a minute
    /// old at `now_ns`) for the kernel to check new SYNs against; returns
    /// how many.
    fn load_tw_hints(&mut self, hints: &[walk::TimeWaitHint], now_ns: u64) -> Result<usize> {
        let mut until = 0;
        let mut n = 0;
        for h in hints.iter().take(huddle_common::MAX_TW_HINTS as usize) {
            let walk::TimeWaitHint(local, port, backend, proto, tsval, closed_ns) = *h;
            if now_ns.saturating_sub(closed_ns) >= huddle_common::TIME_WAIT_NS || tsval == 0 {
                continue;
            }
            let family = if backend.is_ipv4() {
                huddle_common::FAMILY_V4
            } else {
                huddle_common::FAMILY_V6
            };
            let key = NatKey::new(
                ip_bytes(local),
                ip_bytes(backend.ip()),
                backend.port().to_be(),
                port.to_be(),
                proto,
                family,
            );
            let v = huddle_common::TwHint {
                tsval,
                _pad: 0,
                closed_ns,
            };
            if self.tw_hints.insert(key, v, 0).is_ok() {
                n += 1;
                until = until.max(closed_ns + huddle_common::TIME_WAIT_NS);
            }
        }
        if n > 0 {
            self.tw_hints_until.set(0, until, 0)?;
        }
        Ok(n)
    }

    /// Empties both half-open tables, as a fresh data plane has them (for
    /// `huddle bench`, whose new flows then time tables with room however
    /// many it sends). Handshakes under way are lost.
    pub fn clear_half_open(&self) -> Result<()> {
        // SAFETY: `Pod`s of integers and byte arrays: all zeroes is a valid
        // value (an empty slot).
        let (slot, nat, tags) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed(), std::mem::zeroed()) };
        fill::<huddle_common::HalfOpen>(&self.ebpf, maps::HALF_OPEN, slot)?;
        fill::<huddle_common::HalfOpenNat>(&self.ebpf, maps::HALF_OPEN_NAT, nat)?;
        fill::<huddle_common::HalfOpenTags>(&self.ebpf, maps::HALF_OPEN_TAGS, tags)?;
        fill::<huddle_common::HalfOpenTags>(&self.ebpf, maps::HALF_OPEN_NAT_TAGS, tags)
    }

    /// The tuples the backends may hold in TIME_WAIT at `now_ns`: closed
    /// source-NAT flows whose backend sent the first FIN, with the
    /// client's last timestamp, and the hints still loaded from the run
    /// before. Scans the flow table (for the exit, not every tick).
    pub fn tw_hints(&self, now_ns: u64) -> Vec<walk::TimeWaitHint> {
        use huddle_common::{flow_flags, TIME_WAIT_NS};
        type Tuple = (IpAddr, u16, SocketAddr, u8);
        let fresh = |closed: u64| now_ns.saturating_sub(closed) < TIME_WAIT_NS;
        // Per tuple, its latest close: a hint loaded from the run before
        // is stale once a flow of this run used the tuple.
        let mut latest: StdHashMap<Tuple, (u32, u64)> = StdHashMap::new();
        let mut keep = |t: Tuple, ts: u32, at: u64| {
            let e = latest.entry(t).or_insert((ts, at));
            if at > e.1 {
                *e = (ts, at);
            }
        };
        if let Ok(flows) = reopen(&self.ebpf, maps::FLOWS)
            .and_then(|m| Ok(HashMap::<MapData, FlowKey, FlowValue>::try_from(m)?))
        {
            for (_, v) in flows.iter().flatten() {
                let tw = flow_flags::BACKEND_TIME_WAIT | flow_flags::CLOSING;
                if v.flags & tw != tw || v.synack_seq == 0 || !fresh(v.stamp_ns) {
                    continue;
                }
                let Ok(b) = self.backends_map.get(&v.backend, 0) else {
                    continue;
                };
                let local = self.kernel_config.snat_addrs[usize::from(v.snat) % MAX_SNAT];
                let t = (
                    ip_of(&local, b.family),
                    u16::from_be(v.nat_port_be),
                    backend_addr(&b),
                    huddle_common::PROTO_TCP,
                );
                keep(t, v.synack_seq, v.stamp_ns);
            }
        }
        for (k, h) in self.tw_hints.iter().flatten() {
            if fresh(h.closed_ns) {
                let backend =
                    SocketAddr::new(ip_of(&k.backend, k.family), u16::from_be(k.backend_port_be));
                let t = (
                    ip_of(&k.local, k.family),
                    u16::from_be(k.nat_port_be),
                    backend,
                    k.proto,
                );
                keep(t, h.tsval, h.closed_ns);
            }
        }
        let mut out: Vec<walk::TimeWaitHint> = latest
            .into_iter()
            .map(|((local, port, backend, proto), (ts, at))| {
                walk::TimeWaitHint(local, port, backend, proto, ts, at)
            })
            .collect();
        // The newest first, if there are more than the map holds.
        out.sort_by_key(|h| std::cmp::Reverse(h.5));
        out.truncate(huddle_common::MAX_TW_HINTS as usize);
        out
    }

    /// Where each backend's NAT walk stands now, per CPU (for the next
    /// run: `start_cursor`).
    pub fn nat_walk(&self) -> walk::NatWalk {
        let mut w = walk::NatWalk {
            slice_ports: u32::from(self.kernel_config.slice_ports),
            snat_count: u32::from(self.kernel_config.snat_count),
            cpus: self.cpus,
            backends: std::collections::BTreeMap::new(),
            hints: Vec::new(),
        };
        for slot in &self.services {
            for (id, addr) in slot.backend_ids.iter().zip(&slot.service.backends) {
                if let Ok(v) = self.nat_cursor.get(id, 0) {
                    w.backends.insert(
                        addr.to_string(),
                        v.iter().map(|c| (c.port, c.addr)).collect(),
                    );
                }
            }
        }
        w
    }

    /// Makes `SERVICES` name exactly this run's SNAT addresses, so replies
    /// to them are translated (and an adopted map forgets old ones).
    fn program_snat(&mut self) -> Result<()> {
        let want: Vec<SvcKey> = self
            .snat
            .iter()
            .map(|ip| snat_key(IpAddr::V4(*ip)))
            .chain(self.snat6.iter().map(|ip| snat_key(IpAddr::V6(*ip))))
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
                flags: 0,
            };
            self.svc_insert(k, v).context("writing a SNAT address")?;
        }
        Ok(())
    }

    /// The keys of `kind` in both service maps.
    fn svc_keys(&self, kind: u8) -> Vec<SvcKey> {
        let v4 = self
            .services_map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.kind == kind)
            .map(SvcKey::V4);
        let v6 = self
            .services_map6
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.kind == kind)
            .map(SvcKey::V6);
        v4.chain(v6).collect()
    }

    fn svc_get(&self, k: &SvcKey) -> Option<ServiceValue> {
        match k {
            SvcKey::V4(k) => self.services_map.get(k, 0).ok(),
            SvcKey::V6(k) => self.services_map6.get(k, 0).ok(),
        }
    }

    fn svc_insert(&mut self, k: &SvcKey, v: ServiceValue) -> Result<()> {
        match k {
            SvcKey::V4(k) => self.services_map.insert(k, v, 0)?,
            SvcKey::V6(k) => self.services_map6.insert(k, v, 0)?,
        }
        Ok(())
    }

    fn svc_remove(&mut self, k: &SvcKey) -> Result<()> {
        match k {
            SvcKey::V4(k) => self.services_map.remove(k)?,
            SvcKey::V6(k) => self.services_map6.remove(k)?,
        }
        Ok(())
    }

    /// Writes the kernel settings as they now stand in `kernel_config`.
    fn write_config(&mut self) -> Result<()> {
        self.config
            .set(0, self.kernel_config, 0)
            .context("writing CONFIG")
    }

    /// The outer source of IPv6-in-IPv6 packets (an address of this host).
    pub fn set_encap6(&mut self, src: std::net::Ipv6Addr) -> Result<()> {
        self.kernel_config.encap6_src = src.octets();
        self.write_config()
    }

    /// Moves the next-hop generation on: every CPU asks the FIB again for
    /// each backend's next hop on its next packet (a changed neighbour is
    /// picked up within one call of this).
    pub fn refresh_next_hops(&mut self) -> Result<()> {
        self.kernel_config.hop_generation = self.kernel_config.hop_generation.wrapping_add(1);
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
        let syn_timeout_ns = cfg.huddle.syn_timeout.as_nanos() as u64;
        // An IPv6-only balancer may have no IPv4 address at all (then no
        // IPv4 dsr-ipip service either: the daemon refuses one).
        let own = self.snat.first().copied().unwrap_or(Ipv4Addr::UNSPECIFIED);
        let (encap_src, encap_vary) = encap_source(cfg.encap_prefix, own);
        if self.kernel_config.syn_timeout_ns != syn_timeout_ns
            || self.kernel_config.encap_src != encap_src
            || self.kernel_config.encap_vary != encap_vary
        {
            self.kernel_config.syn_timeout_ns = syn_timeout_ns;
            self.kernel_config.encap_src = encap_src;
            self.kernel_config.encap_vary = encap_vary;
            self.write_config()?;
        }
        self.services.clear();
        let old_services: StdHashMap<SvcKey, u32> = self
            .svc_keys(SERVICE_KIND_VIP)
            .into_iter()
            .filter_map(|k| self.svc_get(&k).map(|v| (k, v.id)))
            .collect();
        let mut used_sids: HashSet<u32> = HashSet::new();
        let mut want: Vec<(SvcKey, Option<u32>)> = cfg
            .services
            .iter()
            .map(|s| {
                let k = service_key(s.vip, s.proto);
                let id = old_services.get(&k).copied();
                if let Some(id) = id {
                    used_sids.insert(id);
                }
                (k, id)
            })
            .collect();
        for w in &mut want {
            if w.1.is_none() {
                let id = (0..MAX_SERVICES)
                    .find(|i| !used_sids.contains(i))
                    .context("no free service id")?;
                used_sids.insert(id);
                w.1 = Some(id);
            }
        }
        // Backend slots in use: (service id, address) -> backend id.
        let mut old_backends: StdHashMap<(u8, SocketAddr), u32> = StdHashMap::new();
        let mut free: Vec<u32> = Vec::new();
        let mut retired: Vec<u32> = Vec::new();
        for id in 0..MAX_BACKENDS {
            let b = self.backends_map.get(&id, 0)?;
            if b.family == 0 {
                free.push(id);
            } else {
                old_backends.insert((b.service, backend_addr(&b)), id);
            }
        }
        let mut kept: HashSet<u32> = HashSet::new();
        for ((key, sid), service) in want.iter().zip(&cfg.services) {
            let sid = sid.context("service id")?;
            let mut ids = Vec::new();
            for addr in &service.backends {
                let known = old_backends.get(&(sid as u8, *addr)).copied();
                let id = match known {
                    Some(id) => id,
                    // Never-used slots first: a retired slot may still be
                    // named by flows draining to its old backend.
                    None => match free.pop() {
                        Some(id) => id,
                        None => {
                            if retired.is_empty() {
                                retired = old_backends
                                    .values()
                                    .copied()
                                    .filter(|id| !kept.contains(id))
                                    .collect();
                                retired.sort_unstable();
                            }
                            retired.pop().context("no free backend slot")?
                        }
                    },
                };
                // A backend new to this slot walks its NAT tuples from where
                // the clock says, not from where a slot's last run stopped.
                if known.is_none() || self.fresh_cursors {
                    self.start_cursor(id, *addr)?;
                }
                kept.insert(id);
                let mut v = backend_value(*addr);
                v.service = sid as u8;
                self.backends_map
                    .set(id, v, 0)
                    .with_context(|| format!("writing backend {addr}"))?;
                ids.push(id);
            }
            let generation = self.ring_gen.get(&sid, 0)?;
            let kept_service = old_services.contains_key(key);
            let actual: Vec<u32> = if kept_service {
                let r = self.rings.get(&ring_slot(sid, generation), 0)?;
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
            });
            // A Maglev table is written afresh every time: the selection or
            // a weight may have changed, or the map been made anew.
            if first != actual || service.selection == Selection::Maglev {
                self.swap_ring(self.services.len() - 1, &first)?;
            }
            // The selection is in the pass-over limits, which keep theirs.
            let limits = self.tuning.get(&sid, 0).unwrap_or_default();
            self.set_tuning(sid, limits)?;
            let value = ServiceValue {
                id: sid,
                flags: service.mode.number(),
            };
            self.svc_insert(key, value)
                .with_context(|| format!("writing service {}", service.name()))?;
        }
        for (k, id) in old_services {
            if !want.iter().any(|(w, _)| *w == k) {
                self.svc_remove(&k)
                    .with_context(|| format!("removing service id {id}"))?;
                info!("service id {id} is no longer configured: removed");
            }
        }
        if self.adopted || reloading {
            let gone = old_backends
                .values()
                .filter(|id| !kept.contains(id))
                .count();
            if gone > 0 {
                info!(
                    "{gone} backend(s) no longer configured: out of every ring, their flows drain"
                );
            }
        }
        self.publish_services()
    }

    /// Writes `SERVICES`' IPv4 entries into the half of `SERVICE_INDEX`
    /// that is not live, with that half's multiplier, then makes it live.
    /// A packet that read the old half number finds the old half intact.
    fn publish_services(&mut self) -> Result<()> {
        let entries: Vec<(ServiceKey, ServiceValue)> =
            self.services_map.iter().filter_map(Result::ok).collect();
        let Some(placed) = service_index::place(&entries) else {
            warn!(
                "no layout of the service index gives each of the {} IPv4 services and SNAT addresses a slot of its own: every packet looks its service up in the hash table (about 6 ns more)",
                entries.len()
            );
            self.kernel_config.service_half = 0;
            return self.write_config();
        };
        let half = if self.kernel_config.service_half == 1 {
            2
        } else {
            1
        };
        self.kernel_config.service_mul[usize::from(half == 2)] = placed.mul;
        self.write_config()?;
        let base = u32::from(half - 1) * SERVICE_INDEX_SLOTS;
        for (i, e) in placed.slots.iter().enumerate() {
            self.service_index
                .set(base + i as u32, *e, 0)
                .context("writing SERVICE_INDEX")?;
        }
        self.kernel_config.service_half = half;
        self.write_config()
    }

    /// Attaches to `ifindex` in the requested mode. With pins, an adopted
    /// link gets the new program atomically (traffic never stops), and a
    /// new link is pinned so the program outlives the daemon.
    pub fn attach(&mut self, ifindex: u32, mode: XdpMode) -> Result<AttachedMode> {
        let link_pin = self.pins.as_ref().map(|d| d.join(LINK_PIN));
        if let Some(pin) = link_pin.as_ref().filter(|p| p.exists()) {
            match self.adopt_link(pin) {
                Ok(()) => {
                    self.mode = Some(AttachedMode::Adopted);
                    return Ok(AttachedMode::Adopted);
                }
                Err(e) => {
                    warn!(
                        "the pinned XDP link {} cannot be taken over ({e:#}); attaching afresh",
                        pin.display()
                    );
                    let _ = std::fs::remove_file(pin);
                }
            }
        }
        let auto_reason = (mode == XdpMode::Auto)
            .then(|| auto_generic_reason(ifindex))
            .flatten();
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(PROGRAM_NAME)
            .context("program missing")?
            .try_into()?;
        let (link, mode) = match mode {
            XdpMode::Generic => (
                prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Skb)
                    .context("attaching in generic mode")?,
                AttachedMode::Generic,
            ),
            XdpMode::Native => (
                prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Driver)
                    .context("attaching in native mode (try --xdp-mode generic)")?,
                AttachedMode::Native,
            ),
            XdpMode::Auto => match &auto_reason {
                Some(why) => {
                    info!("{why}");
                    (
                        prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Skb)
                            .context("attaching in generic mode")?,
                        AttachedMode::Generic,
                    )
                }
                None => {
                    match prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Driver) {
                        Ok(link) => (link, AttachedMode::Native),
                        Err(e) => {
                            warn!("native XDP refused ({e}); falling back to generic mode, which is slower");
                            (
                                prog.attach_to_if_index(ifindex, aya::programs::xdp::XdpMode::Skb)
                                    .context("attaching in generic mode")?,
                                AttachedMode::Generic,
                            )
                        }
                    }
                }
            },
        };
        if let Some(pin) = link_pin {
            let owned = prog.take_link(link).context("taking the XDP link")?;
            match FdLink::try_from(owned) {
                Ok(fd) => {
                    self.pinned_link = Some(
                        fd.pin(&pin)
                            .with_context(|| format!("pinning the XDP link at {}", pin.display()))?,
                    );
                }
                Err(e) => bail!("the kernel gave a netlink XDP attachment, which cannot be pinned ({e}); run with pins off"),
            }
        } else {
            self.link = Some(link);
        }
        self.mode = Some(mode);
        self.mode_note = auto_reason;
        Ok(mode)
    }

    /// Detaches an unpinned attachment (pinned ones go with `unpin`).
    pub fn detach(&mut self) -> Result<()> {
        if let Some(link) = self.link.take() {
            let prog: &mut Xdp = self
                .ebpf
                .program_mut(PROGRAM_NAME)
                .context("program missing")?
                .try_into()?;
            prog.detach(link).context("detaching the XDP program")?;
        }
        self.mode = None;
        Ok(())
    }

    /// Puts this program into the pinned link at `pin`, replacing the old
    /// program in one step.
    fn adopt_link(&mut self, pin: &Path) -> Result<()> {
        let fd: FdLink = PinnedLink::from_pin(pin)?.into();
        let link = XdpLink::try_from(fd).context("the pinned link is not an XDP link")?;
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(PROGRAM_NAME)
            .context("program missing")?
            .try_into()?;
        self.link = Some(
            prog.attach_to_link(link)
                .context("replacing the program in the pinned link")?,
        );
        Ok(())
    }

    /// Replaces service `index`'s live ring with `backends` (backend ids)
    /// atomically: the idle slot is written whole, then the generation
    /// flips. Packets see the old ring or the new one, never a mix.
    pub fn swap_ring(&mut self, index: usize, backends: &[u32]) -> Result<()> {
        if backends.len() > RING_CAPACITY {
            bail!(
                "ring of {} backends exceeds {RING_CAPACITY}",
                backends.len()
            );
        }
        let slot = &self.services[index];
        if let Some(last) = slot.last_swap {
            let since = last.elapsed();
            if since < SLOT_REUSE_GUARD {
                std::thread::sleep(SLOT_REUSE_GUARD - since);
            }
        }
        let mut ring = Ring::EMPTY;
        ring.len = backends.len() as u32;
        ring.backends[..backends.len()].copy_from_slice(backends);
        for id in backends {
            let w = (*id / 64) as usize;
            if w >= huddle_common::MEMBER_WORDS {
                bail!("backend id {id} out of range");
            }
            ring.members[w] |= 1 << (id % 64);
        }
        let next = slot.generation + 1;
        if slot.service.selection == Selection::Maglev {
            let table: Vec<u16> = maglev::table(&members(slot, backends), self.maglev_size)
                .into_iter()
                .map(|id| u16::try_from(id).unwrap_or(MAGLEV_EMPTY))
                .collect();
            let at = ring_slot(slot.id, next) as usize * self.maglev_size as usize;
            self.maglev
                .write(at, &table)
                .context("writing the idle Maglev table")?;
        }
        self.rings
            .set(ring_slot(slot.id, next), ring, 0)
            .context("writing the idle ring slot")?;
        self.ring_gen
            .set(slot.id, next, 0)
            .context("publishing the ring generation")?;
        let slot = &mut self.services[index];
        slot.generation = next;
        slot.ring = backends.to_vec();
        slot.last_swap = Some(Instant::now());
        Ok(())
    }

    /// Service `index`'s live Maglev table (empty for round robin).
    pub fn maglev_table(&self, index: usize) -> Result<Vec<u32>> {
        let slot = &self.services[index];
        if slot.service.selection != Selection::Maglev {
            return Ok(Vec::new());
        }
        let at = ring_slot(slot.id, slot.generation) as usize * self.maglev_size as usize;
        Ok(self
            .maglev
            .read(at, self.maglev_size as usize)?
            .into_iter()
            .map(|id| {
                if id == MAGLEV_EMPTY {
                    maglev::EMPTY
                } else {
                    u32::from(id)
                }
            })
            .collect())
    }

    /// Sum over CPUs of one backend's counters; `flows_closed` includes
    /// the idle UDP flows `sweep_idle_udp` removed.
    pub fn backend_stats(&self, id: u32) -> Result<BackendStats> {
        let mut st: BackendStats = sum(&self.backend_stats.get(&id, 0)?);
        st.flows_closed += self.swept.get(&id, 0).unwrap_or(0);
        Ok(st)
    }

    /// A handle of its own on the flow table, for sharing flows with the
    /// other balancers of a cluster (see `cluster::handoff`).
    pub fn flow_map(&self) -> Result<HashMap<MapData, FlowKey, FlowValue>> {
        Ok(HashMap::try_from(reopen(&self.ebpf, maps::FLOWS)?)?)
    }

    /// The live Maglev tables of the DSR services, for `cluster::handoff` (a
    /// takeover needs the client's own address at the backend).
    pub fn maglev_tables(&self) -> Vec<MaglevTable> {
        (0..self.services.len())
            .filter_map(|i| {
                let slot = &self.services[i];
                if slot.service.mode == crate::config::Mode::Snat {
                    return None;
                }
                let entries = self.maglev_table(i).ok().filter(|t| !t.is_empty())?;
                Some(MaglevTable {
                    service: slot.id,
                    vip: slot.service.vip,
                    proto: slot.service.proto.number(),
                    entries,
                    backends: slot
                        .backend_ids
                        .iter()
                        .copied()
                        .zip(slot.service.backends.iter().copied())
                        .collect(),
                })
            })
            .collect()
    }

    /// The idle sweep's own handles on the maps, for a thread of its own
    /// (a sweep of a large flow table must not hold up the huddle's tick).
    /// Given once.
    pub fn take_sweeper(&mut self) -> Option<Sweeper> {
        self.sweeper.take()
    }

    /// Sum over CPUs of one service's counters; its packets and bytes are
    /// its backends' (the program counts them only per backend).
    pub fn service_stats(&self, id: u32) -> Result<ServiceStats> {
        let backends = self
            .services
            .iter()
            .find(|s| s.id == id)
            .map_or(&[][..], |s| &s.backend_ids[..])
            .iter()
            .map(|b| self.backend_stats(*b))
            .collect::<Result<Vec<_>>>()?;
        self.service_stats_from(id, &backends)
    }

    /// As `service_stats`, from its backends' counters already read.
    pub fn service_stats_from(&self, id: u32, backends: &[BackendStats]) -> Result<ServiceStats> {
        let mut st: ServiceStats = sum(&self.service_stats.get(&id, 0)?);
        for b in backends {
            st.pkts += b.pkts_to;
            st.bytes += b.bytes_to;
        }
        Ok(st)
    }

    pub fn global_stats(&self) -> Result<GlobalStats> {
        Ok(sum(&self.global_stats.get(&0, 0)?))
    }

    /// Sum over CPUs of one backend's time-to-first-byte histogram.
    pub fn latency(&self, id: u32) -> Result<Latency> {
        histogram(&self.latency, id)
    }

    /// Sum over CPUs of one backend's connect-time histogram.
    pub fn connect_latency(&self, id: u32) -> Result<Latency> {
        histogram(&self.connect, id)
    }

    /// Since when backend `id` owes an answer (kernel monotonic ns, 0: none).
    pub fn pulse(&self, id: u32) -> Result<Pulse> {
        Ok(self.pulse.get(&id, 0)?)
    }

    /// Forgets what backend `id` owed: a probe showed it answers again.
    pub fn clear_pulse(&mut self, id: u32) -> Result<()> {
        Ok(self.pulse.set(id, Pulse::default(), 0)?)
    }

    /// Sets how long a backend of service `id` may owe an answer before
    /// new flows pass it over.
    /// Writes service `id`'s pass-over limits; its selection (Maglev or
    /// two choices of the ring) is the service's own.
    pub fn set_tuning(&mut self, id: u32, mut t: Tuning) -> Result<()> {
        if self
            .services
            .iter()
            .any(|s| s.id == id && s.service.selection == Selection::Maglev)
        {
            t.maglev_size = self.maglev_size;
            t.two_choices = 0;
        } else {
            t.maglev_size = 0;
        }
        Ok(self.tuning.set(id, t, 0)?)
    }

    /// Sets `huddle_common::backend_flags` on backend `id`. The address and
    /// port are rewritten with them: one element, replaced whole.
    pub fn set_backend_flags(&mut self, id: u32, addr: SocketAddr, flags: u32) -> Result<()> {
        let mut b = backend_value(addr);
        b.flags = flags;
        self.backends_map
            .set(id, b, 0)
            .with_context(|| format!("writing backend {addr}"))
    }

    /// The loaded program (for BPF_PROG_TEST_RUN).
    pub fn program(&self) -> Result<&Xdp> {
        Ok(self
            .ebpf
            .program(PROGRAM_NAME)
            .context("program missing")?
            .try_into()?)
    }

    /// The seed of the program's flow hashes (which slot a tuple takes):
    /// fixtures that need tuples sharing a slot compute them with it.
    #[must_use]
    pub fn hash_seed(&self) -> u64 {
        self.kernel_config.hash_seed
    }

    /// The program's kernel id, for bpftool.
    pub fn program_id(&self) -> Option<u32> {
        let prog: &Xdp = self.ebpf.program(PROGRAM_NAME)?.try_into().ok()?;
        prog.info().ok().map(|i| i.id())
    }
}

/// Maps a restart may make afresh when the build that pinned them laid
/// them out differently: settings, caches, counters and handshakes in
/// flight (their clients resend the SYN). Flows, NAT entries, services,
/// backends and rings must carry over, or a restart would misroute.
const RECREATABLE: [&str; 17] = [
    maps::MAGLEV,
    maps::CONFIG,
    maps::SERVICE_INDEX,
    maps::TAILS,
    maps::HALF_OPEN,
    maps::HALF_OPEN_NAT,
    maps::HALF_OPEN_TAGS,
    maps::HALF_OPEN_NAT_TAGS,
    maps::NEXT_HOP,
    maps::RR_CURSOR,
    maps::NAT_CURSOR,
    maps::BACKEND_STATS,
    maps::SERVICE_STATS,
    maps::GLOBAL_STATS,
    maps::LATENCY,
    maps::CONNECT,
    maps::TUNING,
];

/// Compares each map pinned in `dir` with this build's layout of it (and
/// the half-open tables with their configured size, `half_open` slots: the
/// program masks hashes with it). A recreatable one laid out otherwise is
/// unpinned (made afresh by the load); any other mismatch is refused with
/// what to do, rather than left to fail in the verifier.
fn check_pinned_layouts(dir: &Path, half_open: u32, maglev: u32) -> Result<()> {
    let obj = aya_obj::Object::parse(object::HUDDLE).context("parsing the embedded object")?;
    for name in maps::ALL {
        let pin = dir.join(name);
        if !pin.exists() {
            continue;
        }
        let Some(want) = obj.maps.get(name) else {
            continue;
        };
        let have = aya::maps::MapInfo::from_pin(&pin)
            .with_context(|| format!("reading the pinned map {}", pin.display()))?;
        let size = match name {
            maps::HALF_OPEN | maps::HALF_OPEN_NAT => Some(half_open),
            maps::HALF_OPEN_TAGS | maps::HALF_OPEN_NAT_TAGS => {
                Some(huddle_common::half_open_tag_lines(half_open))
            }
            maps::MAGLEV => Some(maglev),
            _ => None,
        };
        if have.key_size() == want.key_size()
            && have.value_size() == want.value_size()
            && size.is_none_or(|n| have.max_entries() == n)
        {
            continue;
        }
        if RECREATABLE.contains(&name) {
            info!("{name} has another layout or size in this run: made afresh");
            std::fs::remove_file(&pin).with_context(|| format!("removing {}", pin.display()))?;
            continue;
        }
        bail!(
            "the data plane pinned under {} was left by a build with another layout of {name} (key {} and value {} bytes, this build {} and {}): `huddle stop` removes it (its flows drop), then start again",
            dir.display(),
            have.key_size(),
            have.value_size(),
            want.key_size(),
            want.value_size()
        );
    }
    // CONFIG says which half of the index is live: a new CONFIG gets a new
    // index, or this run would rewrite the half a running program reads.
    let index = dir.join(maps::SERVICE_INDEX);
    if !dir.join(maps::CONFIG).exists() && index.exists() {
        std::fs::remove_file(&index).with_context(|| format!("removing {}", index.display()))?;
    }
    Ok(())
}

/// The NAT cursor of a walk over `ports` x `addrs` tuples that has taken
/// one tuple every TIME_WAIT / (ports x addrs) since the clock's zero.
fn cursor_at(now_ns: u64, ports: u64, addrs: u64) -> NatCursor {
    let space = (ports * addrs).max(1);
    let step = (huddle_common::TIME_WAIT_NS / space).max(1);
    let pos = (now_ns / step) % space;
    NatCursor {
        port: (pos % ports.max(1)) as u32,
        addr: (pos / ports.max(1)) as u32,
        // This run has handed out nothing yet: the round it is in counts
        // as a full TIME_WAIT old, so early reuse is counted from the
        // second round on (the first wrap is never early).
        round_ns: now_ns.saturating_sub(huddle_common::TIME_WAIT_NS).max(1),
        early: 0,
        _pad: 0,
    }
}

/// Loads program `name` of the object. The verifier gives up with EAGAIN
/// when a signal reaches the loading thread (a child's SIGCHLD, say)
/// during its second or so of work: that is not a refusal, so try again.
fn load_program(ebpf: &mut Ebpf, name: &str) -> Result<()> {
    let prog: &mut Xdp = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the XDP object"))?
        .try_into()?;
    let mut tries = 0;
    loop {
        match prog.load() {
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && tries < 5 =>
            {
                tries += 1;
            }
            r => {
                return r
                    .with_context(|| format!("the kernel verifier refused the XDP program {name}"))
            }
        }
    }
}

/// A secret, never-zero seed for the half-open tables' hash.
fn random_seed() -> Result<u64> {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .context("reading /dev/urandom for the hash seed")?;
    Ok(u64::from_ne_bytes(b) | 1)
}

/// Why `auto` mode must not attach natively to `ifindex`, if it must not:
/// a veth whose peer runs no XDP program drops every frame sent back with
/// XDP_TX (the kernel counts it and moves on), so native mode forwards
/// nothing there. Generic mode works on any veth.
fn auto_generic_reason(ifindex: u32) -> Option<String> {
    use crate::sys::link::Peer;
    let peer = match crate::sys::link::veth_peer(ifindex) {
        Ok(Peer::VethXdp) => {
            info!(
                "the interface is a veth whose peer runs an XDP program: native mode (senders must compute their own checksums, e.g. `ethtool -K IFACE tx off`, or rewritten frames arrive with bad checksums)"
            );
            return None;
        }
        Ok(Peer::NotVeth) => return None,
        Ok(Peer::VethNoXdp) => "runs no XDP program",
        Ok(Peer::VethUnknown) => "cannot be checked for an XDP program",
        Err(e) => {
            warn!("cannot tell what kind of link this is ({e:#}); trying native mode");
            return None;
        }
    };
    Some(format!(
        "xdp mode auto: generic, because the interface is a veth whose peer {peer}, and native XDP_TX on a veth is lost unless the peer runs one; for native mode attach an XDP program to the peer, have senders compute checksums (`ethtool -K IFACE tx off`), and pass --xdp-mode native"
    ))
}

/// Sum over CPUs of one backend's histogram in `map`.
fn histogram(map: &PerCpuArray<MapData, Latency>, id: u32) -> Result<Latency> {
    let mut total = Latency::default();
    for cpu in map.get(&id, 0)?.iter() {
        for (t, v) in total.buckets.iter_mut().zip(cpu.buckets.iter()) {
            *t = t.wrapping_add(*v);
        }
    }
    Ok(total)
}

/// Sum over CPUs of one per-CPU counter element.
fn sum<T: Counters + aya::Pod>(per_cpu: &PerCpuValues<T>) -> T {
    let mut total = T::default();
    for v in per_cpu.iter() {
        total.accumulate(v);
    }
    total
}

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
fn backend_addr(b: &Backend) -> SocketAddr {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encap_sources_vary_only_in_the_host_bits_of_the_prefix() {
        let own = Ipv4Addr::new(10, 0, 0, 1);
        assert_eq!(encap_source(None, own), (addr_v4([10, 0, 0, 1]), 0));
        let p: crate::config::Prefix = "172.16.4.0/22".parse().unwrap();
        let (src, vary) = encap_source(Some(p), own);
        assert_eq!(&src[..4], &[172, 16, 4, 0]);
        // As the bytes lie in memory: the last 10 bits of the address.
        assert_eq!(vary.to_ne_bytes(), [0, 0, 0x03, 0xff]);
    }

    #[test]
    fn keys_hold_network_order_ports() {
        let SvcKey::V4(k) = service_key("10.1.2.3:8080".parse().unwrap(), Proto::Tcp) else {
            panic!("an IPv4 VIP takes an IPv4 key");
        };
        assert_eq!(k.addr, [10, 1, 2, 3]);
        assert_eq!(k.kind, SERVICE_KIND_VIP);
        assert_eq!(k.port_be.to_ne_bytes(), 8080u16.to_be_bytes());
        assert_eq!(k.proto, 6);
        let SvcKey::V4(s) = snat_key(Ipv4Addr::new(10, 0, 0, 1).into()) else {
            panic!("an IPv4 SNAT address takes an IPv4 key");
        };
        assert_eq!(s.kind, SERVICE_KIND_SNAT);
        let SvcKey::V6(k6) = service_key("[fd00::5]:443".parse().unwrap(), Proto::Udp) else {
            panic!("an IPv6 VIP takes an IPv6 key");
        };
        assert_eq!(k6.addr[..2], [0xfd, 0]);
        assert_eq!(
            (k6.port_be.to_ne_bytes(), k6.proto),
            (443u16.to_be_bytes(), 17)
        );
        let b = backend_value("10.9.9.9:53".parse().unwrap());
        assert_eq!(b.port_be.to_ne_bytes(), 53u16.to_be_bytes());
        let b6 = backend_value("[fd00::9]:53".parse().unwrap());
        assert_eq!(b6.family, FAMILY_V6);
        assert_eq!(backend_addr(&b6), "[fd00::9]:53".parse().unwrap());
    }

    #[test]
    fn cursors_start_where_a_walk_of_one_round_per_time_wait_stands() {
        let tw = huddle_common::TIME_WAIT_NS;
        // 1,000 tuples: one every 60 ms. 30 s into a round: tuple 500.
        let c = cursor_at(10 * tw + tw / 2, 500, 2);
        assert_eq!((c.port, c.addr), (0, 1));
        assert_eq!(c.round_ns, 9 * tw + tw / 2);
        let c = cursor_at(tw / 4, 1000, 1);
        assert_eq!((c.port, c.addr), (250, 0));
        assert_eq!(c.round_ns, 1, "never 0: the program would restart it");
        // A later start is further on: a run that took fewer tuples than
        // that in between is behind it.
        let (a, b) = (
            cursor_at(tw, 6384, 1),
            cursor_at(tw + 20 * tw / 60, 6384, 1),
        );
        assert_eq!(b.port - a.port, 2128);
    }

    #[test]
    fn object_declares_every_map_and_the_program() {
        let obj = aya_obj::Object::parse(object::HUDDLE).expect("parse the embedded object");
        for name in maps::ALL {
            assert!(
                obj.maps.contains_key(name),
                "map {name} missing from the object"
            );
        }
        assert!(obj.maps.contains_key(maps::NAT_USED));
        assert!(obj.maps.contains_key(maps::CLIENT_HOP));
        assert!(obj.programs.contains_key(PROGRAM_NAME));
    }
}
