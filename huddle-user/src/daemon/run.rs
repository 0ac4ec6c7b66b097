//! `huddle run`: a short list of phases. Preflight checks the host and
//! the backends, the listeners are bound, the data plane is started (or
//! taken over), the tasks run until a signal or `huddle stop`, and the
//! shutdown either leaves the data plane forwarding or removes it all.

use super::{
    balancer::{lock, Balancer, Reloader},
    cluster::WITHDRAW_GRACE,
    control::{bind_control, SocketFile},
    preflight,
    start::{self, Pinned},
    tasks::{self, Handles},
};
use crate::{config::Config, kernel::dataplane};
use anyhow::{Context, Result};
use std::sync::{Arc, Mutex};
use tokio::{
    net::TcpListener,
    signal::unix::{signal, SignalKind},
    sync::Notify,
    task::JoinHandle,
};
use tracing::{info, warn};

/// Runs the balancer until SIGINT or SIGTERM (or `huddle stop`); SIGHUP
/// reloads the configuration through `reloader`.
pub async fn run(cfg: Config, reloader: Option<Reloader>) -> Result<()> {
    let facts = preflight::host(&cfg).map_err(|e| cfg.placed(e))?;
    let control = bind_control(&cfg.control_socket)?;
    let _socket_file = SocketFile(cfg.control_socket.clone());
    let metrics = bind_metrics(&cfg).await?;
    preflight::backends(&cfg).map_err(|e| cfg.placed(e))?;
    let (mut balancer, pinned) = start::start(&cfg, &facts, reloader)?;
    let stop = balancer.life.stop.clone();
    let handles = Handles {
        sweeper: balancer.dp.take_sweeper(),
        flow_book: match balancer.dp.flow_map() {
            Ok(m) => Some(crate::cluster::handoff::FlowBook::new(m)),
            Err(e) => {
                warn!("no flow sharing with the cluster: {e:#}");
                None
            }
        },
        bgp: balancer.cluster.bgp.clone(),
    };
    let bgp = handles.bgp.clone();
    let shared = Arc::new(Mutex::new(balancer));
    let tasks = tasks::spawn(&cfg, &shared, control, metrics, handles)?;
    wait(&shared, &stop).await?;
    stop_tasks(tasks).await;
    shutdown(&cfg, shared, pinned, bgp).await
}

/// The metrics listener, unless it is off.
async fn bind_metrics(cfg: &Config) -> Result<Option<TcpListener>> {
    Ok(match cfg.huddle.listen {
        Some(addr) => Some(TcpListener::bind(addr).await.with_context(|| {
            format!("binding the metrics endpoint {addr} (set huddle.listen, or \"off\")")
        })?),
        None => None,
    })
}

/// Until SIGTERM, SIGINT or `huddle stop`; SIGHUP reloads on the way.
async fn wait(shared: &Arc<Mutex<Balancer>>, stop: &Notify) -> Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => { info!("SIGTERM"); break; }
            _ = int.recv() => { info!("SIGINT"); break; }
            () = stop.notified() => { info!("stop requested"); break; }
            _ = hup.recv() => {
                info!("SIGHUP: reloading the configuration");
                crate::sys::systemd::sd_notify("RELOADING=1");
                match lock(shared).reload() {
                    Ok(m) => info!(event = "reload", "{m}"),
                    Err(e) => warn!(event = "reload_refused", error = %format!("{e:#}"), "{e:#}"),
                }
                crate::sys::systemd::sd_notify("READY=1");
            }
        }
    }
    Ok(())
}

async fn stop_tasks(tasks: Vec<JoinHandle<()>>) {
    crate::sys::systemd::sd_notify("STOPPING=1");
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// Leaves the data plane forwarding for the next start, or (`huddle stop`,
/// `--detach-on-exit`, pins that die with us) withdraws the VIPs and
/// removes it all.
async fn shutdown(
    cfg: &Config,
    shared: Arc<Mutex<Balancer>>,
    pinned: Pinned,
    bgp: Option<Arc<Mutex<crate::cluster::bgp::Announcer>>>,
) -> Result<()> {
    let Pinned {
        mut sysctls,
        place,
        pins,
        shown,
    } = pinned;
    let remove = cfg.detach_on_exit || lock(&shared).life.remove_on_exit;
    if !remove && place.survives {
        lock(&shared).save_state_and_walk(true);
        sysctls.keep();
        info!(
            "exiting; the data plane keeps running on {} (pinned under {}); `huddle run` again takes it over, `huddle stop --iface {}` removes it",
            cfg.interface,
            shown.display(),
            cfg.interface
        );
        return Ok(());
    }
    if !remove {
        info!(
            "exiting; the pins die with this process's mount namespace, so the data plane on {} goes with it",
            cfg.interface
        );
    }
    // The router must stop sending here before the data plane goes.
    if let Some(b) = &bgp {
        let withdrawn = lock(b).withdraw_all();
        match withdrawn {
            Ok(()) => {
                info!(
                    event = "bgp",
                    "bgp: every VIP withdrawn; removing the data plane in {} ms",
                    WITHDRAW_GRACE.as_millis()
                );
                tokio::time::sleep(WITHDRAW_GRACE).await;
            }
            Err(e) => warn!(event = "bgp", "bgp: withdrawing before removal: {e:#}"),
        }
    }
    lock(&shared).save_nat_walk(true);
    // Unpin first, then close our descriptors: the link goes with the last.
    match dataplane::unpin(&pins) {
        Ok(n) => info!("removed {n} pinned objects under {}", shown.display()),
        Err(e) => warn!("{e:#}"),
    }
    match Arc::try_unwrap(shared) {
        Ok(m) => drop(m.into_inner()),
        Err(_) => warn!("control connections still open; the program detaches as they close"),
    }
    drop(sysctls);
    let _ = std::fs::remove_file(&cfg.state_file);
    info!(
        "detached from {}; maps freed and sysctls restored",
        cfg.interface
    );
    Ok(())
}
