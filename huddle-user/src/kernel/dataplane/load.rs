//! Loading the data plane: a fresh object, or the pinned one taken over
//! (checking its maps' layouts), with every map sized and set.

use super::*;
use crate::{config::Config, kernel::mmap::MappedArray, kernel::object};
use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData},
    programs::Xdp,
    Ebpf, EbpfLoader,
};
use huddle_common::{
    addr_v4, config_flags, maps, KernelConfig, FAMILY_V4, MAX_SNAT, PROGRAM6_NAME,
    PROGRAM_CSUM_NAME, PROGRAM_NAME, TAIL_CSUM, TAIL_V6,
};
use limits::MapLimits;
use migrate::{Found, Migration};
use std::{net::Ipv4Addr, path::Path};
use tracing::{info, warn};

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
        let geo = NatGeometry::of(cfg, snat.len() + snat6.len())?;
        let (cpus, nat_used) = (geo.cpus, geo.nat_used);
        let half_open = cfg.half_open_table_size.next_power_of_two();
        // An older build's maps set aside first: sized afresh below.
        let mut migration = match pins {
            Some(dir) => prepare(dir)?,
            None => None,
        };
        let limits = MapLimits::of(cfg, pins)?;
        let mut loader = loader(cfg, &limits, half_open, nat_used);
        let (adopted, fresh_cursors) = match pins {
            Some(dir) => pin_to(&mut loader, dir, &limits, half_open, migration.is_some())?,
            None => (false, true),
        };
        let mut ebpf = loader
            .load(object::HUDDLE)
            .context("loading the XDP object into the kernel")?;
        load_programs(&mut ebpf)?;
        if adopted {
            warn_if_resized(&ebpf, cfg);
        }

        if adopted && nat_used != 0 {
            // The running data plane's NAT entries are not in this fresh
            // filter: every tuple counts as maybe in use until a walk has
            // asked the NAT table about it.
            fill(&ebpf, maps::NAT_USED, [1u8; huddle_common::NAT_USED_LINE])?;
        }
        // Before CONFIG records this layout: a copy cut short is made
        // again by the next start (`migrate::inspect`).
        if let Some(m) = &mut migration {
            m.copy()?;
        }
        let mut config: Array<MapData, KernelConfig> = take(&mut ebpf, maps::CONFIG)?;
        let prior = migration
            .as_ref()
            .and_then(|m| m.old_config)
            .or(config.get(&0, 0).ok());
        let (snat_addrs, mut kernel_config) =
            kernel_config(cfg, snat, snat6, &geo, half_open, prior)?;
        if migration.is_some() {
            kernel_config.flags |= config_flags::MIGRATING;
        }
        config.set(0, kernel_config, 0).context("writing CONFIG")?;
        let nat = NatState::take(&mut ebpf, snat_addrs, fresh_cursors, resume)?;
        let mut dp = Dataplane {
            maps: ServiceMaps::take(&mut ebpf, limits)?,
            stats: StatMaps::take(&mut ebpf)?,
            nat,
            cpus,
            ebpf,
            attach: Attachment {
                link: None,
                pinned_link: None,
                pins: pins.map(Path::to_path_buf),
                adopted,
                mode: None,
                mode_note: None,
                migration,
            },
            settings: Settings {
                snat: snat.to_vec(),
                snat6: snat6.to_vec(),
                nat_ports: cfg.nat_ports,
                config,
                kernel_config,
            },
            services: Vec::new(),
        };
        dp.program_snat()?;
        dp.reconcile(cfg)?;
        if dp.nat.fresh_cursors {
            let hints = dp
                .nat
                .resume
                .as_ref()
                .map(|w| w.hints.clone())
                .unwrap_or_default();
            let n = dp.load_tw_hints(&hints, crate::sys::host::monotonic_ns())?;
            if n > 0 {
                info!("{n} NAT tuples the backends may still hold in TIME_WAIT, from the last run, are checked against new SYNs for a minute");
            }
        }
        dp.nat.fresh_cursors = false;
        Ok(dp)
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
}

/// Maps a restart may make afresh when the build that pinned them laid
/// them out differently: settings, caches, counters and handshakes in
/// flight (their clients resend the SYN). Flows, NAT entries, services,
/// backends and rings must carry over, or a restart would misroute.
pub(super) const RECREATABLE: [&str; 19] = [
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
    maps::LATENCY_HEAVY,
    maps::HEAVY,
    maps::CONNECT,
    maps::TUNING,
];

/// Compares each map pinned in `dir` with this build's layout of it (and
/// the half-open tables with their configured size, `half_open` slots: the
/// program masks hashes with it). A recreatable one laid out otherwise is
/// unpinned (made afresh by the load); any other mismatch is refused with
/// what to do, rather than left to fail in the verifier.
pub(super) fn check_pinned_layouts(dir: &Path, half_open: u32, limits: &MapLimits) -> Result<()> {
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
            _ => limits.pinned_size(name),
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

/// Loads program `name` of the object. The verifier gives up with EAGAIN
/// when a signal reaches the loading thread (a child's SIGCHLD, say)
/// during its second or so of work: that is not a refusal, so try again.
pub(super) fn load_program(ebpf: &mut Ebpf, name: &str) -> Result<()> {
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
pub(super) fn random_seed() -> Result<u64> {
    let mut b = [0u8; 8];
    crate::sys::host::random_bytes(&mut b).context("the hash seed")?;
    Ok(u64::from_ne_bytes(b) | 1)
}

impl ServiceMaps {
    /// The service, backend and ring maps out of `ebpf`, the Maglev
    /// tables mapped as `limits` size them.
    fn take(ebpf: &mut Ebpf, limits: MapLimits) -> Result<Self> {
        let maglev = match ebpf.take_map(maps::MAGLEV) {
            Some(aya::maps::Map::Array(data)) => {
                MappedArray::new(data, limits.maglev_elements() as usize * 2)?
            }
            _ => bail!("map {} missing from the XDP object", maps::MAGLEV),
        };
        Ok(Self {
            services_map: take(ebpf, maps::SERVICES)?,
            services_map6: take(ebpf, maps::SERVICES6)?,
            service_index: take(ebpf, maps::SERVICE_INDEX)?,
            backends_map: take(ebpf, maps::BACKENDS)?,
            rings: take(ebpf, maps::RINGS)?,
            ring_gen: take(ebpf, maps::RING_GEN)?,
            tuning: take(ebpf, maps::TUNING)?,
            guarded: take(ebpf, maps::GUARDED)?,
            guard_filter: take(ebpf, maps::GUARD_FILTER)?,
            maglev,
            limits,
        })
    }
}

impl StatMaps {
    fn take(ebpf: &mut Ebpf) -> Result<Self> {
        Ok(Self {
            backend_stats: take(ebpf, maps::BACKEND_STATS)?,
            service_stats: take(ebpf, maps::SERVICE_STATS)?,
            global_stats: take(ebpf, maps::GLOBAL_STATS)?,
            latency: take(ebpf, maps::LATENCY)?,
            latency_heavy: take(ebpf, maps::LATENCY_HEAVY)?,
            connect: take(ebpf, maps::CONNECT)?,
            pulse: take(ebpf, maps::PULSE)?,
        })
    }
}

impl NatState {
    /// The NAT walk's maps out of `ebpf`, and before they are taken, the
    /// idle sweep's own handles on the maps it walks.
    fn take(
        ebpf: &mut Ebpf,
        snat_addrs: [huddle_common::Addr; MAX_SNAT],
        fresh_cursors: bool,
        resume: Option<walk::NatWalk>,
    ) -> Result<Self> {
        let sweeper = Sweeper {
            flows: [
                HashMap::try_from(reopen(ebpf, maps::UDP_FLOWS)?)?,
                HashMap::try_from(reopen(ebpf, maps::DSR_FLOWS)?)?,
            ],
            nat: HashMap::try_from(reopen(ebpf, maps::UDP_NAT)?)?,
            backends: Array::try_from(reopen(ebpf, maps::BACKENDS)?)?,
            swept: Array::try_from(reopen(ebpf, maps::SWEPT)?)?,
            snat_addrs,
        };
        Ok(Self {
            swept: take(ebpf, maps::SWEPT)?,
            tw_hints: take(ebpf, maps::TW_HINTS)?,
            tw_hints_until: take(ebpf, maps::TW_HINTS_UNTIL)?,
            sweeper: Some(sweeper),
            nat_cursor: take(ebpf, maps::NAT_CURSOR)?,
            fresh_cursors,
            resume,
        })
    }
}

/// How the NAT port range is cut per CPU, and what tracking its tuples
/// takes.
struct NatGeometry {
    cpus: usize,
    slice_ports: u16,
    slices: u16,
    /// `NAT_USED` bytes per backend (0: too many to track).
    nat_used: u32,
}

impl NatGeometry {
    fn of(cfg: &Config, snat_total: usize) -> Result<NatGeometry> {
        if snat_total > MAX_SNAT {
            bail!("at most {MAX_SNAT} SNAT addresses in all, not {snat_total}");
        }
        let cpus = crate::sys::host::possible_cpus()?;
        let (slice_ports, slices) = KernelConfig::slices_for(
            cfg.nat_ports.min,
            cfg.nat_ports.max,
            u16::try_from(cpus).unwrap_or(u16::MAX),
        );
        let snat_total = snat_total as u16;
        let nat_used = huddle_common::nat_used_per_backend(slice_ports, slices, snat_total);
        if nat_used == 0 {
            info!(
            "{} backends x {} NAT tuples would take more than {} MiB to track: each new flow asks the NAT table whether its tuple is in use (a cold lookup)",
            huddle_common::NAT_USED_BACKENDS,
            u64::from(slice_ports) * u64::from(slices) * u64::from(snat_total),
            huddle_common::MAX_NAT_USED_BYTES >> 20
        );
        }
        Ok(NatGeometry {
            cpus,
            slice_ports,
            slices,
            nat_used,
        })
    }
}

/// The object's loader with every map sized for `cfg`.
fn loader(cfg: &Config, limits: &MapLimits, half_open: u32, nat_used: u32) -> EbpfLoader<'static> {
    let tag_lines = huddle_common::half_open_tag_lines(half_open);
    let mut loader = EbpfLoader::new();
    // HUDDLE_VERIFIER_LOG=1: the verifier's whole log on a refusal
    // (for whoever changes the program).
    if std::env::var_os("HUDDLE_VERIFIER_LOG").is_some() {
        loader.verifier_log_level(aya::VerifierLogLevel::VERBOSE | aya::VerifierLogLevel::STATS);
    }
    loader
        .map_max_entries(maps::FLOWS, cfg.flow_table_size)
        .map_max_entries(maps::DSR_FLOWS, cfg.flow_table_size)
        .map_max_entries(maps::UDP_FLOWS, cfg.flow_table_size)
        .map_max_entries(maps::NAT, cfg.flow_table_size)
        .map_max_entries(maps::UDP_NAT, cfg.flow_table_size)
        .map_max_entries(maps::TW_REUSED, cfg.flow_table_size)
        .map_max_entries(maps::HALF_OPEN, half_open)
        .map_max_entries(maps::HALF_OPEN_NAT, half_open)
        .map_max_entries(maps::HALF_OPEN_TAGS, tag_lines)
        .map_max_entries(maps::HALF_OPEN_NAT_TAGS, tag_lines)
        .map_max_entries(maps::NAT_USED, huddle_common::nat_used_lines(nat_used));
    limits.size(&mut loader);
    loader
}

/// The pin folder `dir` made, and what is pinned there read: an older
/// layout's maps set aside for a migration (see `migrate`), a layout this
/// build does not know refused.
fn prepare(dir: &Path) -> Result<Option<Migration>> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the pin folder {}", dir.display()))?;
    Ok(match migrate::inspect(dir)? {
        Found::Older => Some(Migration::begin(dir)?),
        Found::Finishing => Some(Migration::finishing(dir)),
        Found::AsBefore => None,
    })
}

/// Pins every map under `dir` (adopting what is pinned there, once its
/// layouts are checked; all made afresh in a migration, which copies into
/// them); returns (adopted, fresh cursors).
fn pin_to(
    loader: &mut EbpfLoader,
    dir: &Path,
    limits: &MapLimits,
    half_open: u32,
    migrating: bool,
) -> Result<(bool, bool)> {
    if !migrating {
        check_pinned_layouts(dir, half_open, limits)?;
    }
    let adopted = migrating || dir.join(maps::FLOWS).exists();
    let fresh_cursors = !migrating && !dir.join(maps::NAT_CURSOR).exists();
    for name in maps::ALL {
        loader.map_pin_path(name, dir.join(name));
    }
    Ok((adopted, fresh_cursors))
}

/// Loads the programs, points the IPv4 one's tail calls at the IPv6 one
/// and at the checksum finisher (which the IPv6 one calls too), and
/// forwards the programs' log records.
fn load_programs(ebpf: &mut Ebpf) -> Result<()> {
    load_program(ebpf, PROGRAM_NAME)?;
    for (name, slot, what) in [
        (PROGRAM6_NAME, TAIL_V6, "the IPv6 program"),
        (PROGRAM_CSUM_NAME, TAIL_CSUM, "the checksum program"),
    ] {
        load_program(ebpf, name)?;
        let fd = ebpf
            .program(name)
            .with_context(|| format!("{what} missing"))?
            .fd()?
            .try_clone()?;
        let mut tails: aya::maps::ProgramArray<&mut MapData> = ebpf
            .map_mut(maps::TAILS)
            .context("TAILS missing")?
            .try_into()?;
        tails
            .set(slot, &fd, 0)
            .with_context(|| format!("setting {what}"))?;
    }
    // After the program holds its maps: the logger owns the log map's fd.
    match aya_log::EbpfLogger::init(ebpf) {
        Ok(logger) => crate::kernel::logs::forward(logger),
        Err(e) => warn!("kernel log forwarding unavailable: {e}"),
    }
    Ok(())
}

/// Says when an adopted flow table is not the configured size.
fn warn_if_resized(ebpf: &Ebpf, cfg: &Config) {
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

/// What every balancer of a cluster derives its Maglev flow seed from.
const MAGLEV_PURPOSE: &str = "huddle maglev flow hash v1";

/// The Maglev flow hash's seed: drawn from `maglev_key_file`, else from
/// the cluster's key (so the members agree and clients cannot compute
/// it); a balancer with neither keeps the one it ran with, or draws one.
fn maglev_seed(cfg: &Config, old: Option<KernelConfig>) -> Result<u64> {
    let key = cfg
        .maglev_key
        .as_ref()
        .or(cfg.cluster.as_ref().map(|c| &c.key));
    if let Some(k) = key {
        return Ok(k.derive(MAGLEV_PURPOSE));
    }
    match old.map(|c| c.maglev_seed).filter(|s| *s != 0) {
        Some(s) => Ok(s),
        None => random_seed(),
    }
}

/// `CONFIG` for this start; an adopted data plane (`old`) keeps its hash
/// seed and live index half, and moves its next-hop generation on.
fn kernel_config(
    cfg: &Config,
    snat: &[Ipv4Addr],
    snat6: &[std::net::Ipv6Addr],
    geo: &NatGeometry,
    half_open: u32,
    old: Option<KernelConfig>,
) -> Result<([[u8; 16]; MAX_SNAT], KernelConfig)> {
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
    let old = old.filter(|c| c.hash_seed != 0);
    let hop_generation = old.map_or(0, |c| c.hop_generation) + 1;
    let hash_seed = match old {
        Some(c) => c.hash_seed,
        None => random_seed()?,
    };
    let maglev_seed = maglev_seed(cfg, old)?;
    let kernel_config = KernelConfig {
        snat_addrs,
        snat_count: snat.len() as u16,
        family: FAMILY_V4,
        // The live half of an adopted index stays live until
        // `publish_services` has written the other.
        service_half: old.map_or(0, |c| c.service_half),
        nat_port_min: cfg.nat_ports.min,
        nat_port_max: cfg.nat_ports.max,
        slice_ports: geo.slice_ports,
        slices: geo.slices,
        snat6_count: snat6.len() as u16,
        // An adopted link keeps its mode until `attach` says it again.
        flags: old.map_or(0, |c| c.flags & config_flags::SKB_MODE),
        hop_generation,
        half_open_mask: half_open - 1,
        encap_vary: 0,
        hash_seed,
        syn_timeout_ns: cfg.huddle.syn_timeout.as_nanos() as u64,
        encap_src: [0; 16],
        encap6_src: [0; 16],
        nat_used_per_backend: geo.nat_used,
        layout: huddle_common::LAYOUT_VERSION,
        service_mul: old.map_or([0; 2], |c| c.service_mul),
        maglev_seed,
    };
    Ok((snat_addrs, kernel_config))
}
