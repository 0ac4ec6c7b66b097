//! `huddle stop`: through the running daemon if there is one, otherwise
//! straight on the pins.

use crate::huddle::state::{self};
use crate::{
    kernel::dataplane::{self},
    status::control::Request,
};
use anyhow::{bail, Result};
use std::{path::Path, time::Duration};
use tracing::warn;

/// Stops the balancer of `cfg`'s interface: through its daemon if one
/// answers, else by removing what a daemon left pinned. Returns what was
/// done.
pub fn stop(socket: &Path, pins: &Path, state_file: &Path) -> Result<String> {
    if let Some(done) = by_daemon(socket)? {
        return Ok(done);
    }
    by_hand(&socket.display().to_string(), pins, Some(state_file))
}

/// Asks the daemon on `socket` to stop (it knows its own pins); `None` if
/// no daemon answers there.
pub fn by_daemon(socket: &Path) -> Result<Option<String>> {
    let Ok(reply) = crate::status::control::call(socket, &Request::Stop) else {
        return Ok(None);
    };
    if !reply.ok {
        bail!("{}", reply.error.unwrap_or_default());
    }
    // Wait for the daemon to finish (it removes its socket last).
    for _ in 0..100 {
        if !socket.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Some(reply.message.unwrap_or_default()))
}

/// Removes what a daemon left pinned under `pins` (and restores the
/// sysctls its `state_file` kept); `asked` names where no daemon answered.
pub fn by_hand(asked: &str, pins: &Path, state_file: Option<&Path>) -> Result<String> {
    let saved = state_file.and_then(state::load);
    let n = dataplane::unpin(
        &crate::sys::pins::host_pin_dir(pins).unwrap_or_else(|| pins.to_path_buf()),
    )?;
    let mut restored = false;
    if let Some(s) = &saved {
        // The sysctls are per namespace: restore only in the daemon's own.
        if s.from_here() {
            crate::sys::sysctls::Sysctls::restore_saved(&s.sysctls);
            restored = true;
        } else {
            warn!(
                "the daemon ran in another network namespace: its sysctls on {} are left as they are",
                s.interface
            );
        }
    }
    if let Some(f) = state_file {
        let _ = std::fs::remove_file(f);
    }
    if n == 0 && saved.is_none() {
        bail!(
            "nothing to stop: no daemon answers on {asked} and nothing is pinned under {}",
            pins.display()
        );
    }
    Ok(format!(
        "no daemon was running; removed {n} pinned objects under {} (the program detached){}",
        pins.display(),
        if restored {
            " and restored the sysctls"
        } else {
            ""
        }
    ))
}
