//! The control socket: one JSON request per line, one JSON reply per line.
//! `huddle status`, `drain` and `undrain` talk to a running daemon here.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    Status,
    /// The status of the services whose names contain one of `services`
    /// (all when empty): at 65,536 backends the whole status is megabytes
    /// a call.
    #[serde(rename = "status-of")]
    StatusOf {
        services: Vec<String>,
    },
    /// Take a backend out of its service's ring; its flows finish normally.
    Drain {
        backend: String,
        vip: Option<String>,
    },
    /// Put a drained backend back.
    Undrain {
        backend: String,
        vip: Option<String>,
    },
    /// Detach, remove the pinned data plane, restore sysctls, exit.
    Stop,
    /// Re-read the configuration and apply it (nothing changes if it is
    /// invalid).
    Reload,
    /// Withdraw every VIP from BGP and keep forwarding (`undo`: announce
    /// again).
    #[serde(rename = "drain-balancer")]
    DrainBalancer {
        undo: bool,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<crate::status::Status>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Reply {
    #[must_use]
    pub fn error(e: &anyhow::Error) -> Reply {
        Reply {
            ok: false,
            error: Some(format!("{e:#}")),
            status: None,
            message: None,
        }
    }

    #[must_use]
    pub fn status(s: super::Status) -> Reply {
        Reply {
            ok: true,
            error: None,
            status: Some(s),
            message: None,
        }
    }

    #[must_use]
    pub fn message(m: String) -> Reply {
        Reply {
            ok: true,
            error: None,
            status: None,
            message: Some(m),
        }
    }
}

/// Largest request line accepted.
pub const MAX_REQUEST: usize = 64 * 1024;

/// The status of the services whose names contain one of `only` (every
/// service when empty), asked of the daemon at `socket`; a daemon older
/// than `StatusOf` is asked for the whole and filtered here. A filtered
/// status is as of the last tick (the whole one is read fresh).
pub fn status_of(socket: &Path, only: &[String]) -> Result<crate::status::Status> {
    let mut reply = if only.is_empty() {
        call(socket, &Request::Status)?
    } else {
        call(
            socket,
            &Request::StatusOf {
                services: only.to_vec(),
            },
        )?
    };
    let older = reply
        .error
        .as_deref()
        .is_some_and(|e| e.starts_with("bad request"));
    if older {
        reply = call(socket, &Request::Status)?;
    }
    let status = match (reply.ok, reply.status) {
        (true, Some(s)) => s,
        _ => bail!(
            "{}",
            reply.error.unwrap_or_else(|| "no status in reply".into())
        ),
    };
    // The daemon filtered it, unless it was asked for all.
    if older || only.is_empty() {
        status.only(only)
    } else {
        Ok(status)
    }
}

/// Sends one request to the daemon at `socket` and returns its reply.
pub fn call(socket: &Path, req: &Request) -> Result<Reply> {
    let mut stream = UnixStream::connect(socket).with_context(|| {
        format!(
            "no balancer answers on {} (is `huddle run` running?)",
            socket.display()
        )
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut reply = String::new();
    BufReader::new(stream)
        .read_line(&mut reply)
        .context("reading the daemon's reply")?;
    if reply.is_empty() {
        bail!("the daemon closed the control socket without replying");
    }
    serde_json::from_str(&reply).context("the daemon's reply is not valid JSON")
}
