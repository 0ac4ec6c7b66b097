//! What a restarted daemon carries on from the last one: temperatures and
//! places of backends (so the huddle does not cold-start) and the sysctl
//! values from before the balancer first started (so `huddle stop` can put
//! them back). Written atomically every second and on exit.

use crate::rotation::Place;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tracing::warn;

const VERSION: u32 = 1;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Saved {
    pub version: u32,
    pub interface: String,
    /// Inode of the network namespace the sysctls belong to.
    pub netns: u64,
    pub sysctls: Vec<(PathBuf, String)>,
    pub services: Vec<SavedService>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedService {
    pub name: String,
    pub backends: Vec<SavedBackend>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedBackend {
    pub addr: String,
    pub temperature: f64,
    pub place: Place,
    pub drained: bool,
    pub unhealthy: Option<String>,
    pub strikes: u32,
    pub rotations: u64,
    /// Rest still owed before it may return.
    pub rest_left_ms: u64,
}

impl Saved {
    #[must_use]
    pub fn new(interface: &str) -> Saved {
        Saved {
            version: VERSION,
            interface: interface.to_string(),
            netns: netns_inode(),
            ..Saved::default()
        }
    }
}

/// Reads a state file; a missing one is `None`, an unreadable one is
/// `None` with a warning (a cold start, never a failure).
#[must_use]
pub fn load(path: &Path) -> Option<Saved> {
    let text = std::fs::read_to_string(path).ok()?;
    match serde_json::from_str::<Saved>(&text) {
        Ok(s) if s.version == VERSION => Some(s),
        Ok(s) => {
            warn!(
                "state file {} has version {}, not {VERSION}: ignored",
                path.display(),
                s.version
            );
            None
        }
        Err(e) => {
            warn!("state file {} is unreadable ({e}): ignored", path.display());
            None
        }
    }
}

/// Writes a state file atomically (a crash mid-write leaves the old one).
pub fn save(path: &Path, s: &Saved) -> Result<()> {
    write_atomic(path, &serde_json::to_vec(s)?)
}

/// Writes `bytes` to `path` through a temporary file beside it.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
}

/// Where each backend's NAT tuple walk stood, per CPU, kept beside the
/// state file and outliving `huddle stop`: the backends hold the tuples a
/// run used in TIME_WAIT for 60 s whatever the balancer does, so the next
/// run carries on from there instead of from where the clock says (which
/// a run that walked faster than one round a minute has passed).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NatWalk {
    /// The slice geometry the positions belong to: ports per CPU slice,
    /// SNAT addresses, possible CPUs. Another geometry starts afresh.
    pub slice_ports: u32,
    pub snat_count: u32,
    pub cpus: usize,
    /// Backend address -> per CPU (port offset, SNAT address index).
    pub backends: std::collections::BTreeMap<String, Vec<(u32, u32)>>,
    /// Tuples the backends may still hold in TIME_WAIT, with the client's
    /// last timestamp (see `huddle_common::TwHint`).
    #[serde(default)]
    pub hints: Vec<TimeWaitHint>,
}

/// A tuple a backend holds in TIME_WAIT after a connection it closed
/// first: the balancer's SNAT address and port, the backend, the
/// protocol number, the client's last TCP timestamp, and when the flow
/// closed (CLOCK_MONOTONIC ns; the same clock as the kernel's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimeWaitHint(
    pub std::net::IpAddr,
    pub u16,
    pub std::net::SocketAddr,
    pub u8,
    pub u32,
    pub u64,
);

/// The NAT walk file beside `state_file`.
#[must_use]
pub fn nat_walk_file(state_file: &Path) -> PathBuf {
    state_file.with_extension("nat")
}

/// Reads a NAT walk file; `None` if absent or unreadable (said once).
pub fn load_nat_walk(path: &Path) -> Option<NatWalk> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text)
        .map_err(|e| {
            warn!(
                "NAT walk file {} is unreadable ({e}): ignored",
                path.display()
            )
        })
        .ok()
}

/// Writes a NAT walk file atomically.
pub fn save_nat_walk(path: &Path, w: &NatWalk) -> Result<()> {
    write_atomic(path, &serde_json::to_vec(w)?)
}

/// Inode of the calling thread's network namespace (0 if unknown).
#[must_use]
pub fn netns_inode() -> u64 {
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(0)
}
