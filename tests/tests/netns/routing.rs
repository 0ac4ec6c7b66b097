//! The balancer is no open router. It forwards (the FIB answers the XDP
//! program only on an interface that does), but traffic it does not
//! balance to a VIP or a backend is dropped, not handed to that kernel:
//! a ping to a VIP whose router routes it here, with the balancer's
//! default route back to that router, crosses the link once instead of
//! until its TTL runs out; and a client that routes the backends' subnet
//! through the balancer reaches no backend port around the services.

use huddle_user::sys::netns::Netns;
use std::{
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    process::Command,
    time::Duration,
};
use testbed::{
    backend_ip, http_get, in_ns, require_root, Testbed, CLIENT_IP, HTTP_PORT, LB_IP, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

/// A balancer (plain veth, as anyone's first) with the service VIP:80 over
/// two backends, answering.
fn bed(tag: &str) -> Testbed {
    require_root();
    let mut bed = Testbed::plain(tag, 2).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    bed.start_huddle_service(Path::new(HUDDLE), &[])
        .expect("start huddle");
    let vip: SocketAddr = (VIP, 80).into();
    in_ns(&bed.client, move || http_get(vip, Duration::from_secs(2))).expect("the service answers");
    bed
}

/// Counts, in the router namespace `ns`, the echo requests to the VIP that
/// cross its link to the balancer (eth0) each way: (sent, received).
fn count_echoes(ns: &str) {
    let rules = format!(
        "table ip hcloop {{\n\
         chain pre {{ type filter hook prerouting priority 0; iif \"eth0\" ip daddr {VIP} icmp type echo-request counter; }}\n\
         chain post {{ type filter hook postrouting priority 0; oif \"eth0\" ip daddr {VIP} icmp type echo-request counter; }}\n\
         }}\n"
    );
    let path = std::env::temp_dir().join(format!("{ns}.nft"));
    std::fs::write(&path, rules).unwrap();
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f"])
        .arg(&path)
        .output()
        .expect("run nft");
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "nft: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The counts `count_echoes` set up: (sent to the balancer, received).
fn echoes(ns: &str) -> (u64, u64) {
    let chain = |name: &str| {
        let out = Command::new("ip")
            .args([
                "netns", "exec", ns, "nft", "list", "chain", "ip", "hcloop", name,
            ])
            .output()
            .expect("run nft");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let at = text.find("packets ").expect("a counter");
        text[at + 8..]
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .expect("a packet count")
    };
    (chain("post"), chain("pre"))
}

#[test]
fn a_ping_to_the_vip_through_a_router_pointing_back_here_does_not_loop() {
    let bed = bed("loop");
    // The README's BGP set-up: the client's namespace is the router (its
    // route to the VIP points at the balancer, and it forwards); the
    // balancer's default route leads back to it; the ping comes from a
    // host behind the router (one from the router itself would come back
    // to it as a martian, its own source address).
    let far = Netns::create(&format!("{}-far", bed.client.name)).expect("far namespace");
    bed.client
        .ip(&[
            "link", "add", "far0", "type", "veth", "peer", "name", "eth0",
        ])
        .and_then(|()| bed.client.ip(&["link", "set", "eth0", "netns", &far.name]))
        .or_else(|_| {
            bed.client.ip(&["link", "del", "far0"]).ok();
            bed.client.ip(&[
                "link", "add", "far0", "type", "veth", "peer", "name", "eth0", "netns", &far.name,
            ])
        })
        .expect("veth to the far host");
    for (ns, dev, addr) in [
        (&bed.client, "far0", "10.213.200.1/30"),
        (&far, "eth0", "10.213.200.2/30"),
    ] {
        ns.ip(&["addr", "add", addr, "dev", dev]).expect("address");
        ns.ip(&["link", "set", dev, "up"]).expect("link up");
    }
    far.ip(&["route", "add", "default", "via", "10.213.200.1"])
        .expect("far host's route");
    bed.client
        .sysctl("net.ipv4.ip_forward", "1")
        .expect("router forwards");
    bed.lb
        .ip(&["route", "replace", "default", "via", &CLIENT_IP.to_string()])
        .expect("default route");
    count_echoes(&bed.client.name);
    let out = Command::new("ip")
        .args(["netns", "exec", &far.name, "ping", "-c", "1", "-W", "1"])
        .args(["-t", "255", &VIP.to_string()])
        .output()
        .expect("run ping (iputils-ping)");
    std::thread::sleep(Duration::from_millis(200));
    let (tx, rx) = echoes(&bed.client.name);
    let guarded = bed.status().unwrap().global["drop_guarded"];
    println!(
        "ping -t 255 {VIP} from behind the router: the router sent {tx} and received {rx} of its echo requests on its link to the balancer; drop_guarded {guarded}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // The echo request, once, and nothing back.
    assert!(tx + rx <= 2, "the ping looped: {tx} out, {rx} in");
    assert!(guarded >= 1, "dropped by the guard");
}

#[test]
fn a_client_routing_the_backends_through_the_balancer_reaches_no_backend_port() {
    let bed = bed("openrt");
    // A port no service names, on backend 0.
    let listener =
        in_ns(&bed.backends[0], || TcpListener::bind("0.0.0.0:9099")).expect("listen on backend 0");
    let other: SocketAddr = (backend_ip(0), 9099).into();
    let service_port: SocketAddr = (backend_ip(0), HTTP_PORT).into();
    let reach = |to: SocketAddr| {
        in_ns(&bed.client, move || {
            TcpStream::connect_timeout(&to, Duration::from_secs(1)).is_ok()
        })
    };
    assert!(reach(other), "backend 0's port answers on the segment");
    let host = format!("{}/32", backend_ip(0));
    bed.client
        .ip(&["route", "add", &host, "via", &LB_IP.to_string()])
        .expect("route backend 0 through the balancer");
    let (a, b) = (reach(other), reach(service_port));
    let guarded = bed.status().unwrap().global["drop_guarded"];
    println!(
        "through the balancer: backend 0 port 9099 reached {a}, port {HTTP_PORT} reached {b}; drop_guarded {guarded}"
    );
    assert!(!a && !b, "the balancer forwarded around its services");
    assert!(guarded >= 2, "dropped by the guard");
    let vip: SocketAddr = (VIP, 80).into();
    in_ns(&bed.client, move || http_get(vip, Duration::from_secs(2)))
        .expect("the service still answers");
    drop(listener);
}
