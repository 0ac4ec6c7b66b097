//! Names and pins of this process's namespaces and balancers, their
//! removal (on drop, on a signal, and of dead runs'), and the switch they
//! hang off.

use anyhow::Result;
use huddle_user::sys::netns::Netns;
use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    thread,
};

const NAME_PREFIX: &str = "hct";

/// Testbeds pin their balancers' data planes under here.
const PIN_ROOT: &str = "/sys/fs/bpf/huddle-tests";

/// Where the balancer named `name` (unique to its testbed) pins.
#[must_use]
pub fn pin_dir(name: &str) -> PathBuf {
    PathBuf::from(PIN_ROOT).join(name)
}

/// Removes the pins in `dir` (after its balancer stopped), and the root
/// folder once no testbed uses it.
pub fn drop_pins(dir: &Path) {
    let _ = huddle_user::kernel::dataplane::unpin(dir);
    let _ = std::fs::remove_dir(PIN_ROOT);
}

/// A name unique to this process and call.
#[must_use]
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{NAME_PREFIX}{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// For the tools (`hc-demo`, `hc-compare`): on SIGINT or SIGTERM, remove
/// this process's namespaces, the processes in them, its pins and its
/// testbed folders, then exit.
pub fn remove_on_signal() {
    huddle_user::sys::netns::remove_on_signal(drop_own_leftovers);
}

/// Removes the pins of this process's balancers and its testbeds' folders
/// (logs, sockets), which their `Drop` would have removed. Measured: the
/// `cli` tests, which stop `hc-demo` with a signal, left one folder a run.
fn drop_own_leftovers() {
    let own = format!("{NAME_PREFIX}{}-", std::process::id());
    for d in std::fs::read_dir(PIN_ROOT).into_iter().flatten().flatten() {
        if d.file_name().to_string_lossy().starts_with(&own) {
            drop_pins(&d.path());
        }
    }
    let tmp = std::env::temp_dir();
    for d in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
        if d.file_name().to_string_lossy().starts_with(&own) {
            let _ = std::fs::remove_dir_all(d.path());
        }
    }
}

/// Deletes namespaces left by earlier runs of this harness whose process
/// is gone.
pub fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
            continue;
        };
        let pid: u32 = rest
            .split('-')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if pid != 0 && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
    let Ok(dirs) = std::fs::read_dir(PIN_ROOT) else {
        return;
    };
    for d in dirs.flatten() {
        let name = d.file_name().to_string_lossy().to_string();
        let pid: u32 = name
            .strip_prefix(NAME_PREFIX)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if pid != 0 && !Path::new(&format!("/proc/{pid}")).exists() {
            drop_pins(&d.path());
        }
    }
}

/// Runs `f` on a thread inside namespace `ns` and returns its result.
pub fn in_ns<T: Send + 'static>(ns: &Netns, f: impl FnOnce() -> T + Send + 'static) -> T {
    let name = ns.name.clone();
    thread::spawn(move || {
        huddle_user::sys::netns::enter(&name).expect("enter namespace");
        f()
    })
    .join()
    .expect("thread in namespace panicked")
}

/// A fresh name prefix for `tag`, a namespace holding the bridge `br0`
/// that hosts hang off, and a folder for sockets and logs (stale test
/// namespaces of dead runs swept first).
pub fn segment(tag: &str) -> Result<(String, Netns, PathBuf)> {
    sweep_stale();
    let prefix = unique(tag);
    let switch = Netns::create(&format!("{prefix}-sw"))?;
    switch.ip(&["link", "add", "br0", "type", "bridge"])?;
    switch.ip(&["link", "set", "br0", "up"])?;
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir)?;
    Ok((prefix, switch, dir))
}

/// Connects `ns` to the bridge of `switch` by a veth pair (`port` on the
/// bridge, `eth0` in `ns`, up) and gives it `ip`/24.
pub fn plug(switch: &Netns, port: &str, ns: &Netns, ip: Ipv4Addr) -> Result<()> {
    switch.ip(&[
        "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", &ns.name,
    ])?;
    switch.ip(&["link", "set", port, "master", "br0", "up"])?;
    ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
    ns.ip(&["link", "set", "eth0", "up"])
}

/// Whether any XDP program is attached in namespace `ns`.
pub fn xdp_attached(ns: &Netns) -> bool {
    let out = Command::new("ip")
        .args(["-n", &ns.name, "-o", "link", "show"])
        .output();
    out.is_ok_and(|o| {
        let text = String::from_utf8_lossy(&o.stdout);
        text.contains(" xdp") || text.contains("prog/xdp")
    })
}
