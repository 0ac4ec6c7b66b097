//! Just enough HTTP/1.x for the huddle: a GET with a deadline and a size
//! cap (metrics scrapes and probes must never hang the daemon or fill its
//! memory), and a one-route-per-path server for `/metrics`.

use anyhow::{bail, Context, Result};
use std::{
    future::Future,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tracing::warn;

/// An `http://host:port/path` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Url {
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url> {
        let rest = s
            .strip_prefix("http://")
            .with_context(|| format!("{s:?}: only http:// URLs are supported"))?;
        let (hostport, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .with_context(|| format!("{s:?}: bad port {p:?}"))?,
            ),
            None => (hostport, 80),
        };
        if host.is_empty() || port == 0 || path.contains(char::is_whitespace) {
            bail!("{s:?} is not a usable http://HOST:PORT/PATH URL");
        }
        Ok(Url {
            host: host.to_string(),
            port,
            path: path.to_string(),
        })
    }
}

/// What a GET brought back.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
    /// From sending the request to the first byte of the answer.
    pub first_byte: Duration,
}

/// Connects to `addr` within `timeout`.
pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| anyhow::anyhow!("connect to {addr} timed out after {timeout:?}"))?
        .with_context(|| format!("connect to {addr}"))
}

/// GET `path` from `addr` (Host: `host`), all within `timeout`, refusing
/// answers over `max_bytes`.
pub async fn get(
    addr: SocketAddr,
    host: &str,
    path: &str,
    timeout: Duration,
    max_bytes: usize,
) -> Result<Response> {
    let deadline = Instant::now() + timeout;
    let stream = connect(addr, timeout).await?;
    let left = deadline.saturating_duration_since(Instant::now());
    tokio::time::timeout(left, exchange(stream, host, path, max_bytes))
        .await
        .map_err(|_| anyhow::anyhow!("GET {path} from {addr}: no full answer within {timeout:?}"))?
}

async fn exchange(
    mut stream: TcpStream,
    host: &str,
    path: &str,
    max_bytes: usize,
) -> Result<Response> {
    let req = format!(
        "GET {path} HTTP/1.0\r\nHost: {host}\r\nUser-Agent: huddle\r\nConnection: close\r\n\r\n"
    );
    let sent = Instant::now();
    stream.write_all(req.as_bytes()).await?;
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 8192];
    let mut first_byte = None;
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        first_byte.get_or_insert_with(|| sent.elapsed());
        if buf.len() + n > max_bytes {
            bail!("answer larger than {max_bytes} bytes");
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let first_byte = first_byte.context("connection closed without an answer")?;
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of HTTP header")?;
    let head = std::str::from_utf8(&buf[..end]).context("HTTP header is not text")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|_| head.starts_with("HTTP/1."))
        .with_context(|| {
            format!(
                "not an HTTP status line: {:?}",
                head.lines().next().unwrap_or("")
            )
        })?;
    Ok(Response {
        status,
        body: buf[end + 4..].to_vec(),
        first_byte,
    })
}

/// Resolves a URL's host and port to one address.
pub async fn resolve(url: &Url) -> Result<SocketAddr> {
    tokio::net::lookup_host((url.host.as_str(), url.port))
        .await
        .with_context(|| format!("resolving {}", url.host))?
        .next()
        .with_context(|| format!("{} has no address", url.host))
}

/// An answer of the server: status, content type, body.
pub type Answer = (u16, &'static str, String);

/// Serves GET requests on `listener` until the task is dropped; `route`
/// maps a path to an answer.
pub async fn serve<F, Fut>(listener: TcpListener, route: F)
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Answer> + Send,
{
    let route = Arc::new(route);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!("metrics listener: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let route = route.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(10), answer(stream, &*route)).await;
        });
    }
}

async fn answer<F, Fut>(mut stream: TcpStream, route: &F) -> Result<()>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Answer>,
{
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await?;
        if n == 0 || buf.len() > 16 * 1024 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf);
    let mut words = line.split_whitespace();
    let (status, ctype, body) = match (words.next(), words.next()) {
        (Some("GET"), Some(path)) => route(path.split('?').next().unwrap_or("/").to_string()).await,
        _ => (405, "text/plain", "only GET\n".into()),
    };
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_say_why_not() {
        assert_eq!(
            Url::parse("http://10.0.0.1:9100/metrics").unwrap(),
            Url {
                host: "10.0.0.1".into(),
                port: 9100,
                path: "/metrics".into()
            }
        );
        assert_eq!(Url::parse("http://node").unwrap().port, 80);
        for bad in [
            "https://x/",
            "ftp://x",
            "http://:80/",
            "http://x:0/",
            "http://x:99999/",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }
}
