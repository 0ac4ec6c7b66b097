//! Readings pooled across the balancers of a cluster: each one measures
//! only the flows the router sends it (a third of them with three), so a
//! backend turning slow shows in a third of the samples and takes longer
//! to judge. Every balancer serves its own kernel counters (cumulative,
//! per backend) at `/readings`; each polls the others once a tick and adds
//! what grew since its last poll to its own before the huddle reads them.
//! So the leader decides from all the traffic, as one balancer would.
//!
//! Only the growth counts: a peer first seen, or one whose counters went
//! back (a fresh data plane), adds nothing for that poll, and one that
//! stops answering simply stops adding. Own counters are served raw,
//! never with the peers' added, so nothing is counted twice.

use anyhow::{bail, Result};
use huddle_common::{stats::Counters, BackendStats, Latency, LATENCY_BUCKETS};
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    time::Duration,
};

/// One backend's counters as a balancer's kernel has them (since its
/// data plane was made).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackendReading {
    pub backend: SocketAddr,
    /// `BackendStats`, in the order of `ReadingsAnswer::fields`.
    pub stats: Vec<u64>,
    /// Time-to-first-byte and connect-time histograms (kernel buckets).
    pub ttfb: Vec<u64>,
    pub connect: Vec<u64>,
    /// The part of `ttfb` from the backend's heavy source (`HeavySource`);
    /// empty from a build without it.
    #[serde(default)]
    pub ttfb_heavy: Vec<u64>,
}

/// What `/readings` answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadingsAnswer {
    /// `BackendStats` field names: a peer built with other counters is
    /// refused rather than misread.
    pub fields: Vec<String>,
    /// Service name -> its backends' readings.
    pub services: BTreeMap<String, Vec<BackendReading>>,
}

/// The most a `/readings` answer may weigh.
const MAX_ANSWER: usize = 4 << 20;

/// `BackendStats` field names, in layout order.
#[must_use]
pub fn fields() -> Vec<String> {
    let mut v = Vec::new();
    BackendStats::default().for_each(|n, _| v.push(n.to_string()));
    v
}

/// The reading of `backend` to serve.
#[must_use]
pub fn reading(
    backend: SocketAddr,
    st: &BackendStats,
    ttfb: &Latency,
    heavy: &Latency,
    connect: &Latency,
) -> BackendReading {
    let mut stats = Vec::new();
    st.for_each(|_, v| stats.push(v));
    BackendReading {
        backend,
        stats,
        ttfb: ttfb.buckets.to_vec(),
        connect: connect.buckets.to_vec(),
        ttfb_heavy: heavy.buckets.to_vec(),
    }
}

/// A backend's counters, decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counts {
    pub stats: BackendStats,
    /// All time-to-first-byte samples, and those of the heavy source.
    pub ttfb: Latency,
    pub ttfb_heavy: Latency,
    pub connect: Latency,
}

impl Counts {
    fn decode(r: &BackendReading) -> Option<Counts> {
        let hist = |v: &[u64]| -> Option<Latency> {
            Some(Latency {
                buckets: v.try_into().ok()?,
            })
        };
        Some(Counts {
            stats: BackendStats::from_values(&r.stats)?,
            ttfb: hist(&r.ttfb)?,
            ttfb_heavy: if r.ttfb_heavy.is_empty() {
                Latency::default()
            } else {
                hist(&r.ttfb_heavy)?
            },
            connect: hist(&r.connect)?,
        })
    }

    /// Adds `o` to these.
    pub fn add(&mut self, o: &Counts) {
        self.stats.accumulate(&o.stats);
        self.ttfb.add(&o.ttfb);
        self.ttfb_heavy.add(&o.ttfb_heavy);
        self.connect.add(&o.connect);
    }

    /// What grew from `before` to these; `None` if any counter went back.
    fn growth(&self, before: &Counts) -> Option<Counts> {
        let dh = |n: &Latency, w: &Latency| -> Option<Latency> {
            let mut out = Latency::default();
            for i in 0..LATENCY_BUCKETS {
                out.buckets[i] = n.buckets[i].checked_sub(w.buckets[i])?;
            }
            Some(out)
        };
        Some(Counts {
            stats: self.stats.checked_sub(&before.stats)?,
            ttfb: dh(&self.ttfb, &before.ttfb)?,
            ttfb_heavy: dh(&self.ttfb_heavy, &before.ttfb_heavy)?,
            connect: dh(&self.connect, &before.connect)?,
        })
    }
}

/// Asks member `addr` for its readings.
pub async fn fetch(
    addr: SocketAddr,
    key: &crate::config::key::ClusterKey,
    timeout: Duration,
) -> Result<ReadingsAnswer> {
    let a: ReadingsAnswer =
        crate::cluster::peers::get_json(addr, key, ("/readings", "readings"), timeout, MAX_ANSWER)
            .await?;
    if a.fields != fields() {
        bail!("/readings counts other counters (another huddle version?)");
    }
    Ok(a)
}

/// The other balancers' growth, summed per backend, since this balancer
/// first heard each.
#[derive(Debug, Default)]
pub struct Pool {
    /// Per (peer, service name, backend): its last counters.
    last: HashMap<(SocketAddr, String, SocketAddr), Counts>,
    /// Per service name, per backend: everything the peers added (looked
    /// up by the tick for every backend, without building a key).
    sums: HashMap<String, HashMap<SocketAddr, Counts>>,
}

impl Pool {
    /// Takes `peer`'s answer; returns how many of its backend readings
    /// were unreadable.
    pub fn take(&mut self, peer: SocketAddr, a: &ReadingsAnswer) -> usize {
        let mut bad = 0;
        for (service, readings) in &a.services {
            for r in readings {
                let Some(c) = Counts::decode(r) else {
                    bad += 1;
                    continue;
                };
                let key = (peer, service.clone(), r.backend);
                if let Some(g) = self.last.get(&key).and_then(|b| c.growth(b)) {
                    self.sums
                        .entry(service.clone())
                        .or_default()
                        .entry(r.backend)
                        .or_default()
                        .add(&g);
                }
                self.last.insert(key, c);
            }
        }
        bad
    }

    /// Whether no peer's readings came at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }

    /// What the peers added for `backend` of `service`.
    #[must_use]
    pub fn sum(&self, service: &str, backend: SocketAddr) -> Option<&Counts> {
        self.sums.get(service)?.get(&backend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(answered: u64, bucket: u64) -> ReadingsAnswer {
        let st = BackendStats {
            answered,
            ..Default::default()
        };
        let mut ttfb = Latency::default();
        ttfb.buckets[40] = bucket;
        let b: SocketAddr = "10.0.0.21:80".parse().unwrap();
        ReadingsAnswer {
            fields: fields(),
            services: [(
                "10.0.100.1:80/tcp".to_string(),
                vec![reading(
                    b,
                    &st,
                    &ttfb,
                    &Latency::default(),
                    &Latency::default(),
                )],
            )]
            .into(),
        }
    }

    #[test]
    fn only_growth_since_the_first_poll_is_added_and_a_reset_adds_nothing() {
        let mut p = Pool::default();
        let (a, b) = (
            "10.0.0.1:9477".parse().unwrap(),
            "10.0.0.2:9477".parse().unwrap(),
        );
        let backend = "10.0.0.21:80".parse().unwrap();
        let svc = "10.0.100.1:80/tcp";
        assert_eq!(p.take(a, &answer(1000, 1000)), 0);
        assert!(p.sum(svc, backend).is_none(), "history is not growth");
        p.take(a, &answer(1030, 1030));
        p.take(b, &answer(7, 7));
        p.take(b, &answer(17, 17));
        let s = p.sum(svc, backend).unwrap();
        assert_eq!((s.stats.answered, s.ttfb.buckets[40]), (40, 40));
        // a's data plane was made afresh: its counters went back.
        p.take(a, &answer(5, 5));
        p.take(a, &answer(9, 9));
        let s = p.sum(svc, backend).unwrap();
        assert_eq!(s.stats.answered, 44);
    }

    #[test]
    fn answers_read_back_and_other_counters_or_garbage_do_not() {
        let a = answer(3, 3);
        let text = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<ReadingsAnswer>(&text).unwrap(), a);
        assert!(serde_json::from_str::<ReadingsAnswer>("{}").is_err());
        let mut short = a.clone();
        short.services.values_mut().next().unwrap()[0].stats.pop();
        let mut p = Pool::default();
        assert_eq!(p.take("10.0.0.1:1".parse().unwrap(), &short), 1);
    }

    /// A peer of a build without the heavy-source split sends no
    /// `ttfb_heavy`: its samples all count as the others', none is lost.
    #[test]
    fn a_reading_without_the_heavy_part_reads_as_none_heavy() {
        let mut old = serde_json::to_value(answer(3, 3)).unwrap();
        for r in old["services"]["10.0.100.1:80/tcp"].as_array_mut().unwrap() {
            r.as_object_mut().unwrap().remove("ttfb_heavy");
        }
        let old: ReadingsAnswer = serde_json::from_value(old).unwrap();
        let c = Counts::decode(&old.services["10.0.100.1:80/tcp"][0]).unwrap();
        assert_eq!(c.ttfb.buckets[40], 3);
        assert_eq!(c.ttfb_heavy, Latency::default());
    }
}
