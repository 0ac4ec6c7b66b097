//! One HTTP GET over a stream a probe opened (TCP, or TLS over it), in
//! HTTP/1.1 or HTTP/2: the status and the time to the answer's first
//! byte, the body read (up to a cap) so the answer is known complete.

use crate::{config::HttpVersion, net::http::Abort};
use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{body::Incoming, header, Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};

/// The most of an answer's body read: a health page's, not a download.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// GET `path` over `io` from `authority` (the Host header, or HTTP/2's
/// `:authority`; `scheme` is `http` or `https`).
pub async fn get<S>(
    io: S,
    version: HttpVersion,
    scheme: &str,
    authority: &str,
    path: &str,
) -> Result<(u16, Duration)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(io);
    // HTTP/2 names the host in the URI (`:authority`), HTTP/1.1 in Host.
    let req = match version {
        HttpVersion::Http1 => Request::get(path).header(header::HOST, authority),
        HttpVersion::Http2 => Request::get(format!("{scheme}://{authority}{path}")),
    }
    .header(header::USER_AGENT, "huddle-probe")
    .body(Empty::<Bytes>::new())
    .context("building the request")?;
    let (sent, resp, _conn) = match version {
        HttpVersion::Http1 => {
            let (mut tx, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .context("HTTP/1.1 handshake")?;
            let conn = Abort::drive(conn);
            let sent = Instant::now();
            let resp = tx
                .send_request(req)
                .await
                .context("not an HTTP/1.1 answer")?;
            (sent, resp, conn)
        }
        HttpVersion::Http2 => {
            let (mut tx, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .context("HTTP/2 handshake")?;
            let conn = Abort::drive(conn);
            let sent = Instant::now();
            let resp = tx.send_request(req).await.context("not an HTTP/2 answer")?;
            (sent, resp, conn)
        }
    };
    let first_byte = sent.elapsed();
    let status = resp.status().as_u16();
    drain(resp).await?;
    Ok((status, first_byte))
}

/// Reads the body to its end or `MAX_BODY_BYTES`, whichever is first.
async fn drain(resp: Response<Incoming>) -> Result<()> {
    let mut body = resp.into_body();
    let mut got = 0;
    while got < MAX_BODY_BYTES {
        match body.frame().await {
            None => break,
            Some(f) => {
                let f = f.context("reading the answer")?;
                got += f.data_ref().map_or(0, Bytes::len);
            }
        }
    }
    Ok(())
}
