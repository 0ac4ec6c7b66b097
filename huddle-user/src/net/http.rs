//! HTTP for the huddle, on hyper: a GET with a deadline and a size cap
//! (metrics scrapes and probes must never hang the daemon or fill its
//! memory), and a one-route-per-path server for `/metrics` and the agent.
//! Only the URL form we accept is ours.

use crate::{
    config::url::Url,
    net::admission::{self, Admissions},
};
use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, Limited};
use hyper::{body::Incoming, header, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use std::{
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::net::{TcpListener, TcpStream};
use tracing::warn;

/// What a GET brought back.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
    /// From sending the request to the first byte of the answer.
    pub first_byte: Duration,
    pub headers: hyper::HeaderMap,
}

/// A request as the server's route sees it.
pub struct Asked {
    pub path: String,
    pub headers: hyper::HeaderMap,
}

impl Asked {
    /// The value of header `name`, if it is text.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// An answer, with headers to send beside it.
pub struct Reply {
    pub answer: Answer,
    pub headers: Vec<(&'static str, String)>,
}

impl From<Answer> for Reply {
    fn from(answer: Answer) -> Reply {
        Reply {
            answer,
            headers: Vec::new(),
        }
    }
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
    get_with(addr, host, path, timeout, max_bytes, &[]).await
}

/// `get`, with `headers` added to the request.
pub async fn get_with(
    addr: SocketAddr,
    host: &str,
    path: &str,
    timeout: Duration,
    max_bytes: usize,
    headers: &[(&'static str, String)],
) -> Result<Response> {
    let deadline = Instant::now() + timeout;
    let stream = connect(addr, timeout).await?;
    let left = deadline.saturating_duration_since(Instant::now());
    tokio::time::timeout(left, exchange(stream, host, path, max_bytes, headers))
        .await
        .map_err(|_| anyhow::anyhow!("GET {path} from {addr}: no full answer within {timeout:?}"))?
}

/// Ends the task driving a client connection when the exchange is over,
/// also when its deadline dropped it half way (a hung server must not keep
/// a task alive).
pub(crate) struct Abort(tokio::task::JoinHandle<()>);

impl Abort {
    /// Drives connection `conn` on a task of its own until dropped.
    pub(crate) fn drive<C: Future + Send + 'static>(conn: C) -> Abort {
        Abort(tokio::spawn(async move {
            let _ = conn.await;
        }))
    }
}

impl Drop for Abort {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn exchange(
    stream: TcpStream,
    host: &str,
    path: &str,
    max_bytes: usize,
    headers: &[(&'static str, String)],
) -> Result<Response> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("HTTP handshake")?;
    let _conn = Abort::drive(conn);
    let mut req = Request::get(path)
        .header(header::HOST, host)
        .header(header::USER_AGENT, "huddle");
    for (k, v) in headers {
        req = req.header(*k, v.as_str());
    }
    let req = req
        .body(Empty::<Bytes>::new())
        .context("building the request")?;
    let sent = Instant::now();
    let resp = sender
        .send_request(req)
        .await
        .context("not an HTTP answer")?;
    let first_byte = sent.elapsed();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = Limited::new(resp.into_body(), max_bytes)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                anyhow::anyhow!("answer larger than {max_bytes} bytes")
            } else {
                anyhow::anyhow!("reading the answer: {e}")
            }
        })?
        .to_bytes()
        .to_vec();
    Ok(Response {
        status,
        body,
        first_byte,
        headers,
    })
}

/// Resolves a URL's host and port to one address.
pub async fn resolve(url: &Url) -> Result<SocketAddr> {
    let name = url.host.trim_start_matches('[').trim_end_matches(']');
    tokio::net::lookup_host((name, url.port))
        .await
        .with_context(|| format!("resolving {}", url.host))?
        .next()
        .with_context(|| format!("{} has no address", url.host))
}

/// An answer of the server: status, content type, body.
pub type Answer = (u16, &'static str, String);

/// How much the server gives its clients: connections at once in all and
/// per source address, and how long a connection may take to send its
/// request head and to be done.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub total: usize,
    pub per_source: usize,
    pub head: Duration,
    pub whole: Duration,
}

/// What `serve` allows: enough for Prometheus, a cluster's members and an
/// operator, not for a flood of idle connections to hold the daemon's
/// descriptors (probes then fail with EMFILE and every backend would look
/// unhealthy).
pub const LIMITS: Limits = Limits {
    total: 256,
    per_source: 16,
    head: Duration::from_secs(2),
    whole: Duration::from_secs(10),
};

/// Serves GET requests on `listener` until the task is dropped, within
/// `LIMITS`; `route` maps a path to an answer.
pub async fn serve<F, Fut>(listener: TcpListener, route: F)
where
    F: Fn(Asked) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send,
{
    serve_within(listener, LIMITS, route).await;
}

/// `serve` within `limits`. A connection past a limit is closed at once
/// (said once a minute at most); one that sends no request head within
/// `limits.head` is closed.
pub async fn serve_within<F, Fut>(listener: TcpListener, limits: Limits, route: F)
where
    F: Fn(Asked) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send,
{
    let route = Arc::new(route);
    let places = Admissions::new(limits.total, limits.per_source);
    let mut said: Option<Instant> = None;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!("HTTP listener: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let admitted = match places.admit(peer.ip()) {
            Ok(a) => a,
            Err(full) => {
                if said.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    said = Some(Instant::now());
                    let (n, what) = match full {
                        admission::Full::Total => (limits.total, "connections in all"),
                        admission::Full::PerKey => {
                            (limits.per_source, "connections from one address")
                        }
                    };
                    warn!(
                        "HTTP listener: closing connections from {} and others past the limit of {n} {what}",
                        peer.ip()
                    );
                }
                continue;
            }
        };
        let route = route.clone();
        tokio::spawn(async move {
            let _admitted = admitted;
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let route = route.clone();
                async move {
                    let reply = if req.method() == Method::GET {
                        let asked = Asked {
                            path: req.uri().path().to_string(),
                            headers: req.headers().clone(),
                        };
                        route(asked).await
                    } else {
                        (405, "text/plain", "only GET\n".to_string()).into()
                    };
                    let (status, ctype, body) = reply.answer;
                    let mut resp = hyper::Response::builder()
                        .status(
                            StatusCode::from_u16(status)
                                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                        )
                        .header(header::CONTENT_TYPE, ctype);
                    for (k, v) in &reply.headers {
                        resp = resp.header(*k, v.as_str());
                    }
                    let resp = resp.body(Full::new(Bytes::from(body))).unwrap_or_default();
                    Ok::<_, Infallible>(resp)
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.head)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(limits.whole, conn).await;
        });
    }
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
        let v6 = Url::parse("http://[fd00::11]:9100/metrics").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("[fd00::11]", 9100));
        assert_eq!(Url::parse("http://[fd00::11]/").unwrap().port, 80);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        assert_eq!(
            rt.block_on(resolve(&v6)).unwrap(),
            "[fd00::11]:9100".parse().unwrap()
        );
        for bad in [
            "http://[fd00::11:9100/",
            "http://[node]:80/",
            "https://x/",
            "ftp://x",
            "http://:80/",
            "http://x:0/",
            "http://x:99999/",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn idle_connections_past_a_limit_are_closed_and_the_rest_time_out() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let limits = Limits {
                total: 4,
                per_source: 2,
                head: Duration::from_millis(300),
                whole: Duration::from_secs(2),
            };
            tokio::spawn(serve_within(listener, limits, |_| async {
                (200, "text/plain", "ok\n".to_string()).into()
            }));
            // Closed: read gives 0 bytes (or a reset) within `within`.
            async fn closed(s: &mut TcpStream, within: Duration) -> bool {
                let mut b = [0u8; 16];
                matches!(
                    tokio::time::timeout(within, s.read(&mut b)).await,
                    Ok(Ok(0) | Err(_))
                )
            }
            let mut idle = Vec::new();
            for _ in 0..2 {
                idle.push(TcpStream::connect(addr).await.unwrap());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut third = TcpStream::connect(addr).await.unwrap();
            assert!(
                closed(&mut third, Duration::from_millis(200)).await,
                "a third connection from one address is closed at once"
            );
            for s in &mut idle {
                assert!(!closed(s, Duration::from_millis(100)).await, "still open");
            }
            for s in &mut idle {
                assert!(
                    closed(s, Duration::from_secs(1)).await,
                    "an idle connection is closed once its head is late"
                );
            }
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let mut answer = String::new();
            s.read_to_string(&mut answer).await.unwrap();
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        });
    }
}
