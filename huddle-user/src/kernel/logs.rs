//! Forwards the XDP program's aya-log records to `tracing` (through the
//! `log` bridge tracing-subscriber installs).

use aya_log::EbpfLogger;
use tokio::io::unix::AsyncFd;
use tracing::debug;

/// Reads kernel log records whenever the ring buffer has data. Without a
/// tokio runtime (unit tests, benchmarks) records are simply not read.
pub fn forward(logger: EbpfLogger<&'static dyn log::Log>) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        debug!("no runtime: kernel log records are not forwarded");
        return;
    };
    handle.spawn(async move {
        // SAFETY: the logger owns its ring buffer fd for as long as the
        // AsyncFd owns the logger, so the fd stays open while registered.
        let mut fd = match unsafe { AsyncFd::register(logger) } {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!("kernel log forwarding stopped: {e}");
                return;
            }
        };
        loop {
            let Ok(mut guard) = fd.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}
