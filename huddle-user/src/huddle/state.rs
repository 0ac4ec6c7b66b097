//! What a restarted daemon carries on from the last one: temperatures and
//! places of backends (so the huddle does not cold-start) and the sysctl
//! values from before the balancer first started (so `huddle stop` can put
//! them back). Written atomically every second and on exit.

use crate::huddle::rotation::Place;
use anyhow::Result;
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
    /// Cookie of that namespace: unlike the inode, never reused, so a
    /// file left by a namespace that is gone is known for what it is.
    #[serde(default)]
    pub netns_cookie: Option<u64>,
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
            netns: crate::sys::namespace::inode(),
            netns_cookie: crate::sys::namespace::cookie(),
            ..Saved::default()
        }
    }

    /// Whether this file was written in the calling thread's network
    /// namespace (by cookie; by inode for files that carry none).
    #[must_use]
    pub fn from_here(&self) -> bool {
        match (self.netns_cookie, crate::sys::namespace::cookie()) {
            (Some(theirs), Some(ours)) => theirs == ours,
            _ => self.netns == crate::sys::namespace::inode(),
        }
    }
}

/// The state file at `path` if this namespace wrote it. One left by
/// another namespace (the same interface name in a namespace since
/// deleted, whose inode number ours may have taken) is ignored, with a
/// line saying so: nothing of a dead namespace is carried on.
#[must_use]
pub fn load_ours(path: &Path) -> Option<Saved> {
    let s = load(path)?;
    if s.from_here() {
        return Some(s);
    }
    tracing::info!(
        "state file {} was written in another network namespace (cookie {}): ignored, starting cold",
        path.display(),
        s.netns_cookie.map_or("unknown".into(), |c| c.to_string())
    );
    None
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
    crate::sys::files::write_atomic(path, &serde_json::to_vec(s)?, 0o600)
}
