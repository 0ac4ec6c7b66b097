//! The `http://` URLs a config names (backends' metrics pages), parsed
//! when the config is read so a bad one names its field.

use anyhow::{bail, Context, Result};

/// An `http://host:port/path` URL (an IPv6 host in brackets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Url {
    /// As written, brackets kept: what the Host header carries.
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
            Some((h, p)) if !hostport.ends_with(']') => (
                h,
                p.parse::<u16>()
                    .with_context(|| format!("{s:?}: bad port {p:?}"))?,
            ),
            _ => (hostport, 80),
        };
        if host.is_empty() || port == 0 || path.contains(char::is_whitespace) {
            bail!("{s:?} is not a usable http://HOST:PORT/PATH URL");
        }
        if host.starts_with('[')
            && host
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .and_then(|h| h.parse::<std::net::Ipv6Addr>().ok())
                .is_none()
        {
            bail!("{s:?}: {host} is not an IPv6 address in brackets");
        }
        Ok(Url {
            host: host.to_string(),
            port,
            path: path.to_string(),
        })
    }
}
