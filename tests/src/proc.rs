//! Child processes: started in a namespace, killed and reaped on drop; the
//! binaries beside this one; root and descriptor limits.

use anyhow::{bail, Context, Result};
use huddle_user::sys::netns::Netns;
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

/// Lifts this process's open-file limit to its hard maximum.
pub fn raise_nofile() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit with a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Fails with a clear message unless running as root.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test needs root (network namespaces, XDP); run it as root, as CI does");
    }
}

/// A child process, killed (by pid) and reaped on drop.
pub struct Proc {
    pub child: Child,
    pub what: String,
}

impl Proc {
    /// Sends SIGTERM and waits up to `timeout`; returns whether it exited
    /// successfully.
    pub fn terminate(&mut self, timeout: Duration) -> Result<bool> {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.success());
            }
            if start.elapsed() > timeout {
                bail!("{} did not exit within {timeout:?} of SIGTERM", self.what);
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts `prog args` inside namespace `ns`.
pub fn spawn_in(ns: &Netns, prog: &Path, args: &[&str], log: Option<&Path>) -> Result<Proc> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name])
        .arg(prog)
        .args(args)
        .stdin(Stdio::null());
    match log {
        Some(path) => {
            let f = std::fs::File::create(path)?;
            cmd.stdout(f.try_clone()?).stderr(f);
        }
        None => {
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
        }
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", prog.display()))?;
    Ok(Proc {
        child,
        what: prog.display().to_string(),
    })
}

/// The binary `name` next to the running one.
pub fn sibling(name: &str) -> Result<PathBuf> {
    Ok(std::env::current_exe()?
        .parent()
        .context("binary folder")?
        .join(name))
}

/// Runs a command and returns (success, stdout, stderr).
pub fn output(prog: &Path, args: &[&str]) -> Result<(bool, String, String)> {
    let o = Command::new(prog).args(args).output()?;
    Ok((
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    ))
}

/// Milliseconds from `since` to the time stamp a log line of the daemon
/// begins with (UTC, `HH:MM:SS.micros` after the date; colour codes
/// skipped): when the daemon decided, apart from when a poll saw it.
#[must_use]
pub fn log_ms_after(line: &str, since: std::time::SystemTime) -> Option<f64> {
    let start = line.find(|c: char| c.is_ascii_digit())?;
    let stamp = line.get(start..)?.split(['Z', ' ']).next()?;
    let clock = stamp.split_once('T')?.1;
    let mut parts = clock.split(':');
    let (h, m, s): (f64, f64, f64) = (
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    );
    let of_day = h * 3600.0 + m * 60.0 + s;
    let since = since
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs_f64()
        % 86_400.0;
    // Across midnight the difference wraps.
    let d = (of_day - since + 86_400.0) % 86_400.0;
    Some(if d > 43_200.0 { d - 86_400.0 } else { d } * 1e3)
}
