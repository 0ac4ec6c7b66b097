//! IPv6 through namespaces: real HTTP to an IPv6 VIP, source NAT (the
//! backends see the balancer's IPv6 address and answer through it), L2
//! direct server return and IPv6-in-IPv6 (they see the client's), on a
//! plain testbed; in IPv6-in-IPv6 the agents also time every request and
//! the balancer calibrates its ACK clock with their figures.

use std::{net::SocketAddr, path::Path, time::Duration};
use testbed::{
    backend_ip6, in_ns, require_root, spawn_in, wait_until, whoami, Testbed, CLIENT_IP6, HTTP_PORT,
    LB_IP6, VIP6,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

fn check(mode: &str, vip_port: u16, peer_ip: std::net::Ipv6Addr) {
    check_with(mode, vip_port, peer_ip, None);
}

/// `killed`: that backend's server is killed first (its kernel refuses
/// connections) and rotation is off, so every third connection meets it.
fn check_with(mode: &str, vip_port: u16, peer_ip: std::net::Ipv6Addr, killed: Option<usize>) {
    require_root();
    let tag = if killed.is_some() { "v6kill" } else { mode };
    let mut bed = Testbed::plain(&format!("v6{tag}"), 3).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    if let Some(i) = killed {
        bed.signal_backend(i, libc::SIGKILL);
    }
    if mode != "snat" {
        for ns in &bed.backends {
            ns.ip(&["-6", "addr", "add", &format!("{VIP6}/128"), "dev", "lo"])
                .unwrap();
        }
    }
    if mode == "dsr-ipip" {
        // The agent's decap unwraps IPv6 in IPv6 to this host and times
        // the VIP's requests.
        let vip6 = VIP6.to_string();
        for (i, ns) in bed.backends.iter().enumerate() {
            let log = bed.dir.join(format!("agent{i}.log"));
            let args = [
                "agent",
                "--decap",
                "eth0",
                "--listen",
                "[::]:9100",
                "--vip",
                &vip6,
            ];
            let p = spawn_in(ns, Path::new(HUDDLE), &args, Some(&log)).unwrap();
            bed.agents.push(p);
        }
        for i in 0..3 {
            wait_until(Duration::from_secs(10), || bed.agent_metrics(i).is_ok()).expect("agent up");
        }
    }
    if mode != "snat" {
        // Each backend resolves the client (on its own segment here) from
        // its own address first: otherwise its first answer, from the VIP,
        // waits about 2 s for neighbour discovery (README, "IPv6"), long
        // enough for the huddle to rest that backend as unreachable.
        for ns in &bed.backends {
            in_ns(ns, || {
                let s = std::net::UdpSocket::bind("[::]:0").expect("UDP socket");
                let _ = s.send_to(&[], (CLIENT_IP6, 9));
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let vip = SocketAddr::from((VIP6, vip_port));
    // A config file as the README shows; in dsr-ipip each backend's
    // metrics are its agent's.
    let backends: Vec<String> = (0..3)
        .map(|i| {
            let addr = SocketAddr::from((backend_ip6(i), HTTP_PORT));
            if mode == "dsr-ipip" {
                let ip = backend_ip6(i);
                format!("{{ addr = \"{addr}\", metrics = \"http://[{ip}]:9100/metrics\" }}")
            } else {
                format!("\"{addr}\"")
            }
        })
        .collect();
    let config = bed.dir.join("huddle.toml");
    std::fs::write(
        &config,
        format!(
            "[[service]]\nvip = \"{vip}\"\nmode = \"{mode}\"\nbackends = [{}]\n",
            backends.join(", ")
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let mut args = vec!["--config", &config];
    if killed.is_some() {
        args.push("--no-rotation");
    }
    bed.start_huddle(Path::new(HUDDLE), &args)
        .expect("start huddle");
    let (counts, peers, failures) = whoami(&bed.client, vip, 300);
    let st = bed.status().unwrap();
    println!(
        "IPv6 {mode}: 300 requests to {vip}: {counts:?}, failures {}; global counters {:?}",
        failures.len(),
        st.global
    );
    println!("service counters {:?}", st.services[0].counters);
    assert!(
        failures.is_empty(),
        "failed requests: {failures:?}\n{}",
        bed.huddle_log()
    );
    if let Some(i) = killed {
        assert_eq!(counts.len(), 2, "the killed backend served: {counts:?}");
        let b = &st.services[0].backends[i];
        let (refused, retried) = (b.counters["refused"], b.counters["retried_refused"]);
        println!("IPv6: backend {i} refused {refused} SYNs, {retried} retried on another");
        assert!(retried >= 50, "{refused} refused, {retried} retried");
        return;
    }
    assert_eq!(counts.len(), 3, "every backend must serve: {counts:?}");
    for p in &peers {
        let ip = p
            .rsplit_once(':')
            .map_or("", |(ip, _)| ip)
            .trim_matches(|c| c == '[' || c == ']');
        assert_eq!(ip, peer_ip.to_string(), "a backend saw {p}");
    }
    if mode == "dsr-ipip" {
        agent_timed(&bed, vip);
    }
}

/// Each agent exported its time to first byte for the IPv6 VIP, one
/// sample per request it served, and the balancer scraped it: the ACK
/// clock is calibrated by the agents' figures.
fn agent_timed(bed: &Testbed, vip: SocketAddr) {
    let label = format!("huddle_agent_ttfb_seconds_count{{vip=\"{}\"}} ", vip.ip());
    let mut samples = 0;
    for i in 0..3 {
        let text = bed.agent_metrics(i).unwrap();
        let n: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&label))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {label} in agent {i}'s metrics:\n{text}"));
        assert!(n > 0, "agent {i} timed no request");
        samples += n;
    }
    // Requests keep coming until a scrape has seen the agents' figures.
    let mut calibrated = None;
    let _ = wait_until(Duration::from_secs(10), || {
        let _ = whoami(&bed.client, vip, 20);
        let Ok(st) = bed.status() else {
            return false;
        };
        let b = &st.services[0].backends[0];
        if b.latency_source == "ack-clock, agent-calibrated" {
            calibrated = Some((b.ack_clock_ms, b.agent_ttfb_ms));
        }
        calibrated.is_some()
    });
    println!(
        "IPv6 dsr-ipip: the agents timed {samples} requests; b0 ACK clock raw mean and agent's exact mean (ms): {calibrated:?}"
    );
    let Some((_, agent)) = calibrated else {
        panic!(
            "the balancer never calibrated by the agents' figures:\n{}\n{}",
            bed.status().map(|s| s.render()).unwrap_or_default(),
            bed.huddle_log()
        );
    };
    assert!(agent.is_some(), "no agent figure in status");
}

#[test]
fn ipv6_source_nat_answers_every_request_through_the_balancer() {
    check("snat", 80, LB_IP6);
}

#[test]
fn ipv6_l2_dsr_backends_see_the_client() {
    check("dsr-l2", HTTP_PORT, CLIENT_IP6);
}

#[test]
fn ipv6_in_ipv6_dsr_with_the_agents_decap_serves_every_request() {
    check("dsr-ipip", HTTP_PORT, CLIENT_IP6);
}

#[test]
fn ipv6_connections_a_killed_backend_refuses_are_retried_on_another() {
    check_with("snat", 80, LB_IP6, Some(1));
}
