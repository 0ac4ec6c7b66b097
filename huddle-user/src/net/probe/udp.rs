//! A `udp` probe: one datagram, passed by an answer that holds what the
//! service's `expect` says (any answer if it says nothing).

use anyhow::{bail, Context, Result};
use std::{net::SocketAddr, time::Duration, time::Instant};
use tokio::net::UdpSocket;

/// The largest answer read.
const MAX_ANSWER: usize = 64 * 1024;

/// Sends `send` to `addr` and waits for an answer holding `expect`: the
/// time it took. A port nobody listens on answers with an ICMP error,
/// which the connected socket reports as refused.
pub async fn ask(addr: SocketAddr, send: &[u8], expect: &[u8]) -> Result<Duration> {
    let local: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let sock = UdpSocket::bind(local).await.context("UDP socket")?;
    sock.connect(addr)
        .await
        .with_context(|| format!("UDP to {addr}"))?;
    let sent = Instant::now();
    sock.send(send)
        .await
        .with_context(|| format!("sending to {addr}"))?;
    let mut buf = vec![0u8; MAX_ANSWER];
    let n = sock
        .recv(&mut buf)
        .await
        .with_context(|| format!("answer from {addr}"))?;
    let took = sent.elapsed();
    if !expect.is_empty() && !buf[..n].windows(expect.len()).any(|w| w == expect) {
        bail!("the answer ({n} bytes) does not hold the expected text");
    }
    Ok(took)
}
