//! The daemon's periodic tasks: the tick, probes, scrapes, the state file
//! and the idle UDP sweep.

use super::{
    balancer::{lock, try_lock, Balancer},
    cluster::{announcer, follower, handoff, pool},
    control::serve,
    pages,
    snapshot::Snapshots,
};
use crate::config::Config;
use crate::kernel::dataplane::walk;
use crate::sys::host;
use anyhow::bail;
use anyhow::Result;
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::{
    net::{TcpListener, UnixListener},
    task::JoinHandle,
};
use tracing::{debug, info, warn};

/// Backends whose state the saver writes a second, at most.
const STATE_BACKENDS: usize = 4_096;

/// Writes the state file every second, or less often past
/// `STATE_BACKENDS` (and `tick` after any rotation), the NAT walk each
/// second it moved, and moves the next-hop generation on so every CPU asks the
/// FIB again.
pub(super) async fn saver(shared: Arc<Mutex<Balancer>>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut unresolved = 0;
    let mut round: u64 = 0;
    // The NAT walk as last written: an idle balancer's does not move; and
    // the raw cursors it was built from, so an unmoved walk is not built.
    let mut written: Option<walk::NatWalk> = None;
    let mut cursors = None;
    // Packets the program sent on, as of the last cursor read: a walk
    // moves only with a new flow, which sends its first packet on.
    let mut forwarded_at_read = None;
    loop {
        tick.tick().await;
        round += 1;
        let (now, path) = {
            let mut b = lock(&shared);
            // The state file once every backends / `STATE_BACKENDS` seconds:
            // rotations are saved at once (`tick`), so a later write adds only
            // temperatures, and at 65,536 backends writing it every second was
            // a sixth of an idle daemon's time.
            let backends: usize = b.huddles.iter().map(|h| h.trackers.len()).sum();
            if round.is_multiple_of((backends / STATE_BACKENDS).max(1) as u64) {
                b.save_state();
            }
            if let Err(e) = b.dp.refresh_next_hops() {
                warn!("{e:#}");
            }
            // L2 DSR cannot hand a packet to the kernel to resolve its next
            // hop (the kernel would route it by its VIP): resolve it here.
            let global = b.dp.global_stats().ok();
            if let Some(g) = &global {
                if g.drop_no_neigh != unresolved {
                    unresolved = g.drop_no_neigh;
                    crate::sys::addresses::warm_neighbours(&b.backend_addrs());
                }
            }
            // Nothing sent on since the last read (an idle balancer): the
            // cursors of 65,536 backends (a per-CPU read each second, a
            // tenth of such a daemon's time) are not read.
            let forwarded = global.map(|g| {
                [g.tx, g.redirect, g.pass_no_neigh, g.pass_no_route, g.encap]
                    .iter()
                    .fold(0u64, |s, x| s.wrapping_add(*x))
            });
            if forwarded.is_some() && forwarded == forwarded_at_read && written.is_some() {
                continue;
            }
            // The NAT walk read under the lock, written (and synced) after
            // it (a write held the tick up for as long as the disk took),
            // and only when it moved: an idle balancer's does not. (A
            // reload that gives an unmoved slot another address is saved
            // with the next move; a backend missing from the file starts
            // where the clock says, `start_cursor`.)
            let read = b.dp.nat_cursors();
            forwarded_at_read = forwarded;
            if read.is_some() && read == cursors && written.is_some() {
                continue;
            }
            cursors = read;
            (b.dp.nat_walk(), walk::nat_walk_file(&b.cfg.state_file))
        };
        if written.as_ref() != Some(&now) {
            let w = now.clone();
            match tokio::task::spawn_blocking(move || walk::save_nat_walk(&path, &w)).await {
                Ok(Ok(())) => written = Some(now),
                Ok(Err(e)) => warn!("{e:#}"),
                Err(e) => warn!("saving the NAT walk: {e}"),
            }
        }
    }
}

/// Every second, removes the established UDP flows silent past their
/// service's `udp_idle_ms` (on a blocking thread, without the lock: a
/// large flow table takes a while to walk).
pub(super) async fn sweep_idle(
    shared: Arc<Mutex<Balancer>>,
    sweeper: Option<crate::kernel::dataplane::sweep::Sweeper>,
) {
    let Some(mut sweeper) = sweeper else {
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let idle: std::collections::HashMap<u32, u64> = {
            let b = lock(&shared);
            b.cfg
                .services
                .iter()
                .zip(&b.dp.services)
                .filter(|(s, _)| s.proto == crate::config::Proto::Udp)
                .map(|(s, slot)| (slot.id, s.udp_idle.as_nanos() as u64))
                .collect()
        };
        if idle.is_empty() {
            continue;
        }
        let now = host::monotonic_ns();
        let done = tokio::task::spawn_blocking(move || {
            let r = sweeper.sweep(now, &idle);
            (sweeper, r)
        })
        .await;
        match done {
            Ok((s, r)) => {
                sweeper = s;
                match r {
                    Ok(0) => {}
                    Ok(n) => debug!("removed {n} idle UDP flows"),
                    Err(e) => warn!("sweeping idle UDP flows: {e:#}"),
                }
            }
            Err(e) => {
                warn!("the idle UDP sweep stopped: {e}");
                return;
            }
        }
    }
}

/// The huddle's tick, every `every`, and the snapshot readers asked for
/// since the last one.
pub(super) async fn ticker(
    shared: Arc<Mutex<Balancer>>,
    snapshots: Arc<Snapshots>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut b = lock(&shared);
        b.tick();
        snapshots.take_if_wanted(&b);
    }
}

/// Probes the backends the planner picks, every `p.interval`, handing
/// each result over as it comes. A slow answer from a backend judged on
/// its probes gets a second probe `CONFIRM_AFTER` later, from what the
/// round leaves of the budget (`ServiceHuddle::wants_confirming`).
pub(super) async fn prober(shared: Arc<Mutex<Balancer>>, p: crate::config::Probe) {
    let mut tick = tokio::time::interval(p.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let budget = crate::huddle::probing::Budget {
        interval: p.interval,
        active_interval: p.active_interval,
        max_per_second: p.max_per_second,
        idle_per_second: p.idle_per_second,
    };
    let mut planner = crate::huddle::probing::Planner::default();
    let start = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        let targets = lock(&shared).probe_targets();
        let wants: Vec<(crate::huddle::probing::Key, crate::huddle::probing::Need)> =
            targets.iter().map(|t| (t.key(), t.need)).collect();
        let chosen = planner.plan_indices(&wants, start.elapsed(), &budget);
        let sends: Vec<(SocketAddr, Arc<crate::config::Probe>)> = chosen
            .iter()
            .map(|&i| (targets[i].addr, targets[i].probe.clone()))
            .collect();
        let mut set = crate::net::probe::Probes::new();
        // Spread over most of the round, so the next finds it done.
        crate::net::probe::start_spread(&mut set, &sends, p.interval * 3 / 4);
        let mut sent = chosen.len() as u64;
        let mut confirms = budget.per_round().saturating_sub(chosen.len());
        let mut ready = Vec::new();
        loop {
            if ready.is_empty() {
                match set.join_next().await {
                    Some(r) => ready.push(r),
                    None => break,
                }
            } else if !set.is_empty() {
                // The lock was busy: another result, or a try again soon.
                tokio::select! {
                    r = set.join_next() => ready.extend(r),
                    () = tokio::time::sleep(LOCK_RETRY) => {}
                }
            }
            while let Some(more) = set.try_join_next() {
                ready.push(more);
            }
            // Never waits for the lock with probes in flight: a worker
            // blocked on it polls none of them. Measured (hc-scale 256 x
            // 256, rotations a run, mostly healthy backends rested on
            // probes of 6-68 ms against a ring of 2-4 ms): results at the
            // round's end 11-56; as they came, waiting for the lock,
            // 80-438; as they came, only when the lock is free, 9-99.
            let held = if set.is_empty() {
                Some(lock(&shared))
            } else {
                try_lock(&shared)
            };
            let Some(mut b) = held else { continue };
            b.seen.probes_sent += std::mem::take(&mut sent);
            for (tag, r) in ready.drain(..).flatten() {
                // Tags from `chosen.len()` on confirm `tag - chosen.len()`.
                let (k, confirming) = match tag.checked_sub(chosen.len()) {
                    Some(k) => (k, true),
                    None => (tag, false),
                };
                let again = hand_over(&mut b, planner.sharing(chosen[k]), &targets, &r);
                if again && !confirming && confirms > 0 {
                    confirms -= 1;
                    sent += 1;
                    crate::net::probe::start_one(
                        &mut set,
                        chosen.len() + k,
                        sends[k].0,
                        sends[k].1.clone(),
                        CONFIRM_AFTER,
                    );
                }
            }
        }
    }
}

/// Hands probe result `r` to the targets `sharing` its address (indices
/// into `targets`: not a look-up for each of 65,536 targets), each if a
/// reload has not moved it. Whether one of them wants it confirmed
/// (`ServiceHuddle::wants_confirming`), asked before it is handed over.
fn hand_over(
    b: &mut Balancer,
    sharing: &[u32],
    targets: &[super::balancer::ProbeTarget],
    r: &crate::net::probe::ProbeResult,
) -> bool {
    let mut again = false;
    for &j in sharing {
        let t = &targets[j as usize];
        let (si, bi, a) = (t.si, t.bi, t.addr);
        let same = b.cfg.services.get(si).and_then(|s| s.backends.get(bi)) == Some(&a);
        if !same || b.huddles.get(si).is_none_or(|h| bi >= h.trackers.len()) {
            continue;
        }
        again |=
            r.error.is_none() && b.huddles[si].wants_confirming(bi, r.latency_ms, &b.cfg.huddle);
        b.huddles[si].trackers[bi].probed(r.clone());
        b.stir(si, bi);
    }
    again
}

/// How long after a slow probe answer its confirmation is sent: past a
/// moment's stall (a busy scheduler, a first connect's ARP), well inside
/// the round. Measured at 4,096 x 16 (`hc-scale`, 5x slow leave): 30 ms
/// 420-609 ms over five runs, 100 ms 433-584 over three; the longer wait
/// costs nothing there and lets a stall of the host pass.
const CONFIRM_AFTER: Duration = Duration::from_millis(100);

/// How soon the prober tries the balancer's lock again when it was busy.
const LOCK_RETRY: Duration = Duration::from_millis(5);

/// Largest metrics page read from a backend.
const MAX_METRICS_BYTES: usize = 4 << 20;

/// Scrapes every backend's metrics URL concurrently, every `every`.
pub(super) async fn scraper(shared: Arc<Mutex<Balancer>>, every: Duration, timeout: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let targets = lock(&shared).scrape_targets();
        if targets.is_empty() {
            continue;
        }
        let mut set = tokio::task::JoinSet::new();
        for (i, (_, _, url, vip)) in targets.iter().enumerate() {
            let (url, vip) = (url.clone(), vip.clone());
            set.spawn(async move {
                let r = async {
                    let u = crate::config::url::Url::parse(&url)?;
                    let addr = tokio::time::timeout(timeout, crate::net::http::resolve(&u))
                        .await
                        .map_err(|_| anyhow::anyhow!("resolving {} timed out", u.host))??;
                    let resp = crate::net::http::get(addr, &u.host, &u.path, timeout, MAX_METRICS_BYTES)
                        .await?;
                    if resp.status != 200 {
                        bail!("HTTP status {}", resp.status);
                    }
                    let text = String::from_utf8_lossy(&resp.body);
                    let sample = crate::net::scrape::parse(&text);
                    if sample.cpu_total_s.is_none() && sample.mem_total.is_none() {
                        bail!("no usable node_cpu_seconds_total or node_memory_* values in the answer");
                    }
                    Ok((sample, crate::net::scrape::agent_ttfb(&text, &vip)))
                }
                .await;
                (
                    i,
                    r.map_err(|e: anyhow::Error| format!("metrics {url}: {e:#}")),
                )
            });
        }
        let mut results = Vec::new();
        while let Some(r) = set.join_next().await {
            if let Ok(r) = r {
                results.push(r);
            }
        }
        let mut b = lock(&shared);
        for (i, r) in results {
            let (si, bi, _, _) = &targets[i];
            let dsr = b.cfg.services[*si].mode.is_dsr();
            let min_samples = b.cfg.huddle.min_samples;
            b.stir(*si, *bi);
            let t = &mut b.huddles[*si].trackers[*bi];
            match r {
                Ok((sample, agent)) => {
                    t.host.update(sample);
                    t.host_error = None;
                    if dsr {
                        t.agent_scraped(agent, min_samples);
                    }
                }
                Err(e) => {
                    if t.host_error.is_none() {
                        warn!("{e}; its cpu and memory count as unknown (0)");
                    }
                    t.host.clear();
                    t.host_error = Some(e);
                }
            }
        }
    }
}

/// How often backend neighbours are refreshed in the kernel's cache.
const NEIGHBOUR_REFRESH: Duration = Duration::from_secs(15);

/// What the tasks are handed at start, taken out of the balancer.
pub(super) struct Handles {
    pub sweeper: Option<crate::kernel::dataplane::sweep::Sweeper>,
    pub flow_book: Option<crate::cluster::handoff::FlowBook>,
    pub bgp: Option<Arc<Mutex<crate::cluster::bgp::Announcer>>>,
}

/// Starts every task of a running balancer: the control socket, the
/// neighbour refresh, the tick, the state file, the idle sweep, probes,
/// scrapes, the cluster's and BGP's tasks and the HTTP listener.
pub(super) fn spawn(
    cfg: &Config,
    shared: &Arc<Mutex<Balancer>>,
    control: UnixListener,
    metrics: Option<TcpListener>,
    handles: Handles,
) -> Result<Vec<JoinHandle<()>>> {
    let backends = lock(shared).backend_addrs();
    let Handles {
        sweeper,
        flow_book,
        bgp,
    } = handles;
    let snapshots = Arc::new(Snapshots::new(cfg.huddle.tick));
    let (asks, asked) = tokio::sync::mpsc::unbounded_channel();
    lock(shared).asks = Some(asks);
    let mut tasks = vec![
        tokio::spawn(super::suspects::asker(shared.clone(), asked)),
        tokio::spawn(serve(control, shared.clone(), snapshots.clone())),
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(NEIGHBOUR_REFRESH);
            loop {
                tick.tick().await;
                crate::sys::addresses::warm_neighbours(&backends);
            }
        }),
        tokio::spawn(ticker(shared.clone(), snapshots.clone(), cfg.huddle.tick)),
        tokio::spawn(saver(shared.clone())),
        tokio::spawn(sweep_idle(shared.clone(), sweeper)),
        tokio::spawn(prober(shared.clone(), cfg.huddle.probe.clone())),
        tokio::spawn(scraper(
            shared.clone(),
            cfg.huddle.scrape_interval,
            cfg.huddle.scrape_timeout,
        )),
    ];
    if let Some(c) = cfg.cluster.clone() {
        tasks.push(tokio::spawn(follower(
            shared.clone(),
            c.clone(),
            cfg.huddle.tick,
        )));
        tasks.push(tokio::spawn(pool(
            shared.clone(),
            c.clone(),
            cfg.huddle.tick,
        )));
        if let Some(book) = flow_book {
            tasks.push(tokio::spawn(handoff(shared.clone(), c, book)));
        }
    }
    if let Some(b) = &bgp {
        tasks.push(tokio::spawn(announcer(
            shared.clone(),
            b.clone(),
            cfg.huddle.tick,
        )));
    }
    if let Some(l) = metrics {
        info!("Prometheus metrics on http://{}/metrics", l.local_addr()?);
        let shared = shared.clone();
        let key = cfg
            .cluster
            .as_ref()
            .map(|c| Arc::new(crate::cluster::auth::Verifier::new(c.key.clone())));
        tasks.push(tokio::spawn(crate::net::http::serve(l, move |asked| {
            let (shared, snapshots, key) = (shared.clone(), snapshots.clone(), key.clone());
            async move { pages::route(&shared, &snapshots, key.as_deref(), &asked).await }
        })));
    }
    Ok(tasks)
}
