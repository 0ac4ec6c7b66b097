//! The cluster plane's credentials. A member's request carries, in
//! `x-huddle-auth`, the time, a fresh nonce and an HMAC-SHA256 over them
//! and the path; the answer carries, in `x-huddle-mac`, an HMAC over that
//! nonce, the path and the body. So a host without the key gets nothing
//! from `/ring`, `/readings` or `/flows`, and one answering at a member's
//! address without it is not believed. The plane is not encrypted: what a
//! member serves can be read on the wire (keep it on a management network).

use crate::config::key::{hex, unhex, ClusterKey};
use anyhow::{bail, Context, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Request header: `v1 SECS NONCE MAC`.
pub const AUTH_HEADER: &str = "x-huddle-auth";
/// Answer header: the answer's MAC, hex.
pub const MAC_HEADER: &str = "x-huddle-mac";
/// How far a request's time may be from ours, in seconds (clocks of a
/// cluster's members agree to NTP's precision; this bounds replays).
pub const SKEW_SECS: u64 = 30;

type HmacSha256 = Hmac<Sha256>;

fn mac(key: &ClusterKey, parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes a key of any length.
    let mut m = HmacSha256::new_from_slice(key.bytes()).expect("any key length");
    for p in parts {
        m.update(&(p.len() as u64).to_be_bytes());
        m.update(p);
    }
    m
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh nonce, hex.
fn nonce() -> String {
    let mut raw = [0u8; 16];
    if crate::sys::host::random_bytes(&mut raw).is_err() {
        // Unique per process and call at least.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        raw.copy_from_slice(&(t ^ u128::from(std::process::id())).to_be_bytes());
    }
    hex(&raw)
}

/// A request about to be sent: its header value and its nonce.
#[must_use]
pub fn sign_request(key: &ClusterKey, path: &str) -> (String, String) {
    let (t, n) = (now_secs().to_string(), nonce());
    let m = mac(
        key,
        &[b"request", t.as_bytes(), n.as_bytes(), path.as_bytes()],
    );
    (format!("v1 {t} {n} {}", hex(&m.finalize().into_bytes())), n)
}

/// Checks a request's header for `path`; its nonce, to sign the answer.
pub fn check_request(key: &ClusterKey, header: Option<&str>, path: &str) -> Result<String> {
    let h = header.context("no cluster credentials")?;
    let mut w = h.split(' ');
    let (Some("v1"), Some(t), Some(n), Some(given), None) =
        (w.next(), w.next(), w.next(), w.next(), w.next())
    else {
        bail!("malformed cluster credentials");
    };
    let secs: u64 = t.parse().context("malformed cluster credentials")?;
    if secs.abs_diff(now_secs()) > SKEW_SECS {
        bail!("cluster credentials out of date (clocks more than {SKEW_SECS} s apart?)");
    }
    if n.len() > 64 {
        bail!("malformed cluster credentials");
    }
    let given = unhex(given).context("malformed cluster credentials")?;
    mac(
        key,
        &[b"request", t.as_bytes(), n.as_bytes(), path.as_bytes()],
    )
    .verify_slice(&given)
    .map_err(|_| anyhow::anyhow!("wrong cluster credentials"))?;
    Ok(n.to_string())
}

/// The MAC header value of an answer `body` to the request with `nonce`.
#[must_use]
pub fn sign_answer(key: &ClusterKey, nonce: &str, path: &str, body: &[u8]) -> String {
    let m = mac(key, &[b"answer", nonce.as_bytes(), path.as_bytes(), body]);
    hex(&m.finalize().into_bytes())
}

/// Checks an answer's MAC header.
pub fn check_answer(
    key: &ClusterKey,
    nonce: &str,
    path: &str,
    body: &[u8],
    header: Option<&str>,
) -> Result<()> {
    let given = header
        .and_then(unhex)
        .context("the answer is not signed with the cluster key")?;
    mac(key, &[b"answer", nonce.as_bytes(), path.as_bytes(), body])
        .verify_slice(&given)
        .map_err(|_| anyhow::anyhow!("the answer is not signed with the cluster key"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> ClusterKey {
        ClusterKey::from_hex(&format!("{b:02x}").repeat(32)).unwrap()
    }

    #[test]
    fn only_the_key_holder_asks_and_answers() {
        let (k, other) = (key(1), key(2));
        let (h, n) = sign_request(&k, "/ring");
        assert_eq!(check_request(&k, Some(&h), "/ring").unwrap(), n);
        for (what, key, hdr, path) in [
            ("another key", &other, Some(h.as_str()), "/ring"),
            ("another path", &k, Some(h.as_str()), "/flows"),
            ("none", &k, None, "/ring"),
            ("garbage", &k, Some("v1 x y z"), "/ring"),
            ("short", &k, Some("v1"), "/ring"),
        ] {
            assert!(check_request(key, hdr, path).is_err(), "{what}");
        }
        let old = format!("v1 {} {n} 00", now_secs() - 3600);
        let e = format!("{:#}", check_request(&k, Some(&old), "/ring").unwrap_err());
        assert!(e.contains("out of date"), "{e}");
        let body = br#"{"rings":[]}"#;
        let m = sign_answer(&k, &n, "/ring", body);
        check_answer(&k, &n, "/ring", body, Some(&m)).unwrap();
        assert!(check_answer(&k, &n, "/ring", b"{}", Some(&m)).is_err());
        assert!(check_answer(&k, "other", "/ring", body, Some(&m)).is_err());
        assert!(check_answer(&other, &n, "/ring", body, Some(&m)).is_err());
        assert!(check_answer(&k, &n, "/ring", body, None).is_err());
    }
}
