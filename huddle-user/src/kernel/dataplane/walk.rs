//! Where each backend's NAT tuple walk stood, saved beside the state file
//! so a fresh start carries on from there, with the tuples the backends may
//! hold in TIME_WAIT.

use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tracing::warn;

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
    crate::sys::files::write_atomic(path, &serde_json::to_vec(w)?, 0o600)
}
