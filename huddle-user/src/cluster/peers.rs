//! Balancers that share VIPs agree on the rings, so their Maglev tables
//! agree and a connection the router moves keeps its backend. Each
//! balancer serves the rings its own huddle decides at `/ring` on its
//! metrics endpoint; of the members listed in `[cluster]` (the same order
//! everywhere), the first that answers leads, and every other balancer
//! puts the leader's rings into its data plane instead of its own.
//!
//! Failure behaviour: a member that does not answer, or answers what is
//! not rings, is passed over (said in status), so when the leader goes the
//! next one leads within a poll; when no earlier member answers, a
//! balancer decides alone. A leader's ring never empties a follower's: a
//! ring naming no backend the follower knows is ignored (its own is kept).
//! The leader decides from the traffic the router sends it alone.

use crate::{cluster::auth, config::key::ClusterKey, net::http};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

/// Service name (`VIP:PORT/proto`) -> its inner ring, backend addresses in
/// order.
pub type Rings = BTreeMap<String, Vec<SocketAddr>>;

/// What `/ring` answers.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RingsAnswer {
    pub rings: Rings,
}

/// The member whose rings this balancer takes.
#[derive(Clone, Debug, PartialEq)]
pub struct Leader {
    pub addr: SocketAddr,
    pub rings: Rings,
}

/// The most a `/ring` answer may weigh.
const MAX_ANSWER: usize = 1 << 20;

/// The first of `members[..me]` that answers with rings, or `None` (this
/// balancer leads); with what the ones before it did wrong.
pub async fn find_leader(
    members: &[SocketAddr],
    me: usize,
    key: &ClusterKey,
    timeout: Duration,
) -> (Option<Leader>, Vec<String>) {
    let mut problems = Vec::new();
    for m in members.iter().take(me) {
        match fetch(*m, key, timeout).await {
            Ok(rings) => {
                return (Some(Leader { addr: *m, rings }), problems);
            }
            Err(e) => problems.push(format!("{m}: {e:#}")),
        }
    }
    (None, problems)
}

async fn fetch(addr: SocketAddr, key: &ClusterKey, timeout: Duration) -> Result<Rings> {
    let a: RingsAnswer = get_json(addr, key, ("/ring", "rings"), timeout, MAX_ANSWER).await?;
    Ok(a.rings)
}

/// GETs `path` of member `addr` (at most `max` bytes within `timeout`)
/// and reads its JSON answer; the error names the path and, for an
/// answer that is not one, `what` was expected.
/// The request is signed with `key`, and an answer not signed with it is
/// refused (see `auth`).
pub async fn get_json<T: serde::de::DeserializeOwned>(
    addr: SocketAddr,
    key: &ClusterKey,
    (path, what): (&str, &str),
    timeout: Duration,
    max: usize,
) -> Result<T> {
    let (header, nonce) = auth::sign_request(key, path);
    let r = http::get_with(
        addr,
        &addr.to_string(),
        path,
        timeout,
        max,
        &[(auth::AUTH_HEADER, header)],
    )
    .await?;
    if r.status != 200 {
        let why = String::from_utf8_lossy(&r.body[..r.body.len().min(200)]).to_string();
        bail!("{path} answered HTTP {}: {}", r.status, why.trim());
    }
    let mac = r
        .headers
        .get(auth::MAC_HEADER)
        .and_then(|v| v.to_str().ok());
    auth::check_answer(key, &nonce, path, &r.body, mac).with_context(|| path.to_string())?;
    serde_json::from_slice(&r.body).with_context(|| format!("{path} answered no {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn key(b: u8) -> ClusterKey {
        ClusterKey::from_hex(&format!("{b:02x}").repeat(32)).unwrap()
    }

    const RINGS: &str = "{\"rings\":{\"10.0.100.1:80/tcp\":[\"10.0.0.21:80\"]}}";

    /// A member answering every request with what `answer` makes of it
    /// (raw HTTP), on a loopback port; its address.
    fn member(answer: impl Fn(&str) -> String + Send + 'static) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().take(4) {
                let Ok(mut s) = s else { continue };
                let mut buf = [0u8; 2048];
                let n = s.read(&mut buf).unwrap_or(0);
                let _ = s.write_all(answer(&String::from_utf8_lossy(&buf[..n])).as_bytes());
            }
        });
        addr
    }

    fn plain(body: &str) -> String {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    /// Rings signed with `k` for the request's nonce.
    fn signed(k: &ClusterKey, req: &str) -> String {
        let auth = req
            .lines()
            .find_map(|l| l.strip_prefix("x-huddle-auth: "))
            .map(str::trim);
        match auth::check_request(k, auth, "/ring") {
            Ok(nonce) => format!(
                "HTTP/1.1 200 OK\r\nx-huddle-mac: {}\r\nContent-Length: {}\r\n\r\n{RINGS}",
                auth::sign_answer(k, &nonce, "/ring", RINGS.as_bytes()),
                RINGS.len()
            ),
            Err(e) => format!(
                "HTTP/1.1 401 No\r\nContent-Length: {}\r\n\r\n{e}",
                e.to_string().len()
            ),
        }
    }

    /// Members without the key (answering good rings unsigned, or signed
    /// with another key), and those answering garbage or nothing, are
    /// passed over; the first that signs with the cluster's key leads.
    #[test]
    fn members_without_the_key_or_with_garbage_are_passed_over() {
        let k = key(7);
        let garbage = member(|_| plain("garbage"));
        let not_found = member(|_| "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".into());
        let unsigned = member(|_| plain(RINGS));
        let other_key = member(|r| signed(&key(8), r));
        let good = member(move |r| signed(&key(7), r));
        // Nothing listens here.
        let gone: SocketAddr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let me: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let t = Duration::from_millis(500);
        let all = [gone, garbage, not_found, unsigned, other_key, good, me];
        let (leader, problems) = rt.block_on(find_leader(&all, 6, &k, t));
        let leader = leader.expect("the member answering signed rings leads");
        assert_eq!(leader.addr, good);
        assert_eq!(
            leader.rings["10.0.100.1:80/tcp"],
            vec!["10.0.0.21:80".parse().unwrap()]
        );
        assert_eq!(problems.len(), 5, "{problems:?}");
        assert!(problems[1].contains("not signed"), "{problems:?}");
        assert!(problems[2].contains("HTTP 404"), "{problems:?}");
        assert!(problems[3].contains("not signed"), "{problems:?}");
        assert!(
            problems[4].contains("wrong cluster credentials"),
            "{problems:?}"
        );
        // The first member decides alone, whatever the others say.
        let (leader, problems) = rt.block_on(find_leader(&[me, good], 0, &k, t));
        assert!(leader.is_none() && problems.is_empty());
        // Nobody before it answers: alone, saying why.
        let (leader, problems) = rt.block_on(find_leader(&[gone, garbage, me], 2, &k, t));
        assert!(leader.is_none());
        assert_eq!(problems.len(), 2, "{problems:?}");
    }

    #[test]
    fn the_answer_reads_back() {
        let mut rings = Rings::new();
        rings.insert(
            "10.0.100.1:8080/tcp".into(),
            vec!["10.0.0.21:8080".parse().unwrap()],
        );
        let a = RingsAnswer { rings };
        let text = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<RingsAnswer>(&text).unwrap(), a);
        assert!(serde_json::from_str::<RingsAnswer>("garbage").is_err());
    }
}
