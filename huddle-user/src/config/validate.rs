//! From the file (and the flags merged into it) to the validated config:
//! every error names its field.

use super::{
    file::*,
    model::*,
    tuning::{RotationParams, ThermalParams},
    url,
    values::*,
};
use anyhow::{bail, Context, Result};
use huddle_common::{MAX_BACKENDS, MAX_SERVICES, RING_CAPACITY};
use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

impl ConfigFile {
    /// Checks everything and builds the runtime configuration. `file` is
    /// used to point errors at the right place.
    pub fn validate(mut self) -> Result<Config> {
        let renamed = renamed(&mut self.huddle)?;
        let interface = self
            .interface
            .context("interface: missing (set `interface` or pass --iface)")?;
        if interface.is_empty() || interface.len() > 15 || interface.contains('/') {
            bail!("interface: {interface:?} is not a valid interface name");
        }
        let flow_table_size = self
            .flow_table_size
            .unwrap_or(huddle_common::DEFAULT_FLOW_TABLE_SIZE);
        if !(MIN_FLOW_TABLE..=MAX_FLOW_TABLE).contains(&flow_table_size) {
            bail!(
                "flow_table_size: {flow_table_size} is outside {MIN_FLOW_TABLE}..={MAX_FLOW_TABLE}"
            );
        }
        let half_open_table_size = self
            .half_open_table_size
            .unwrap_or(huddle_common::DEFAULT_HALF_OPEN_SIZE);
        if !(MIN_FLOW_TABLE..=MAX_FLOW_TABLE).contains(&half_open_table_size) {
            bail!(
                "half_open_table_size: {half_open_table_size} is outside {MIN_FLOW_TABLE}..={MAX_FLOW_TABLE}"
            );
        }
        // Slots are found by masking a hash: a power of two.
        let half_open_table_size = half_open_table_size.next_power_of_two();
        let maglev_table_size = self
            .maglev_table_size
            .unwrap_or(huddle_common::DEFAULT_MAGLEV_SIZE);
        if !(MIN_MAGLEV..=MAX_MAGLEV).contains(&maglev_table_size)
            || !huddle_common::is_prime(maglev_table_size)
        {
            bail!(
                "maglev_table_size: {maglev_table_size} must be a prime in {MIN_MAGLEV}..={MAX_MAGLEV} (e.g. 65537), and at least 100 times a service's backends for an even spread"
            );
        }
        let nat_ports = self.nat_ports.unwrap_or(DEFAULT_NAT_PORTS);
        if nat_ports.max - nat_ports.min < 255 {
            bail!("nat_ports: {nat_ports} leaves fewer than 256 ports per backend");
        }
        let snat_ips: Vec<Ipv4Addr> = match (self.snat_ip, &self.snat_ips) {
            (Some(_), Some(_)) => bail!("snat_ip and snat_ips: give one of them"),
            (Some(ip), None) => vec![ip],
            (None, Some(list)) if list.is_empty() => {
                bail!("snat_ips: empty (leave it out to use the interface's address)")
            }
            (None, Some(list)) => list.clone(),
            (None, None) => Vec::new(),
        };
        let field = if self.snat_ips.is_some() {
            "snat_ips"
        } else {
            "snat_ip"
        };
        if snat_ips.len() > huddle_common::MAX_SNAT {
            bail!(
                "snat_ips: {} addresses, at most {} are supported",
                snat_ips.len(),
                huddle_common::MAX_SNAT
            );
        }
        for (i, ip) in snat_ips.iter().enumerate() {
            if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
                bail!("{field}: {ip} is not a unicast address");
            }
            if snat_ips[..i].contains(ip) {
                bail!("{field}: {ip} is listed twice");
            }
        }
        if self.services.is_empty() {
            bail!("service: no service configured (add a [[service]] or pass --vip and --backend)");
        }
        if self.services.len() > MAX_SERVICES as usize {
            bail!(
                "service: {} services, at most {MAX_SERVICES} are supported",
                self.services.len()
            );
        }
        let huddle = validate_huddle(&self.huddle)?;
        let default_capacity = self.huddle.capacity.unwrap_or(DEFAULT_CAPACITY);
        if default_capacity == 0 {
            bail!("huddle.capacity: must be at least 1");
        }
        let mut services = Vec::new();
        let mut seen = HashSet::new();
        let mut total_backends = 0usize;
        for (i, s) in self.services.into_iter().enumerate() {
            let field = format!("service[{i}]");
            let (vip, suffix) = parse_vip(&s.vip).with_context(|| format!("{field}.vip"))?;
            let proto = s.proto.or(suffix).unwrap_or(Proto::Tcp);
            let mode = s.mode.unwrap_or_default();
            if !seen.insert((vip, proto)) {
                bail!("{field}.vip: {vip}/{proto} is configured twice");
            }
            if s.backends.is_empty() {
                bail!("{field}.backends: VIP {vip}/{proto} has no backend");
            }
            if s.backends.len() > RING_CAPACITY {
                bail!(
                    "{field}.backends: {} backends, at most {RING_CAPACITY} per service",
                    s.backends.len()
                );
            }
            let mut backends = Vec::new();
            let mut options = Vec::new();
            for (j, b) in s.backends.iter().enumerate() {
                let bfield = format!("{field}.backends[{j}]");
                let (raw, opts) = match b {
                    BackendEntry::Addr(a) => (
                        a,
                        backend_options(None, None, None, default_capacity, &bfield)?,
                    ),
                    BackendEntry::Table(t) => (
                        &t.addr,
                        backend_options(
                            t.weight,
                            t.metrics.clone(),
                            t.capacity,
                            default_capacity,
                            &bfield,
                        )?,
                    ),
                };
                options.push(opts);
                let addr = parse_endpoint(raw).with_context(|| bfield.clone())?;
                if backends.contains(&addr) {
                    bail!("{field}.backends[{j}]: backend {addr} is listed twice");
                }
                if addr.ip() == vip.ip() {
                    bail!("{field}.backends[{j}]: backend {addr} has the VIP's address");
                }
                if snat_ips.iter().any(|s| IpAddr::V4(*s) == addr.ip()) {
                    bail!("{field}.backends[{j}]: backend {addr} has a SNAT address");
                }
                // One family per service: the packet keeps its family
                // in every mode built so far.
                if addr.is_ipv4() != vip.is_ipv4() {
                    bail!(
                        "{field}.backends[{j}]: backend {addr} is {} but the VIP {vip} is {}; a service's backends have its VIP's family (give each family a service of its own)",
                        if addr.is_ipv4() { "IPv4" } else { "IPv6" },
                        if vip.is_ipv4() { "IPv4" } else { "IPv6" }
                    );
                }
                // The packet arrives as the client sent it: nothing can
                // change its port on the way.
                if mode.is_dsr() && addr.port() != vip.port() {
                    bail!(
                        "{field}.backends[{j}]: backend {addr} listens on another port than the VIP {vip}; {mode} delivers the client's packet unchanged, so the backend must listen on port {}",
                        vip.port()
                    );
                }
                backends.push(addr);
            }
            total_backends += backends.len();
            let udp_idle = match (s.udp_idle_ms, proto) {
                (None, _) => DEFAULT_UDP_IDLE,
                (Some(_), Proto::Tcp) => {
                    bail!("{field}.udp_idle_ms: only UDP services have an idle timeout")
                }
                (Some(ms), Proto::Udp) => millis(
                    Some(ms),
                    0,
                    &format!("{field}.udp_idle_ms"),
                    1000,
                    86_400_000,
                )?,
            };
            if let (Some(p), true) = (self.encap_prefix, mode.is_dsr()) {
                if let IpAddr::V4(v4) = vip.ip() {
                    if p.contains(v4) {
                        bail!("encap_prefix: {p} holds the VIP {vip} of {field}; outer source addresses must not be service addresses");
                    }
                }
            }
            services.push(Service {
                vip,
                proto,
                backends,
                options,
                udp_idle,
                mode,
                selection: s.selection.unwrap_or_default(),
            });
        }
        if total_backends > MAX_BACKENDS as usize {
            bail!(
                "service: {total_backends} backends in all, at most {MAX_BACKENDS} are supported"
            );
        }
        let control_socket = self
            .control_socket
            .unwrap_or_else(|| default_control_socket(&interface));
        let state_file = self
            .state_file
            .unwrap_or_else(|| control_socket.with_extension("state"));
        if let Some(p) = &self.pin_dir {
            if !p.is_absolute() {
                bail!(
                    "pin_dir: {} must be an absolute path on a bpffs",
                    p.display()
                );
            }
        }
        if let Some(p) = self.encap_prefix {
            if !services.iter().any(|s| s.mode == Mode::DsrIpip) {
                bail!("encap_prefix: {p} is set but no service has mode = \"dsr-ipip\"");
            }
            for s in &services {
                if let IpAddr::V4(v4) = s.vip.ip() {
                    if p.contains(v4) {
                        bail!("encap_prefix: {p} holds the VIP {}; outer source addresses must not be service addresses", s.vip);
                    }
                }
            }
        }
        let snat_ips6 = self.snat_ips6.clone().unwrap_or_default();
        if self.snat_ips6.as_ref().is_some_and(Vec::is_empty) {
            bail!("snat_ips6: empty (leave it out to use the interface's address)");
        }
        for (i, ip) in snat_ips6.iter().enumerate() {
            if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
                bail!("snat_ips6: {ip} is not a unicast address");
            }
            if snat_ips6[..i].contains(ip) {
                bail!("snat_ips6: {ip} is listed twice");
            }
        }
        if snat_ips.len() + snat_ips6.len() > huddle_common::MAX_SNAT {
            bail!(
                "snat_ips and snat_ips6: {} addresses, at most {} in all",
                snat_ips.len() + snat_ips6.len(),
                huddle_common::MAX_SNAT
            );
        }
        let bgp = match &self.bgp {
            None => None,
            Some(b) => {
                match b.daemon.as_deref() {
                    None | Some("bird") => {}
                    Some(other) => {
                        bail!("bgp.daemon: {other:?} is not driven (yet); \"bird\" (bird2) is")
                    }
                }
                let bgp = Bgp {
                    control_socket: b
                        .control_socket
                        .clone()
                        .unwrap_or_else(|| PathBuf::from("/run/bird/bird.ctl")),
                    routes_file: b.routes_file.clone().unwrap_or_else(|| {
                        PathBuf::from(format!("/run/huddle/{interface}.bird.conf"))
                    }),
                };
                for (field, p) in [
                    ("bgp.routes_file", &bgp.routes_file),
                    ("bgp.control_socket", &bgp.control_socket),
                ] {
                    if !p.is_absolute() {
                        bail!("{field}: {} must be an absolute path", p.display());
                    }
                }
                Some(bgp)
            }
        };
        let cluster = match &self.cluster {
            None => None,
            Some(c) => {
                let me = huddle
                    .listen
                    .and_then(|m| c.members.iter().position(|a| *a == m))
                    .with_context(|| {
                        format!(
                            "cluster.members: this balancer's huddle.listen ({}) must be one of them, as the others reach it",
                            huddle
                                .listen
                                .map_or("off".to_string(), |m| m.to_string())
                        )
                    })?;
                if c.members.len() < 2 {
                    bail!("cluster.members: a cluster of one balancer; leave [cluster] out");
                }
                for (i, m) in c.members.iter().enumerate() {
                    if c.members[..i].contains(m) {
                        bail!("cluster.members: {m} is listed twice");
                    }
                }
                Some(Cluster {
                    members: c.members.clone(),
                    me,
                })
            }
        };
        Ok(Config {
            renamed,
            bgp,
            cluster,
            interface,
            snat_ips,
            snat_ips6,
            encap_prefix: self.encap_prefix,
            xdp_mode: self.xdp_mode.unwrap_or_default(),
            nat_ports,
            flow_table_size,
            half_open_table_size,
            maglev_table_size,
            pin_dir: self.pin_dir,
            state_file,
            detach_on_exit: self.detach_on_exit.unwrap_or(false),
            control_socket,
            services,
            huddle,
        })
    }
}

fn backend_options(
    weight: Option<f64>,
    metrics: Option<String>,
    capacity: Option<u64>,
    default_capacity: u64,
    field: &str,
) -> Result<BackendOptions> {
    let weight = weight.unwrap_or(1.0);
    if !weight.is_finite() || weight <= 0.0 || weight > 100.0 {
        bail!("{field}.weight: {weight} must be a number in (0, 100]");
    }
    if let Some(url) = &metrics {
        url::Url::parse(url).with_context(|| format!("{field}.metrics"))?;
    }
    let capacity = capacity.unwrap_or(default_capacity);
    if capacity == 0 {
        bail!("{field}.capacity: must be at least 1");
    }
    Ok(BackendOptions {
        weight,
        metrics,
        capacity,
    })
}

fn millis(v: Option<u64>, default: u64, field: &str, min: u64, max: u64) -> Result<Duration> {
    let v = v.unwrap_or(default);
    if !(min..=max).contains(&v) {
        bail!("{field}: {v} is outside {min}..={max}");
    }
    Ok(Duration::from_millis(v))
}

fn fraction(v: Option<f64>, default: f64, field: &str, lo_open: bool) -> Result<f64> {
    let v = v.unwrap_or(default);
    let ok = v.is_finite() && v <= 1.0 && if lo_open { v > 0.0 } else { v >= 0.0 };
    if !ok {
        let lo = if lo_open { "(0" } else { "[0" };
        bail!("{field}: {v} must be in {lo}, 1]");
    }
    Ok(v)
}

fn validate_huddle(h: &HuddleFile) -> Result<Huddle> {
    let rd = RotationParams::default();
    let td = ThermalParams::default();
    let tick = millis(h.tick_ms, 100, "huddle.tick_ms", 10, 60_000)?;
    let hung_after = millis(h.hung_after_ms, 200, "huddle.hung_after_ms", 10, 600_000)?;
    let hung_after_min = millis(
        h.hung_after_min_ms,
        50.min(hung_after.as_millis() as u64),
        "huddle.hung_after_min_ms",
        10,
        600_000,
    )?;
    if hung_after_min > hung_after {
        bail!(
            "huddle.hung_after_min_ms: {} is above huddle.hung_after_ms ({})",
            hung_after_min.as_millis(),
            hung_after.as_millis()
        );
    }
    let heat = fraction(h.heat, rd.heat, "huddle.heat", true)?;
    let cool = fraction(h.cool, rd.cool, "huddle.cool", false)?;
    if cool >= heat {
        bail!("huddle.cool: {cool} must be below huddle.heat ({heat}), or backends would flap");
    }
    let min_inner = h.min_inner.unwrap_or(rd.min_inner);
    if min_inner == 0 {
        bail!("huddle.min_inner: must be at least 1 (the inner ring is never empty)");
    }
    let min_rest = millis(h.min_rest_ms, 10_000, "huddle.min_rest_ms", 0, 86_400_000)?;
    let max_rest = millis(h.max_rest_ms, 160_000, "huddle.max_rest_ms", 0, 86_400_000)?;
    if max_rest < min_rest {
        bail!("huddle.max_rest_ms: below huddle.min_rest_ms");
    }
    let weights = h.weights.unwrap_or_default();
    for (name, w) in [
        ("latency", weights.latency),
        ("cpu", weights.cpu),
        ("memory", weights.memory),
        ("load", weights.load),
    ] {
        if !w.is_finite() || !(0.0..=10.0).contains(&w) {
            bail!("huddle.weights.{name}: {w} must be in [0, 10]");
        }
    }
    let ratio = h.full_anomaly_ratio.unwrap_or(td.full_anomaly_ratio);
    if !ratio.is_finite() || ratio <= 1.0 || ratio > 1000.0 {
        bail!("huddle.full_anomaly_ratio: {ratio} must be above 1");
    }
    if let Some(c) = h.latency_ceiling_ms {
        if !c.is_finite() || c <= 0.0 {
            bail!("huddle.latency_ceiling_ms: {c} must be a positive number");
        }
    }
    let listen = match h.listen.as_deref().unwrap_or(DEFAULT_METRICS_LISTEN) {
        "off" | "" => None,
        a => Some(
            a.parse::<SocketAddr>()
                .with_context(|| format!("huddle.listen: {a:?} is not IP:PORT or \"off\""))?,
        ),
    };
    let floor_ms = h.latency_floor_ms.unwrap_or(td.floor_ms);
    if !floor_ms.is_finite() || floor_ms < 0.0 {
        bail!("huddle.latency_floor_ms: {floor_ms} must be a number >= 0");
    }
    let pf = h.probe.clone().unwrap_or_default();
    let path = pf.path.unwrap_or_else(|| "/".into());
    if !path.starts_with('/') || path.contains(char::is_whitespace) {
        bail!("huddle.probe.path: {path:?} must start with / and hold no spaces");
    }
    let probe = Probe {
        kind: pf.kind.unwrap_or_default(),
        path,
        interval: millis(pf.interval_ms, 250, "huddle.probe.interval_ms", 10, 600_000)?,
        timeout: millis(pf.timeout_ms, 1000, "huddle.probe.timeout_ms", 10, 60_000)?,
        fall: pf.fall.unwrap_or(2).max(1),
        rise: pf.rise.unwrap_or(2).max(1),
    };
    Ok(Huddle {
        rotation: h.rotation.unwrap_or(true),
        tick,
        thermal: ThermalParams {
            weights,
            alpha: fraction(h.alpha, td.alpha, "huddle.alpha", true)?,
            full_anomaly_ratio: ratio,
            ceiling_ms: h.latency_ceiling_ms,
            floor_ms,
        },
        rotation_params: RotationParams {
            heat,
            cool,
            min_inner,
            cooldown: millis(h.cooldown_ms, 5000, "huddle.cooldown_ms", 0, 86_400_000)?,
            min_rest,
            max_rest,
            warmup: millis(h.warmup_ms, 0, "huddle.warmup_ms", 0, 86_400_000)?,
        },
        hung_after,
        hung_after_min,
        hung_after_p99: match h.hung_after_p99 {
            None => 5.0,
            Some(k) if k.is_finite() && (1.0..=1000.0).contains(&k) => k,
            Some(k) => bail!("huddle.hung_after_p99: {k} is outside 1..=1000"),
        },
        pass_over_owing: h.pass_over_owing.unwrap_or(true),
        syn_timeout: millis(h.syn_timeout_ms, 300, "huddle.syn_timeout_ms", 10, 600_000)?,
        error_threshold: fraction(h.error_threshold, 0.5, "huddle.error_threshold", true)?,
        min_samples: h.min_samples.unwrap_or(3).max(1),
        move_flows_off_dead: h.move_flows_off_dead.unwrap_or(false),
        listen,
        scrape_interval: millis(
            h.scrape_interval_ms,
            1000,
            "huddle.scrape_interval_ms",
            50,
            600_000,
        )?,
        scrape_timeout: millis(
            h.scrape_timeout_ms,
            500,
            "huddle.scrape_timeout_ms",
            10,
            60_000,
        )?,
        probe,
    })
}

/// The defaults are what validating an empty `[huddle]` gives.
impl Default for Huddle {
    fn default() -> Self {
        validate_huddle(&HuddleFile::default()).expect("the default huddle settings are valid")
    }
}

/// Moves keys set under their old names to the new ones, and says so
/// (once, at start); both names set is an error naming both.
fn renamed(h: &mut HuddleFile) -> Result<Vec<String>> {
    let mut said = Vec::new();
    let mut carry = |old: &str, new: &str, was: bool, is: bool| -> Result<bool> {
        match (was, is) {
            (true, true) => {
                bail!("huddle.{old} and huddle.{new}: the same setting twice; keep {new}")
            }
            (true, false) => {
                said.push(format!(
                    "huddle.{old} is now huddle.{new}; the old name is read until the next release"
                ));
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    if carry(
        "metrics_listen",
        "listen",
        h.metrics_listen.is_some(),
        h.listen.is_some(),
    )? {
        h.listen = h.metrics_listen.take();
    }
    if carry(
        "metrics_interval_ms",
        "scrape_interval_ms",
        h.metrics_interval_ms.is_some(),
        h.scrape_interval_ms.is_some(),
    )? {
        h.scrape_interval_ms = h.metrics_interval_ms.take();
    }
    if carry(
        "metrics_timeout_ms",
        "scrape_timeout_ms",
        h.metrics_timeout_ms.is_some(),
        h.scrape_timeout_ms.is_some(),
    )? {
        h.scrape_timeout_ms = h.metrics_timeout_ms.take();
    }
    Ok(said)
}
