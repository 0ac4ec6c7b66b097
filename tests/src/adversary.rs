//! A client out to push one healthy backend out of the ring: it opens a
//! small share of the connections from an address of its own (another
//! /24), asks each which backend it reached, drops those that reached
//! another, and on those that reached its target takes turn after turn
//! made to look slow: dribbled requests (in SNAT, where the balancer sees
//! the answers) or answers whose ACKs it holds back until its next request
//! (in DSR, where the balancer reads the answer from the client's ACK).

use crate::{
    kinds::{answer, connect},
    plug, Testbed, LB_IP,
};
use anyhow::{bail, Result};
use huddle_user::sys::netns::Netns;
use std::{
    io::{BufReader, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

/// The adversary's own address, in a /24 no other client uses.
pub const ADVERSARY_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 7, 2);

/// How each turn on a target connection is made to look slow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trick {
    /// The request line, then the rest 1.5 s later.
    Dribble,
    /// The whole request at once; the client's kernel never sends a pure
    /// ACK (an nft rule drops them), so the answer is acknowledged only by
    /// the next request, sent `HOLD` after the answer came.
    HoldAcks,
    /// As `HoldAcks`, but the ACK is let out late on its own: pure ACKs
    /// are dropped while each answer comes, then allowed again, and the
    /// backend's retransmission of the unacknowledged answer (its RTO,
    /// about 200 ms) draws a pure ACK from the client's kernel, which the
    /// balancer takes as the answer's arrival. What a client crafting its
    /// own segments does at any delay it likes.
    LateAcks,
}

/// How long a held-back ACK waits: 5x the testbed backends' 5 ms, the
/// most samples per connection that still read as a 5x slow backend.
const HOLD: Duration = Duration::from_millis(25);

/// What the adversary did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    pub opened: u64,
    /// Connections that reached the target and were kept.
    pub aimed: u64,
    /// Slow-looking turns answered on them.
    pub turns: u64,
    pub failed: u64,
}

/// The adversary's namespace and clients, until `stop`.
pub struct Adversary {
    stop: Arc<AtomicBool>,
    spawner: Option<thread::JoinHandle<Vec<thread::JoinHandle<()>>>>,
    counts: Arc<[AtomicU64; 4]>,
    // Dropped last.
    _ns: Netns,
}

impl Adversary {
    /// Plugs a host of its own into `bed`'s segment and starts `rate`
    /// connections a second to `vip`, aimed at the backend named `target`
    /// (its answer to `GET /`).
    pub fn start(
        bed: &Testbed,
        vip: SocketAddr,
        target: &str,
        rate: f64,
        trick: Trick,
    ) -> Result<Adversary> {
        let ns = host(bed, trick)?;
        let stop = Arc::new(AtomicBool::new(false));
        let counts: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
        let (flag, c, name, target) = (
            stop.clone(),
            counts.clone(),
            ns.name.clone(),
            target.to_string(),
        );
        let every = Duration::from_secs_f64(1.0 / rate.max(0.01));
        let spawner = thread::spawn(move || {
            let mut conns = Vec::new();
            let start = Instant::now();
            // Bounded: an hour of connections at most.
            for n in 0..(3600.0 * rate) as u64 {
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                let (flag, c, name, target) =
                    (flag.clone(), c.clone(), name.clone(), target.clone());
                conns.push(thread::spawn(move || {
                    if huddle_user::sys::netns::enter(&name).is_err() {
                        c[3].fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    c[0].fetch_add(1, Ordering::Relaxed);
                    if connection(vip, &target, trick, &flag, &c).is_err() {
                        c[3].fetch_add(1, Ordering::Relaxed);
                    }
                }));
                let next = start + every * (n as u32 + 1);
                thread::sleep(next.saturating_duration_since(Instant::now()));
            }
            conns
        });
        Ok(Adversary {
            stop,
            spawner: Some(spawner),
            counts,
            _ns: ns,
        })
    }

    /// Stops every connection (each within its current turn) and tallies.
    pub fn stop(mut self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self.spawner.take() {
            for h in s.join().unwrap_or_default() {
                let _ = h.join();
            }
        }
        let c = |i: usize| self.counts[i].load(Ordering::Relaxed);
        Tally {
            opened: c(0),
            aimed: c(1),
            turns: c(2),
            failed: c(3),
        }
    }
}

/// The adversary's host: on the testbed's segment with an address in a
/// /24 of its own, which the balancer and the backends reach on the link.
fn host(bed: &Testbed, trick: Trick) -> Result<Netns> {
    let prefix = bed.client.name.trim_end_matches("-client");
    let ns = Netns::create(&format!("{prefix}-adv"))?;
    plug(&bed.switch, "pa", &ns, ADVERSARY_IP)?;
    ns.exec("ethtool", &["-K", "eth0", "tx", "off"])?;
    ns.ip(&["route", "add", "10.213.0.0/24", "dev", "eth0"])?;
    ns.ip(&["route", "add", "10.213.100.0/24", "via", &LB_IP.to_string()])?;
    for other in std::iter::once(&bed.lb).chain(&bed.backends) {
        other.ip(&["route", "add", "10.213.7.0/24", "dev", "eth0"])?;
    }
    if trick != Trick::Dribble {
        ns.exec("nft", &["add", "table", "ip", "adv"])?;
        ns.exec(
            "nft",
            &["add chain ip adv out { type filter hook output priority 0 ; }"],
        )?;
        // Segments with only ACK set and no payload (a 20-byte IP header,
        // up to 60 bytes of TCP header with options); `LateAcks` marks
        // its socket while it holds them.
        let only = if trick == Trick::LateAcks {
            "meta mark 1 "
        } else {
            ""
        };
        ns.exec(
            "nft",
            &[&format!(
                "add rule ip adv out {only}tcp flags & (fin|syn|rst|psh|ack) == ack ip length < 81 drop"
            )],
        )?;
    }
    Ok(ns)
}

/// One connection: which backend? Kept and worked only on the target.
fn connection(
    vip: SocketAddr,
    target: &str,
    trick: Trick,
    stop: &AtomicBool,
    c: &[AtomicU64; 4],
) -> Result<()> {
    let mut s = connect(vip)?;
    let mut r = BufReader::new(s.try_clone()?);
    s.write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")?;
    if answer(&mut r)? != target {
        return Ok(());
    }
    c[1].fetch_add(1, Ordering::Relaxed);
    while !stop.load(Ordering::Relaxed) {
        match trick {
            Trick::Dribble => {
                s.write_all(b"GET / HTTP/1.1\r\n")?;
                let until = Instant::now() + Duration::from_millis(1500);
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    thread::sleep(Duration::from_millis(20));
                }
                s.write_all(b"Host: vip\r\n\r\n")?;
            }
            Trick::HoldAcks => {
                thread::sleep(HOLD);
                s.write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")?;
            }
            Trick::LateAcks => {
                mark(&s, 1)?;
                s.write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")?;
            }
        }
        answer(&mut r)?;
        if trick == Trick::LateAcks {
            // The answer is in, its ACK dropped: let the next pure ACK
            // (to the backend's retransmission) out before writing again.
            thread::sleep(HOLD);
            mark(&s, 0)?;
            thread::sleep(Duration::from_millis(300));
        }
        c[2].fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Sets the socket's mark (what the nft rule of `LateAcks` looks for).
fn mark(s: &TcpStream, v: u32) -> Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt on an open socket with a valid u32 option value.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MARK,
            std::ptr::from_ref(&v).cast(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        bail!("SO_MARK: {}", std::io::Error::last_os_error());
    }
    Ok(())
}
