//! The cluster plane's credentials. A member's request carries, in
//! `x-huddle-auth`, the time, a fresh nonce and an HMAC-SHA256 over them
//! and the path; the answer carries, in `x-huddle-mac`, an HMAC over that
//! nonce, the path and the body. So a host without the key gets nothing
//! from `/ring`, `/readings` or `/flows`, and one answering at a member's
//! address without it is not believed. A request is taken once: its nonce
//! is remembered as long as its time could pass the skew check, so a
//! request seen on the wire cannot be sent again (`Verifier`). The plane is
//! not encrypted: what a member serves can be read on the wire (keep it on
//! a management network).

use crate::config::key::{hex, unhex, ClusterKey};
use anyhow::{bail, Context, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::{
    collections::{HashSet, VecDeque},
    sync::Mutex,
    time::{Duration, Instant},
};

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

/// Nonces a server remembers at most: about 18 a second from each of 60
/// members (three pages a tick each) over the minute they are kept.
pub const MAX_NONCES: usize = 65_536;

/// A member's checks of the requests it serves: the key, and the nonces of
/// the requests it took, each kept `2 x SKEW_SECS` (a request's time is at
/// most `SKEW_SECS` ahead of ours when it arrives, and is refused once it
/// is `SKEW_SECS` behind), so that a request replayed is refused.
pub struct Verifier {
    key: ClusterKey,
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    order: VecDeque<(Instant, String)>,
    set: HashSet<String>,
}

impl Verifier {
    #[must_use]
    pub fn new(key: ClusterKey) -> Self {
        Self {
            key,
            seen: Mutex::default(),
        }
    }

    /// Checks a request's credentials for `path` and that its nonce is
    /// new; its nonce, to sign the answer with (`sign`).
    pub fn admit(&self, header: Option<&str>, path: &str) -> Result<String> {
        // The MAC first: only a key holder's requests take room.
        let n = check_request(&self.key, header, path)?;
        let now = Instant::now();
        let keep = Duration::from_secs(2 * SKEW_SECS);
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while let Some((at, _)) = seen.order.front() {
            if now.duration_since(*at) <= keep {
                break;
            }
            let (_, old) = seen.order.pop_front().expect("front exists");
            seen.set.remove(&old);
        }
        if seen.set.contains(&n) {
            bail!("cluster credentials already used (a replayed request)");
        }
        if seen.set.len() >= MAX_NONCES {
            bail!("too many cluster requests in {} s", keep.as_secs());
        }
        seen.set.insert(n.clone());
        seen.order.push_back((now, n.clone()));
        Ok(n)
    }

    /// The MAC header value of an answer `body` to the request with `nonce`.
    #[must_use]
    pub fn sign(&self, nonce: &str, path: &str, body: &[u8]) -> String {
        sign_answer(&self.key, nonce, path, body)
    }
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

    /// A request seen on the wire, sent again, is refused; a new one from
    /// the same member is not; one without the key takes no room.
    #[test]
    fn a_replayed_request_is_refused() {
        let v = Verifier::new(key(1));
        let (h, n) = sign_request(&key(1), "/flows");
        assert_eq!(v.admit(Some(&h), "/flows").unwrap(), n);
        let e = format!("{:#}", v.admit(Some(&h), "/flows").unwrap_err());
        assert!(e.contains("already used"), "{e}");
        let (h2, _) = sign_request(&key(1), "/flows");
        v.admit(Some(&h2), "/flows").unwrap();
        let (foreign, _) = sign_request(&key(2), "/flows");
        for _ in 0..3 {
            assert!(v.admit(Some(&foreign), "/flows").is_err());
        }
        assert_eq!(v.seen.lock().unwrap().set.len(), 2);
    }
}
