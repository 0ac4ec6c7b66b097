//! `huddle run`: validate, load, program, attach, serve the control socket,
//! and on SIGINT/SIGTERM detach and undo everything.

use crate::{
    config::{Config, Service},
    control::{Reply, Request, MAX_REQUEST},
    dataplane::Dataplane,
    host,
    status::{counters, BackendStatus, ServiceStatus, Status},
};
use anyhow::{bail, Context, Result};
use std::{
    collections::HashSet,
    net::SocketAddr,
    os::unix::net::UnixStream as StdUnixStream,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{UnixListener, UnixStream},
    signal::unix::{signal, SignalKind},
};
use tracing::{info, warn};

/// How often backend neighbours are refreshed in the kernel's cache.
const NEIGHBOUR_REFRESH: Duration = Duration::from_secs(15);

/// The running balancer's state, behind one lock.
pub struct Balancer {
    pub dp: Dataplane,
    pub cfg: Config,
    /// (service index, backend index) pairs taken out by an operator.
    drained: HashSet<(usize, usize)>,
    started: Instant,
}

impl Balancer {
    #[must_use]
    pub fn new(dp: Dataplane, cfg: Config) -> Balancer {
        Balancer {
            dp,
            cfg,
            drained: HashSet::new(),
            started: Instant::now(),
        }
    }

    /// Every backend address, for neighbour resolution.
    #[must_use]
    pub fn backend_addrs(&self) -> Vec<SocketAddr> {
        self.cfg
            .services
            .iter()
            .flat_map(|s| s.backends.iter().copied())
            .collect()
    }

    pub fn status(&self) -> Result<Status> {
        let mut services = Vec::new();
        for (si, slot) in self.dp.services.iter().enumerate() {
            let mut backends = Vec::new();
            for (bi, (addr, id)) in slot
                .service
                .backends
                .iter()
                .zip(&slot.backend_ids)
                .enumerate()
            {
                let st = self.dp.backend_stats(*id)?;
                backends.push(BackendStatus {
                    addr: addr.to_string(),
                    id: *id,
                    in_ring: slot.ring.contains(id),
                    drained: self.drained.contains(&(si, bi)),
                    active_flows: st.flows_new.saturating_sub(st.flows_closed),
                    counters: counters(&st),
                });
            }
            let ring = slot
                .ring
                .iter()
                .filter_map(|id| slot.backend_ids.iter().position(|b| b == id))
                .map(|i| slot.service.backends[i].to_string())
                .collect();
            services.push(ServiceStatus {
                name: slot.service.name(),
                ring_generation: slot.generation,
                ring,
                counters: counters(&self.dp.service_stats(slot.id)?),
                backends,
            });
        }
        Ok(Status {
            interface: self.cfg.interface.clone(),
            xdp_mode: self.dp.mode.map_or("detached", |m| m.as_str()).to_string(),
            program_id: self.dp.program_id(),
            snat: self.dp.snat.to_string(),
            nat_ports: self.dp.nat_ports.to_string(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            services,
            global: counters(&self.dp.global_stats()?),
        })
    }

    /// Finds (service index, backend index) of `backend`, optionally within
    /// the service `vip` (`IP:PORT[/proto]`).
    fn locate(&self, backend: &str, vip: Option<&str>) -> Result<Vec<(usize, usize)>> {
        let addr = crate::config::parse_endpoint(backend)?;
        let vip = vip.map(crate::config::parse_vip).transpose()?;
        let found: Vec<_> = self
            .cfg
            .services
            .iter()
            .enumerate()
            .filter(|(_, s)| vip.is_none_or(|(v, p)| s.vip == v && p.is_none_or(|p| p == s.proto)))
            .filter_map(|(si, s)| {
                s.backends
                    .iter()
                    .position(|b| *b == addr)
                    .map(|bi| (si, bi))
            })
            .collect();
        if found.is_empty() {
            bail!(
                "backend {addr} is not configured{}",
                vip.map_or(String::new(), |(v, _)| format!(" for {v}"))
            );
        }
        Ok(found)
    }

    /// Drains (`drain = true`) or restores a backend, swapping the affected
    /// rings. Refuses to empty a ring.
    pub fn set_drained(&mut self, backend: &str, vip: Option<&str>, drain: bool) -> Result<String> {
        let targets = self.locate(backend, vip)?;
        let mut next = self.drained.clone();
        for t in &targets {
            if drain {
                next.insert(*t);
            } else {
                next.remove(t);
            }
        }
        let mut rings = Vec::new();
        for &(si, _) in &targets {
            let ring = ring_of(
                &self.cfg.services[si],
                &self.dp.services[si].backend_ids,
                si,
                &next,
            );
            if ring.is_empty() {
                bail!(
                    "refusing to drain the last backend of {}",
                    self.cfg.services[si].name()
                );
            }
            rings.push((si, ring));
        }
        for (si, ring) in rings {
            self.dp.swap_ring(si, &ring)?;
        }
        self.drained = next;
        let verb = if drain { "drained" } else { "restored" };
        let msg = format!("{backend} {verb} in {} service(s)", targets.len());
        info!("{msg}");
        Ok(msg)
    }

    fn handle(&mut self, req: Request) -> Reply {
        let result = match req {
            Request::Status => self.status().map(|s| Reply {
                ok: true,
                error: None,
                status: Some(s),
                message: None,
            }),
            Request::Drain { backend, vip } => self
                .set_drained(&backend, vip.as_deref(), true)
                .map(Reply::message),
            Request::Undrain { backend, vip } => self
                .set_drained(&backend, vip.as_deref(), false)
                .map(Reply::message),
        };
        result.unwrap_or_else(|e| Reply::error(&e))
    }
}

/// The ring of a service: its backends in configured order, less drained.
fn ring_of(
    service: &Service,
    ids: &[u32],
    si: usize,
    drained: &HashSet<(usize, usize)>,
) -> Vec<u32> {
    (0..service.backends.len())
        .filter(|bi| !drained.contains(&(si, *bi)))
        .map(|bi| ids[bi])
        .collect()
}

/// Claims the control socket path, refusing if a live daemon owns it.
fn bind_control(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        if StdUnixStream::connect(path).is_ok() {
            bail!(
                "a balancer already answers on {} (stop it first)",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("binding control socket {}", path.display()))
}

/// Removes the control socket when dropped.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs the balancer until SIGINT or SIGTERM.
pub async fn run(cfg: Config) -> Result<()> {
    host::check_privileges()?;
    let ifindex = host::ifindex(&cfg.interface)?;
    let snat = match cfg.snat_ip {
        Some(ip) => ip,
        None => host::interface_ipv4(&cfg.interface)?.with_context(|| {
            format!(
                "interface {} has no IPv4 address; pass --snat-ip",
                cfg.interface
            )
        })?,
    };
    let ephemeral = host::ephemeral_ports()?;
    if cfg.nat_ports.overlaps(&ephemeral) {
        bail!(
            "nat_ports {} overlap the kernel's ephemeral ports {ephemeral} (net.ipv4.ip_local_port_range); \
             choose --nat-ports outside them so NAT never collides with the host's own connections",
            cfg.nat_ports
        );
    }
    for s in &cfg.services {
        if s.vip.ip() == snat && (cfg.nat_ports.min..=cfg.nat_ports.max).contains(&s.vip.port()) {
            bail!(
                "VIP {} lies in the SNAT address's NAT port range {}",
                s.name(),
                cfg.nat_ports
            );
        }
    }
    let listener = bind_control(&cfg.control_socket)?;
    let _socket_file = SocketFile(cfg.control_socket.clone());

    let dp = Dataplane::load(&cfg, snat)?;
    let sysctls = host::Sysctls::apply(&cfg.interface)?;
    let mut balancer = Balancer::new(dp, cfg.clone());
    host::warm_neighbours(&balancer.backend_addrs());
    let mode = balancer.dp.attach(ifindex, cfg.xdp_mode)?;
    info!(
        "attached to {} in {} mode; SNAT {snat}, NAT ports {}; control socket {}",
        cfg.interface,
        mode.as_str(),
        cfg.nat_ports,
        cfg.control_socket.display()
    );
    for s in &cfg.services {
        info!("service {} -> {} backends", s.name(), s.backends.len());
    }
    let backends = balancer.backend_addrs();
    let shared = Arc::new(Mutex::new(balancer));

    let server = tokio::spawn(serve(listener, shared.clone()));
    let refresher = tokio::spawn(async move {
        let mut tick = tokio::time::interval(NEIGHBOUR_REFRESH);
        loop {
            tick.tick().await;
            host::warm_neighbours(&backends);
        }
    });

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: detaching"),
        _ = int.recv() => info!("SIGINT: detaching"),
    }
    server.abort();
    refresher.abort();
    let _ = server.await;
    let _ = refresher.await;
    // Dropping the last reference detaches the program and frees the maps.
    match Arc::try_unwrap(shared) {
        Ok(m) => drop(m.into_inner()),
        Err(_) => warn!("control connections still open; the program detaches as they close"),
    }
    drop(sysctls);
    info!(
        "detached from {}; maps freed and sysctls restored",
        cfg.interface
    );
    Ok(())
}

async fn serve(listener: UnixListener, shared: Arc<Mutex<Balancer>>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(client(stream, shared.clone()));
            }
            Err(e) => {
                warn!("control socket accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn client(stream: UnixStream, shared: Arc<Mutex<Balancer>>) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read.take(MAX_REQUEST as u64)).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(req) => {
                let mut b = shared
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                b.handle(req)
            }
            Err(e) => Reply::error(&anyhow::anyhow!("bad request: {e}")),
        };
        let mut out = serde_json::to_string(&reply).unwrap_or_else(|_| "{\"ok\":false}".into());
        out.push('\n');
        if write.write_all(out.as_bytes()).await.is_err() {
            return;
        }
    }
}
