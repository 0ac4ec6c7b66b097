//! The balancer announces its VIP through a real bird2 on its host, to a
//! router (a second bird, in the client's namespace) over eBGP: the route
//! comes while the data plane is attached and the service has a healthy
//! backend, goes on `huddle drain-balancer` and comes back on `--undo`,
//! goes before `huddle stop` removes the data plane; a bird that is gone
//! is said in status and the log while the data plane keeps forwarding,
//! and the announcement comes back with bird.

use huddle_user::{cluster::bgp, status::control::Request};
use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};
use testbed::{
    backend_ip, http_get, in_ns, require_root, start_bird, wait_until, Proc, Testbed, CLIENT_IP,
    HTTP_PORT, LB_IP, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

fn bird(
    bed: &Testbed,
    ns: &huddle_user::sys::netns::Netns,
    name: &str,
    conf: &str,
) -> (Proc, PathBuf) {
    start_bird(ns, &bed.dir, name, conf).expect("start bird")
}

/// Whether the router's bird has a route to the VIP via the balancer.
fn router_has_vip(router: &Path) -> bool {
    bgp::bird(router, &format!("show route {VIP}/32"))
        .map(|lines| lines.iter().any(|l| l.contains(&format!("via {LB_IP}"))))
        .unwrap_or(false)
}

/// Waits until the router has (`want`) or lacks the VIP's route; how long.
fn router_sees(router: &Path, want: bool, limit: Duration) -> Duration {
    let t0 = Instant::now();
    wait_until(limit, || router_has_vip(router) == want).unwrap_or_else(|_| {
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
    let routes = bed.dir.join("huddle-vips.conf");
    std::fs::write(&routes, bgp::routes_text(&BTreeSet::new())).unwrap();
    let (_router_bird, router) = bird(
        &bed,
        &bed.client,
        "router",
        &format!(
            "router id {CLIENT_IP};\nprotocol device {{ scan time 1; }}\n\
             protocol bgp balancer {{ local {CLIENT_IP} as 65000; neighbor {LB_IP} as 65001; \
             hold time 3; connect retry time 1; ipv4 {{ import all; export none; }}; }}\n"
        ),
    );
    let lb_conf = format!(
        "router id {LB_IP};\nprotocol device {{ scan time 1; }}\ninclude \"{}\";\n\
         protocol bgp uplink {{ local {LB_IP} as 65001; neighbor {CLIENT_IP} as 65000; \
         hold time 3; connect retry time 1; \
         ipv4 {{ import none; export where proto = \"huddle_v4\"; next hop self; }}; }}\n",
        routes.display()
    );
    let (mut lb_bird, lb_sock) = bird(&bed, &bed.lb, "lb", &lb_conf);
    let config = bed.dir.join("huddle.toml");
    std::fs::write(
        &config,
        format!(
            "[bgp]\ncontrol_socket = \"{}\"\nroutes_file = \"{}\"\n\n[[service]]\nvip = \"{VIP}:80\"\nbackends = [\"{}:{HTTP_PORT}\", \"{}:{HTTP_PORT}\"]\n",
            lb_sock.display(),
            routes.display(),
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
    if wait_until(Duration::from_secs(15), || router_has_vip(&router)).is_err() {
        panic!(
            "the router never got the VIP's route:\nrouter: {:?}\n{:?}\nlb: {:?}\nroutes file: {}\nstatus: {}\n{}",
            bgp::bird(&router, "show protocols all balancer"),
            bgp::bird(&router, "show route"),
            bgp::bird(&lb_sock, "show route"),
            std::fs::read_to_string(&routes).unwrap_or_default(),
            bed.status().map(|s| s.render()).unwrap_or_default(),
            bed.huddle_log()
        );
    }
    let up = t0.elapsed();
    println!(
        "the router learned {VIP}/32 via {LB_IP} {:?} after huddle started ({up:?} of waiting here)",
        t0.elapsed()
    );
    let st = bed.status().unwrap();
    let b = st.bgp.clone().expect("bgp in status");
    assert_eq!(b.announced, vec![VIP.to_string()], "{b:?}");
    assert!(st.render().contains(&format!("bgp: announcing {VIP}")));

    // Drain: withdrawn, the data plane still forwards what arrives.
    let r = bed.control(Request::DrainBalancer { undo: false }).unwrap();
    assert!(r.ok, "{r:?}");
    let gone = router_sees(&router, false, Duration::from_secs(5));
    println!(
        "drain-balancer: the route was gone from the router {gone:?} after the command returned"
    );
    let vip: SocketAddr = (VIP, 80).into();
    in_ns(&bed.client, move || http_get(vip, Duration::from_secs(2)))
        .expect("a drained balancer still forwards");
    let r = bed.control(Request::DrainBalancer { undo: true }).unwrap();
    assert!(r.ok, "{r:?}");
    let back = router_sees(&router, true, Duration::from_secs(5));
    println!("drain-balancer --undo: the route was back {back:?} after the command returned");

    // bird gone: said in status and the log, forwarding goes on; bird
    // back: announced again.
    let _ = lb_bird.terminate(Duration::from_secs(5));
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
    let (_lb_bird2, _) = bird(&bed, &bed.lb, "lb", &lb_conf);
    let again = router_sees(&router, true, Duration::from_secs(15));
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
    let withdrawn = router_sees(&router, false, Duration::from_secs(5));
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
