//! Where the data plane is pinned: the bpffs folder per interface, and
//! whether a pin there outlives this process (`ip netns exec` mounts).

use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;
use std::{
    fs,
    path::{Path, PathBuf},
};

/// Root of the default pin folders.
pub const PIN_ROOT: &str = "/sys/fs/bpf/huddle";

/// Prefix of the default pin folders of network namespaces other than the
/// host's: `netns-<identity>-<iface>`.
pub const NETNS_PREFIX: &str = "netns-";

/// Where the data plane of `iface` is pinned unless configured: one folder
/// per interface, and per network namespace outside the host's own (bpffs
/// is shared by all namespaces, interface names are not). A namespace is
/// named by its cookie, so one that reuses a deleted namespace's inode
/// number never finds the dead one's pins.
#[must_use]
pub fn default_pin_dir(iface: &str) -> PathBuf {
    let root = PathBuf::from(PIN_ROOT);
    if crate::sys::namespace::is_host() {
        root.join(iface)
    } else {
        root.join(format!(
            "{NETNS_PREFIX}{}-{iface}",
            crate::sys::namespace::identity()
        ))
    }
}

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Where the data plane is really pinned, and whether it outlives us.
#[derive(Clone, Debug)]
pub struct PinPlace {
    /// The path to pin at: the configured folder, or the same folder in
    /// the host's bpffs reached through another mount namespace.
    pub dir: PathBuf,
    /// False when the pins live in a bpffs only this process can see: they
    /// die with it, and so does the data plane.
    pub survives: bool,
    /// What the operator must be told about it, once.
    pub note: Option<String>,
}

fn fs_type(p: &Path) -> Option<i64> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_type as i64)
}

fn mount_ns(pid: &str) -> Option<u64> {
    fs::metadata(format!("/proc/{pid}/ns/mnt"))
        .ok()
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
}

fn parent_pid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The root folder of a process outside our mount namespace whose
/// /sys/fs/bpf is a bpffs, held open so the path through it stays valid
/// after that process exits: `(path of our descriptor, pid)`.
fn host_root() -> Option<(PathBuf, u32)> {
    static ROOT: std::sync::OnceLock<Option<(PathBuf, u32)>> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let me = mount_ns("self");
        // PID 1 first, then whoever started us (a shell that ran `ip netns
        // exec`, say), and its ancestors.
        let mut candidates = vec![1u32];
        let mut pid = std::process::id();
        for _ in 0..16 {
            match parent_pid(pid) {
                Some(p) if p > 1 => {
                    candidates.push(p);
                    pid = p;
                }
                _ => break,
            }
        }
        for pid in candidates {
            let ns = mount_ns(&pid.to_string());
            if ns.is_some() && ns == me {
                continue;
            }
            let Ok(dir) = fs::File::open(format!("/proc/{pid}/root")) else {
                continue;
            };
            let via = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
            if fs_type(&via.join("sys/fs/bpf")) == Some(BPF_FS_MAGIC) {
                // Kept open for the life of the process on purpose.
                std::mem::forget(dir);
                return Some((via, pid));
            }
        }
        None
    })
    .clone()
}

/// Whether this process has a mount namespace of its own, apart from its
/// parent's (`ip netns exec` makes one, with a fresh /sys).
fn private_mounts() -> bool {
    let parent = parent_pid(std::process::id()).unwrap_or(1);
    match (mount_ns("self"), mount_ns(&parent.to_string())) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    }
}

/// `dir` as seen from the host's mounts, when this process has a /sys of
/// its own without a bpffs (under `ip netns exec`) and the host's bpffs can
/// be reached; `None` otherwise.
#[must_use]
pub fn host_pin_dir(dir: &Path) -> Option<PathBuf> {
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) || fs_type(root) == Some(BPF_FS_MAGIC) || !private_mounts() {
        return None;
    }
    let (via, _) = host_root()?;
    Some(via.join(dir.strip_prefix("/").unwrap_or(dir)))
}

/// Makes sure `dir` can hold pins that outlive the daemon. It must lie on
/// a bpffs. `ip netns exec` gives each run a fresh /sys without one: then
/// the same folder of the host's bpffs is used, reached through the mount
/// namespace of PID 1 or of the process that started us. If nothing is
/// mounted at /sys/fs/bpf and `dir` is under it, one is mounted there (as
/// systemd would); inside a private mount namespace that one dies with us,
/// and the place says so.
pub fn pin_place(dir: &Path) -> Result<PinPlace> {
    let existing = dir
        .ancestors()
        .find(|a| a.exists())
        .unwrap_or(Path::new("/"));
    if fs_type(existing) == Some(BPF_FS_MAGIC) {
        return Ok(PinPlace {
            dir: dir.to_path_buf(),
            survives: true,
            note: None,
        });
    }
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) || existing != root {
        bail!(
            "pin_dir {} is not on a bpffs (mount one, e.g. `mount -t bpf bpf /sys/fs/bpf`, or choose another pin_dir)",
            dir.display()
        );
    }
    let private = private_mounts();
    if private {
        if let Some((via, pid)) = host_root() {
            let rel = dir.strip_prefix("/").unwrap_or(dir);
            return Ok(PinPlace {
                dir: via.join(rel),
                survives: true,
                note: Some(format!(
                    "this process has a /sys of its own (as under `ip netns exec`), without the host's bpffs: pinning into the host's bpffs at {} (reached through the mounts of pid {pid}), so the data plane outlives the daemon",
                    dir.display()
                )),
            });
        }
    }
    let c = |s: &str| std::ffi::CString::new(s).expect("no NUL");
    let (src, target, kind) = (c("bpf"), c("/sys/fs/bpf"), c("bpf"));
    // SAFETY: mount with valid C strings and no data.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            kind.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("mounting bpffs at /sys/fs/bpf");
    }
    if private {
        let note = "pins live in a bpffs of this process's own mount namespace (as under `ip netns exec` when no host bpffs can be reached): they die with the daemon, so a restart drops every flow; mount bpffs on the host (`mount -t bpf bpf /sys/fs/bpf`) or pass --pin-dir on one".to_string();
        tracing::warn!("{note}");
        return Ok(PinPlace {
            dir: dir.to_path_buf(),
            survives: false,
            note: Some(note),
        });
    }
    tracing::info!("mounted bpffs at /sys/fs/bpf for the pinned data plane");
    Ok(PinPlace {
        dir: dir.to_path_buf(),
        survives: true,
        note: None,
    })
}
