//! The balancer announces its VIP through a real bird2 on its host, to a
//! router (a second bird, in the client's namespace) over eBGP: the route
//! comes while the data plane is attached and the service has a healthy
//! backend, goes on `huddle drain-balancer` and comes back on `--undo`,
//! goes before `huddle stop` removes the data plane; a bird that is gone
//! is said in status and the log while the data plane keeps forwarding,
//! and the announcement comes back with bird.

use huddle_user::{cluster::bgp, status::control::Request};
use std::{
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};
use testbed::{
    backend_ip, http_get, in_ns, require_root, start_bird, uplink::Uplink, wait_until, Testbed,
    HTTP_PORT, LB_IP, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

/// Waits until the router has (`want`) or lacks the VIP's route; how long.
fn router_sees(up: &Uplink, want: bool, limit: Duration) -> Duration {
    let t0 = Instant::now();
    wait_until(limit, || up.router_has_vip() == want).unwrap_or_else(|_| {
        panic!(
            "the router {} the VIP's route after {limit:?}",
            if want { "never got" } else { "kept" }
        )
    });
    t0.elapsed()
}

#[test]
fn the_vip_is_announced_while_served_drained_on_demand_and_withdrawn_before_stop() {
    require_root();
    let mut bed = Testbed::plain("bgp", 2).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    let mut up = Uplink::start(&bed).expect("bird");
    let config = bed.dir.join("huddle.toml");
    std::fs::write(
        &config,
        format!(
            "{}\n[[service]]\nvip = \"{VIP}:80\"\nbackends = [\"{}:{HTTP_PORT}\", \"{}:{HTTP_PORT}\"]\n",
            up.bgp_table(),
            backend_ip(0),
            backend_ip(1)
        ),
    )
    .unwrap();
    let t0 = Instant::now();
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &config.display().to_string()],
    )
    .expect("start huddle");
    if wait_until(Duration::from_secs(15), || up.router_has_vip()).is_err() {
        panic!(
            "the router never got the VIP's route:\nrouter: {:?}\n{:?}\nlb: {:?}\nroutes file: {}\nstatus: {}\n{}",
            bgp::bird(&up.router, "show protocols all balancer"),
            bgp::bird(&up.router, "show route"),
            bgp::bird(&up.lb_sock, "show route"),
            std::fs::read_to_string(&up.routes).unwrap_or_default(),
            bed.status().map(|s| s.render()).unwrap_or_default(),
            bed.huddle_log()
        );
    }
    let learned = t0.elapsed();
    println!(
        "the router learned {VIP}/32 via {LB_IP} {:?} after huddle started ({learned:?} of waiting here)",
        t0.elapsed()
    );
    let st = bed.status().unwrap();
    let b = st.bgp.clone().expect("bgp in status");
    assert_eq!(b.announced, vec![VIP.to_string()], "{b:?}");
    assert!(st.render().contains(&format!("bgp: announcing {VIP}")));

    // Drain: withdrawn, the data plane still forwards what arrives.
    let r = bed.control(Request::DrainBalancer { undo: false }).unwrap();
    assert!(r.ok, "{r:?}");
    let gone = router_sees(&up, false, Duration::from_secs(5));
    println!(
        "drain-balancer: the route was gone from the router {gone:?} after the command returned"
    );
    let vip: SocketAddr = (VIP, 80).into();
    in_ns(&bed.client, move || http_get(vip, Duration::from_secs(2)))
        .expect("a drained balancer still forwards");
    let r = bed.control(Request::DrainBalancer { undo: true }).unwrap();
    assert!(r.ok, "{r:?}");
    let back = router_sees(&up, true, Duration::from_secs(5));
    println!("drain-balancer --undo: the route was back {back:?} after the command returned");

    // bird gone: said in status and the log, forwarding goes on; bird
    // back: announced again.
    let _ = up.lb_bird.terminate(Duration::from_secs(5));
    let t1 = Instant::now();
    wait_until(Duration::from_secs(10), || {
        bed.status()
            .ok()
            .and_then(|s| s.bgp)
            .is_some_and(|b| b.error.is_some())
    })
    .unwrap_or_else(|_| panic!("no bgp error in status\n{}", bed.huddle_log()));
    let st = bed.status().unwrap();
    let err = st.bgp.as_ref().unwrap().error.clone().unwrap();
    println!("bird stopped: status said within {:?}: {err}", t1.elapsed());
    assert!(err.contains("bird's control socket"), "{err}");
    assert!(st.render().contains("note: bgp: "));
    in_ns(&bed.client, move || http_get(vip, Duration::from_secs(2)))
        .expect("forwarding goes on without bird");
    // The routes file still says what to announce: a new bird reads it.
    let (_lb_bird2, _) = start_bird(&bed.lb, &bed.dir, "lb", &up.lb_conf).expect("bird");
    let again = router_sees(&up, true, Duration::from_secs(15));
    println!("bird started again: the route was back in {again:?}");
    // bird reads the routes file itself, so the route can come back
    // before the daemon's next check (every RETRY) notices bird again.
    wait_until(Duration::from_secs(10), || {
        bed.huddle_log().contains("bird answers again")
    })
    .unwrap_or_else(|_| panic!("bird back, not said in the log\n{}", bed.huddle_log()));

    // Stop: withdrawn before the data plane goes.
    let socket = bed.socket();
    let pins = bed.pins.clone();
    let stopper = std::thread::spawn(move || {
        huddle_user::daemon::stop::stop(&socket, &pins, &socket.with_extension("state"))
    });
    let withdrawn = router_sees(&up, false, Duration::from_secs(5));
    let still = testbed::xdp_attached(&bed.lb);
    println!(
        "huddle stop: the route left the router {withdrawn:?} after the stop began; the data plane still attached then: {still}"
    );
    assert!(still, "the data plane went before the route");
    stopper.join().unwrap().expect("stop");
    assert!(!testbed::xdp_attached(&bed.lb));
    assert!(bed
        .huddle_log()
        .contains("every VIP withdrawn; removing the data plane"));
}
