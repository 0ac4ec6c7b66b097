//! Which network namespace this thread is in. Things recorded for a
//! namespace (pins, the state file) are keyed by its cookie: the kernel
//! hands an inode number of a deleted namespace to the next one made, but
//! never a cookie, so a namespace that took a dead one's number cannot
//! adopt what the dead one left.

use std::fs;

/// `SO_NETNS_COOKIE` (Linux 5.14), not in every libc yet.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// The cookie of the calling thread's network namespace, read from a
/// socket made for the purpose; `None` on kernels without it.
#[must_use]
pub fn cookie() -> Option<u64> {
    // SAFETY: a plain socket call; the descriptor is closed below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `v`, which we own.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            std::ptr::addr_of_mut!(v).cast(),
            &mut len,
        )
    };
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    (rc == 0 && len as usize == std::mem::size_of::<u64>()).then_some(v)
}

/// Inode number of the calling thread's network namespace (0 if unknown).
/// Reused after the namespace is gone: for messages, and for state files
/// written before cookies were recorded.
#[must_use]
pub fn inode() -> u64 {
    ino("/proc/thread-self/ns/net").unwrap_or(0)
}

fn ino(p: &str) -> Option<u64> {
    fs::metadata(p)
        .ok()
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
}

/// Whether this process runs in the host's network namespace (PID 1's).
/// Where PID 1's cannot be read (a sandbox), a namespace made with `ip
/// netns add` is still told apart by its file under /run/netns.
#[must_use]
pub fn is_host() -> bool {
    let Some(me) = ino("/proc/thread-self/ns/net") else {
        return true;
    };
    match ino("/proc/1/ns/net") {
        Some(init) => init == me,
        None => !fs::read_dir("/run/netns").ok().is_some_and(|d| {
            d.filter_map(Result::ok)
                .any(|e| ino(&e.path().to_string_lossy()) == Some(me))
        }),
    }
}

/// The name that tells this namespace apart for as long as it lives:
/// `c` and its cookie, or (without cookies) its inode number.
#[must_use]
pub fn identity() -> String {
    match cookie() {
        Some(c) => format!("c{c}"),
        None => inode().to_string(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_thread_in_the_same_namespace_reads_the_same_cookie() {
        let here = super::cookie().expect("kernel 5.14 or later");
        let there = std::thread::spawn(super::cookie).join().unwrap();
        assert_eq!(Some(here), there);
        assert_eq!(super::identity(), format!("c{here}"));
    }
}
