//! The one interface between the control plane and the kernel: loading and
//! attaching the XDP program, writing services, backends and rings, and
//! reading counters.

use crate::{
    config::{Config, PortRange, Proto, Service, XdpMode},
    object,
};
use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray, PerCpuValues},
    programs::{xdp::XdpLinkId, Xdp},
    Ebpf, EbpfLoader,
};
use huddle_common::{
    addr_v4, maps, ring_slot, Backend, BackendStats, Config as KernelConfig, Counters, GlobalStats,
    Latency, Pulse, Ring, ServiceKey, ServiceStats, ServiceValue, FAMILY_V4, PROGRAM_NAME,
    RING_CAPACITY,
};
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};
use tracing::warn;

/// How long a retired ring slot is left alone before it is rewritten. A
/// packet reads a ring within microseconds; this is orders of magnitude
/// more, and the kernel side re-checks the generation anyway.
pub const SLOT_REUSE_GUARD: Duration = Duration::from_millis(2);

/// Mode the program ended up attached in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachedMode {
    Native,
    Generic,
}

impl AttachedMode {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            AttachedMode::Native => "native",
            AttachedMode::Generic => "generic",
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
}

/// The loaded program and its maps.
pub struct Dataplane {
    ebpf: Ebpf,
    link: Option<XdpLinkId>,
    pub mode: Option<AttachedMode>,
    pub snat: Ipv4Addr,
    pub nat_ports: PortRange,
    services_map: HashMap<MapData, ServiceKey, ServiceValue>,
    backends_map: Array<MapData, Backend>,
    rings: Array<MapData, Ring>,
    ring_gen: Array<MapData, u64>,
    backend_stats: PerCpuArray<MapData, BackendStats>,
    service_stats: PerCpuArray<MapData, ServiceStats>,
    global_stats: PerCpuArray<MapData, GlobalStats>,
    latency: PerCpuArray<MapData, Latency>,
    pulse: Array<MapData, Pulse>,
    pub services: Vec<ServiceSlot>,
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
    /// Loads the program and programs every map, without attaching: a
    /// failure here leaves nothing behind in the kernel.
    pub fn load(cfg: &Config, snat: Ipv4Addr) -> Result<Dataplane> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(maps::FLOWS, cfg.flow_table_size)
            .map_max_entries(maps::NAT, cfg.flow_table_size)
            .load(object::HUDDLE)
            .context("loading the XDP object into the kernel")?;
        let prog: &mut Xdp = ebpf
            .program_mut(PROGRAM_NAME)
            .context("program missing from the XDP object")?
            .try_into()?;
        prog.load()
            .context("the kernel verifier refused the XDP program")?;
        // After the program holds its maps: the logger owns the log map's fd.
        match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(logger) => crate::logs::forward(logger),
            Err(e) => warn!("kernel log forwarding unavailable: {e}"),
        }

        let mut config: Array<MapData, KernelConfig> = take(&mut ebpf, maps::CONFIG)?;
        config
            .set(
                0,
                KernelConfig {
                    snat_addr: addr_v4(snat.octets()),
                    family: FAMILY_V4,
                    _pad: 0,
                    nat_port_min: cfg.nat_ports.min,
                    nat_port_max: cfg.nat_ports.max,
                    _pad2: 0,
                    flags: 0,
                },
                0,
            )
            .context("writing CONFIG")?;

        let mut dp = Dataplane {
            services_map: take(&mut ebpf, maps::SERVICES)?,
            backends_map: take(&mut ebpf, maps::BACKENDS)?,
            rings: take(&mut ebpf, maps::RINGS)?,
            ring_gen: take(&mut ebpf, maps::RING_GEN)?,
            backend_stats: take(&mut ebpf, maps::BACKEND_STATS)?,
            service_stats: take(&mut ebpf, maps::SERVICE_STATS)?,
            global_stats: take(&mut ebpf, maps::GLOBAL_STATS)?,
            latency: take(&mut ebpf, maps::LATENCY)?,
            pulse: take(&mut ebpf, maps::PULSE)?,
            ebpf,
            link: None,
            mode: None,
            snat,
            nat_ports: cfg.nat_ports,
            services: Vec::new(),
        };
        let mut next_backend = 0u32;
        for (id, service) in cfg.services.iter().enumerate() {
            let id = id as u32;
            let mut backend_ids = Vec::new();
            for addr in &service.backends {
                dp.backends_map
                    .set(next_backend, backend_value(*addr), 0)
                    .with_context(|| format!("writing backend {addr}"))?;
                backend_ids.push(next_backend);
                next_backend += 1;
            }
            dp.services.push(ServiceSlot {
                id,
                service: service.clone(),
                ring: Vec::new(),
                backend_ids: backend_ids.clone(),
                generation: 0,
                last_swap: None,
            });
            dp.swap_ring(id as usize, &backend_ids)?;
            dp.services_map
                .insert(
                    service_key(service.vip, service.proto),
                    ServiceValue { id, flags: 0 },
                    0,
                )
                .with_context(|| format!("writing service {}", service.name()))?;
        }
        Ok(dp)
    }

    /// Attaches to `ifindex` in the requested mode.
    pub fn attach(&mut self, ifindex: u32, mode: XdpMode) -> Result<AttachedMode> {
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
            XdpMode::Auto => {
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
        };
        self.link = Some(link);
        self.mode = Some(mode);
        Ok(mode)
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
        let next = slot.generation + 1;
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

    /// Sum over CPUs of one backend's counters.
    pub fn backend_stats(&self, id: u32) -> Result<BackendStats> {
        Ok(sum(&self.backend_stats.get(&id, 0)?))
    }

    pub fn service_stats(&self, id: u32) -> Result<ServiceStats> {
        Ok(sum(&self.service_stats.get(&id, 0)?))
    }

    pub fn global_stats(&self) -> Result<GlobalStats> {
        Ok(sum(&self.global_stats.get(&0, 0)?))
    }

    /// Sum over CPUs of one backend's time-to-first-byte histogram.
    pub fn latency(&self, id: u32) -> Result<Latency> {
        let mut total = Latency::default();
        for cpu in self.latency.get(&id, 0)?.iter() {
            for (t, v) in total.buckets.iter_mut().zip(cpu.buckets.iter()) {
                *t = t.wrapping_add(*v);
            }
        }
        Ok(total)
    }

    /// Since when backend `id` owes an answer (kernel monotonic ns, 0: none).
    pub fn pulse(&self, id: u32) -> Result<Pulse> {
        Ok(self.pulse.get(&id, 0)?)
    }

    /// Forgets what backend `id` owed: a probe showed it answers again.
    pub fn clear_pulse(&mut self, id: u32) -> Result<()> {
        Ok(self.pulse.set(id, Pulse::default(), 0)?)
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

    /// The program's kernel id, for bpftool.
    pub fn program_id(&self) -> Option<u32> {
        let prog: &Xdp = self.ebpf.program(PROGRAM_NAME)?.try_into().ok()?;
        prog.info().ok().map(|i| i.id())
    }
}

/// Sum over CPUs of one per-CPU counter element.
fn sum<T: Counters + aya::Pod>(per_cpu: &PerCpuValues<T>) -> T {
    let mut total = T::default();
    for v in per_cpu.iter() {
        total.accumulate(v);
    }
    total
}

/// Map key of a service.
#[must_use]
pub fn service_key(vip: SocketAddr, proto: Proto) -> ServiceKey {
    ServiceKey {
        addr: ip_bytes(vip.ip()),
        port_be: vip.port().to_be(),
        proto: proto.number(),
        family: FAMILY_V4,
    }
}

/// Map value of a backend.
#[must_use]
pub fn backend_value(addr: SocketAddr) -> Backend {
    Backend {
        addr: ip_bytes(addr.ip()),
        port_be: addr.port().to_be(),
        family: FAMILY_V4,
        _pad: 0,
        flags: 0,
    }
}

fn ip_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => addr_v4(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_hold_network_order_ports() {
        let k = service_key("10.1.2.3:8080".parse().unwrap(), Proto::Tcp);
        assert_eq!(&k.addr[..4], &[10, 1, 2, 3]);
        assert_eq!(k.port_be.to_ne_bytes(), 8080u16.to_be_bytes());
        assert_eq!(k.proto, 6);
        let b = backend_value("10.9.9.9:53".parse().unwrap());
        assert_eq!(b.port_be.to_ne_bytes(), 53u16.to_be_bytes());
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
        assert!(obj.programs.contains_key(PROGRAM_NAME));
    }
}
