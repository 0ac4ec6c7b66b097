//! Data planes pinned for network namespaces that are gone. The pins live
//! in the host's bpffs, which outlives every namespace; a namespace's
//! folder is named by its cookie, so no later namespace adopts it, and it
//! is removed once its XDP link has lost its device (the kernel detaches a
//! link when its interface is destroyed with the namespace).

use super::LINK_PIN;
use crate::kernel::rawmap::bpf;
use crate::sys::pins::NETNS_PREFIX;
use anyhow::{bail, Context, Result};
use std::{
    ffi::CString,
    os::fd::{FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_TYPE_XDP: u32 = 6;

/// `union bpf_attr` for `BPF_OBJ_GET`. The kernel refuses nonzero bytes
/// past the last field, so the tail is a field, not padding.
#[repr(C)]
#[derive(Default)]
struct ObjGet {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _tail: u32,
}

/// `union bpf_attr` for `BPF_OBJ_GET_INFO_BY_FD`.
#[repr(C)]
#[derive(Default)]
struct InfoByFd {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The head of `struct bpf_link_info`: type, id, program, then the union
/// (8-aligned), whose XDP member is the ifindex.
#[repr(C)]
#[derive(Default)]
struct LinkInfoHead {
    kind: u32,
    id: u32,
    prog_id: u32,
    _pad: u32,
    ifindex: u32,
    _rest: [u32; 15],
}

/// What the kernel says of a pinned XDP link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedXdp {
    pub prog_id: u32,
    /// 0 once the link's device is gone.
    pub ifindex: u32,
}

/// The pinned XDP link at `pin`, as the kernel sees it now.
pub fn pinned_xdp(pin: &Path) -> Result<PinnedXdp> {
    let path = CString::new(pin.as_os_str().as_encoded_bytes())?;
    let mut get = ObjGet {
        pathname: path.as_ptr() as u64,
        ..ObjGet::default()
    };
    // SAFETY: `pathname` points at `path`, alive across the call.
    let fd = unsafe { bpf(BPF_OBJ_GET, &mut get) }
        .with_context(|| format!("opening the pinned link {}", pin.display()))?;
    // SAFETY: a descriptor the kernel just gave us, owned from here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut head = LinkInfoHead::default();
    let mut info = InfoByFd {
        bpf_fd: std::os::fd::AsRawFd::as_raw_fd(&fd) as u32,
        info_len: std::mem::size_of::<LinkInfoHead>() as u32,
        info: std::ptr::addr_of_mut!(head) as u64,
    };
    // SAFETY: `info` points at `head`, `info_len` bytes, alive across it.
    unsafe { bpf(BPF_OBJ_GET_INFO_BY_FD, &mut info) }
        .with_context(|| format!("asking about the pinned link {}", pin.display()))?;
    if head.kind != BPF_LINK_TYPE_XDP {
        bail!("{} is a link of type {}, not XDP", pin.display(), head.kind);
    }
    Ok(PinnedXdp {
        prog_id: head.prog_id,
        ifindex: head.ifindex,
    })
}

/// Every pin folder under `root`, with what its XDP link says.
#[must_use]
pub fn list(root: &Path) -> Vec<(PathBuf, Result<PinnedXdp>)> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs.into_iter()
        .map(|d| {
            let l = pinned_xdp(&d.join(LINK_PIN));
            (d, l)
        })
        .collect()
}

/// Folders under `root` pinned for other network namespaces whose XDP link
/// has lost its device: nothing forwards through them and no namespace
/// alive can adopt them. A folder without a link (a start under way) or
/// whose link cannot be read is left alone.
#[must_use]
pub fn find(root: &Path) -> Vec<PathBuf> {
    list(root)
        .into_iter()
        .filter(|(d, l)| {
            d.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(NETNS_PREFIX))
                && l.as_ref().is_ok_and(|l| l.ifindex == 0)
        })
        .map(|(d, _)| d)
        .collect()
}

/// Removes what [`find`] names; returns the folders removed.
pub fn remove(root: &Path) -> Vec<PathBuf> {
    find(root)
        .into_iter()
        .filter(|d| match std::fs::remove_dir_all(d) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("could not remove the stale pins {}: {e}", d.display());
                false
            }
        })
        .collect()
}

/// Carries a data plane pinned by an earlier build under this namespace's
/// inode number (`netns-<inode>-<iface>`) over to `dir`, its cookie-named
/// folder, when it is provably this namespace's: its link is attached to
/// `iface` here and is the program the interface runs now. Anything else
/// under that name (a dead namespace's, whose number ours took) stays
/// where it is, for [`remove`]. Returns whether it moved.
pub fn claim_legacy(dir: &Path, iface: &str) -> bool {
    let (Some(root), false) = (dir.parent(), dir.exists()) else {
        return false;
    };
    let old = root.join(format!(
        "{NETNS_PREFIX}{}-{iface}",
        crate::sys::namespace::inode()
    ));
    let Ok(link) = pinned_xdp(&old.join(LINK_PIN)) else {
        return false;
    };
    let ours = crate::sys::addresses::ifindex(iface)
        .ok()
        .filter(|i| *i == link.ifindex && link.ifindex != 0)
        .and_then(|i| crate::sys::link::query(i, None).ok())
        .is_some_and(|l| l.xdp_prog == Some(link.prog_id));
    ours && std::fs::rename(&old, dir)
        .map_err(|e| tracing::warn!("could not move {} to {}: {e}", old.display(), dir.display()))
        .is_ok()
}
