//! Telling systemd the daemon is ready (`sd_notify`).

use tracing::warn;

/// Tells systemd about the daemon's state (`READY=1`, `RELOADING=1`,
/// `STOPPING=1`, `STATUS=...`) when it runs as a `Type=notify` service;
/// nothing otherwise. Errors are logged, never fatal.
pub fn sd_notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = notify_to(&path, state) {
        warn!("telling systemd {state:?}: {e}");
    }
}

/// Sends `state` to the notification socket `path` (`@name`: abstract).
fn notify_to(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixDatagram};
    let sock = UnixDatagram::unbound()?;
    let addr = match path.as_encoded_bytes().strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt as _;
            UnixAddr::from_abstract_name(name)?
        }
        None => UnixAddr::from_pathname(path)?,
    };
    sock.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn readiness_reaches_a_notification_socket_by_path_and_abstract_name() {
        use std::os::unix::net::UnixDatagram;
        let path = std::env::temp_dir().join(format!("huddle-notify-{}", std::process::id()));
        let _ = fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1\nSTATUS=attached").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=attached");
        fs::remove_file(&path).unwrap();

        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("huddle-notify-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let rx = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
