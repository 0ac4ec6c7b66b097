//! Network namespaces made with `ip netns`, removed when dropped. Used by
//! `huddle bench` and by the test and demo harness.

use anyhow::{bail, Context, Result};
use std::{
    fs::File,
    os::fd::AsRawFd,
    process::Command,
    sync::{
        atomic::{AtomicI32, Ordering},
        Mutex,
    },
    time::Duration,
};

/// The namespaces this process made and has not removed yet.
static LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// The signal `remove_on_signal` caught (0: none yet).
static CAUGHT: AtomicI32 = AtomicI32::new(0);

extern "C" fn catch(sig: libc::c_int) {
    CAUGHT.store(sig, Ordering::Relaxed);
}

/// From now on SIGINT and SIGTERM remove every namespace this process made
/// (and the processes in them), then run `also` (pins and the like) and
/// exit with 128 + the signal: a tool stopped mid-run leaves nothing
/// behind. A handler, not a blocked mask, so children started later get
/// the default dispositions back at exec.
pub fn remove_on_signal(also: fn()) {
    // SAFETY: the handler only stores into an atomic, which is
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, catch as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, catch as *const () as libc::sighandler_t);
    }
    std::thread::spawn(move || loop {
        let sig = CAUGHT.load(Ordering::Relaxed);
        if sig != 0 {
            let names: Vec<String> = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
            eprintln!(
                "signal {sig}: removing this run's {} network namespaces",
                names.len()
            );
            for n in &names {
                remove(n);
            }
            also();
            std::process::exit(128 + sig);
        }
        std::thread::sleep(Duration::from_millis(50));
    });
}

/// Kills every process in namespace `name`, then deletes it.
fn remove(name: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", name]).output() {
        for pid in String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            // SAFETY: signalling a process by pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    let _ = Command::new("ip").args(["netns", "del", name]).output();
}

/// Runs `ip` with `args`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Deletes namespaces named `PREFIX...-PID` (a prefix of `prefixes`)
/// whose process is gone: a run killed before it could drop its
/// namespaces (SIGINT, SIGKILL) leaves them. Returns how many it deleted.
pub fn remove_orphans(prefixes: &[&str]) -> usize {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return 0;
    };
    let mut removed = 0;
    for name in String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
    {
        let orphan = prefixes.iter().any(|p| name.starts_with(p))
            && name
                .rsplit('-')
                .next()
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists());
        if orphan && ip(&["netns", "del", name]).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Creates namespace `name` (removing a stale one of that name first)
    /// with loopback up.
    pub fn create(name: &str) -> Result<Netns> {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        ip(&["netns", "add", name])?;
        let ns = Netns {
            name: name.to_string(),
        };
        if let Ok(mut live) = LIVE.lock() {
            live.push(name.to_string());
        }
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `ip -n NAME args...`
    pub fn ip(&self, args: &[&str]) -> Result<()> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Runs a command inside the namespace.
    pub fn exec(&self, prog: &str, args: &[&str]) -> Result<()> {
        let mut all = vec!["netns", "exec", self.name.as_str(), prog];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Runs a command inside the namespace and returns what it printed.
    pub fn output(&self, prog: &str, args: &[&str]) -> Result<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", self.name.as_str(), prog])
            .args(args)
            .output()
            .with_context(|| format!("running {prog} in {}", self.name))?;
        if !out.status.success() {
            bail!(
                "{prog} {} in {}: {}",
                args.join(" "),
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Sets a sysctl inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.exec("sysctl", &["-qw", &format!("{key}={value}")])
    }

    /// Moves the calling thread into the namespace (only this thread).
    pub fn enter(&self) -> Result<()> {
        enter(&self.name)
    }
}

/// Moves the calling thread into namespace `name` (only this thread).
pub fn enter(name: &str) -> Result<()> {
    let f = File::open(format!("/run/netns/{name}"))
        .with_context(|| format!("opening namespace {name}"))?;
    // SAFETY: setns on a valid namespace fd; affects the calling thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("setns into {name}"));
    }
    Ok(())
}

/// A command that runs in namespace `name` with the caller's mounts (unlike
/// `ip netns exec`, which remounts /sys and so hides the host's bpffs).
pub fn command_in(name: &str, prog: &std::path::Path) -> Result<Command> {
    use std::os::unix::process::CommandExt as _;
    let f = File::open(format!("/run/netns/{name}"))
        .with_context(|| format!("opening namespace {name}"))?;
    let mut cmd = Command::new(prog);
    // SAFETY: only setns (a plain system call) runs between fork and exec;
    // the descriptor stays open in the closure for as long as needed.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|n| *n != self.name);
        }
    }
}
