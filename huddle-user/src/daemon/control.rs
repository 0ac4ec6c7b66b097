//! The control socket: requests from `huddle` commands (status, drain,
//! reload, stop); status from the tick's snapshot, the rest under the
//! balancer's lock.

use super::{
    balancer::{lock, Balancer},
    cluster::log_bgp,
    snapshot::Snapshots,
};
use crate::{
    net::admission::Admissions,
    status::control::{Reply, Request, MAX_REQUEST},
};
use anyhow::{bail, Context, Result};
use std::{
    os::unix::net::UnixStream as StdUnixStream,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{UnixListener, UnixStream},
};
use tracing::{info, warn};

impl Balancer {
    /// Withdraws every VIP (`drain`) or announces them again.
    pub(super) fn drain_balancer(&mut self, drain: bool) -> Result<String> {
        let Some(bgp) = self.cluster.bgp.clone() else {
            bail!("this balancer announces nothing: its config has no [bgp]");
        };
        let want = self.vips_to_announce();
        let mut b = lock(&bgp);
        b.drained = drain;
        b.retry_now();
        log_bgp(b.sync(want));
        let st = b.status();
        if let Some(e) = st.error {
            bail!("bird did not take it: {e}");
        }
        Ok(if drain {
            "drained: every VIP withdrawn; the data plane keeps forwarding what still arrives, so its flows finish".into()
        } else {
            format!("announcing again: {}", st.announced.join(", "))
        })
    }

    /// Finds (service index, backend index) of `backend`, optionally within
    /// the service `vip` (`IP:PORT[/proto]`).
    pub(super) fn locate(&self, backend: &str, vip: Option<&str>) -> Result<Vec<(usize, usize)>> {
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
        if drain {
            for &(si, bi) in &targets {
                if self.huddles[si].engine.inner() == [bi] {
                    bail!(
                        "refusing to drain the last backend of {}",
                        self.cfg.services[si].name()
                    );
                }
            }
        }
        let now = self.now();
        for &(si, bi) in &targets {
            self.huddles[si].engine.set_drained(bi, drain, now);
            self.huddles[si].dirty = true;
            self.publish(si)?;
        }
        self.save_state();
        let verb = if drain { "drained" } else { "restored" };
        let msg = format!("{backend} {verb} in {} service(s)", targets.len());
        info!("{msg}");
        Ok(msg)
    }

    /// Answers every request but `Status` (see `client`).
    pub(super) fn handle(&mut self, req: Request) -> Reply {
        let result = match req {
            Request::Status => self.status().map(Reply::status),
            // Built under the lock: a few services cost little, and
            // waiting for a snapshot of every backend would cost a tick.
            Request::StatusOf { services } => self.status_of(&services).map(Reply::status),
            Request::Drain { backend, vip } => self
                .set_drained(&backend, vip.as_deref(), true)
                .map(Reply::message),
            Request::Undrain { backend, vip } => self
                .set_drained(&backend, vip.as_deref(), false)
                .map(Reply::message),
            Request::Reload => self.reload().map(Reply::message),
            Request::DrainBalancer { undo } => self.drain_balancer(!undo).map(Reply::message),
            Request::Stop => {
                self.life.remove_on_exit = true;
                self.life.stop.notify_one();
                Ok(Reply::message(format!(
                    "stopping: detaching from {} and removing its pinned maps",
                    self.cfg.interface
                )))
            }
        };
        result.unwrap_or_else(|e| Reply::error(&e))
    }
}

/// Claims the control socket path, refusing if a live daemon owns it.
pub(super) fn bind_control(path: &Path) -> Result<UnixListener> {
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
    let listener = UnixListener::bind(path)
        .with_context(|| format!("binding control socket {}", path.display()))?;
    // Root's only, whatever the umask: connecting takes write permission.
    // (`client` checks the peer's uid too, for a socket made wider.)
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .with_context(|| format!("making {} root's only", path.display()))?;
    Ok(listener)
}

/// Whether the peer on `stream` may use the control socket: root, or the
/// user the daemon runs as. A socket made wider by hand, or a folder
/// others can write, lets anyone connect; they are answered with a refusal.
fn peer_allowed(stream: &UnixStream) -> Result<()> {
    let cred = stream
        .peer_cred()
        .context("reading the peer's credentials")?;
    // SAFETY: plain libc call.
    let me = unsafe { libc::geteuid() };
    if cred.uid() != 0 && cred.uid() != me {
        bail!(
            "refused: the control socket answers root and uid {me} only, not uid {}",
            cred.uid()
        );
    }
    Ok(())
}

/// Removes the control socket when dropped.
pub(super) struct SocketFile(pub(super) PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Control clients served at once (`huddle top` holds one) in all and per
/// process, how long one may take to send its first request, and how long
/// it may wait between requests after that.
const MAX_CLIENTS: usize = 64;
const MAX_PER_PROCESS: usize = 8;
const FIRST: Duration = Duration::from_secs(5);
const IDLE: Duration = Duration::from_secs(30);

pub(super) async fn serve(
    listener: UnixListener,
    shared: Arc<Mutex<Balancer>>,
    snapshots: Arc<Snapshots>,
) {
    let places = Admissions::new(MAX_CLIENTS, MAX_PER_PROCESS);
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                // Past a cap, closed at once; a client that holds its place
                // idle loses it (`FIRST`, `IDLE`).
                let pid = stream.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0);
                let Ok(place) = places.admit(pid) else {
                    continue;
                };
                let (shared, snapshots) = (shared.clone(), snapshots.clone());
                tokio::spawn(async move {
                    client(stream, shared, snapshots).await;
                    drop(place);
                });
            }
            Err(e) => {
                warn!("control socket accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn client(stream: UnixStream, shared: Arc<Mutex<Balancer>>, snapshots: Arc<Snapshots>) {
    let refused = peer_allowed(&stream).err();
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read.take(MAX_REQUEST as u64)).lines();
    if let Some(e) = refused {
        warn!("control socket: {e:#}");
        // Its request is read (within a second) and answered with the
        // refusal, so the client hears why instead of a broken pipe.
        let _ = tokio::time::timeout(Duration::from_secs(1), lines.next_line()).await;
        let line = serde_json::to_string(&Reply::error(&e)).unwrap_or_default() + "\n";
        let _ = write.write_all(line.as_bytes()).await;
        return;
    }
    let mut wait = FIRST;
    while let Ok(Ok(Some(line))) = tokio::time::timeout(wait, lines.next_line()).await {
        wait = IDLE;
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(Request::Status) => match snapshots.fresh(false).await {
                Ok(s) => Reply::status(s.status.clone()),
                Err(e) => Reply::error(&e),
            },
            Ok(req) => lock(&shared).handle(req),
            Err(e) => Reply::error(&anyhow::anyhow!("bad request: {e}")),
        };
        let mut out = serde_json::to_string(&reply).unwrap_or_else(|_| "{\"ok\":false}".into());
        out.push('\n');
        if write.write_all(out.as_bytes()).await.is_err() {
            return;
        }
    }
}
