//! Real servers and clients through native XDP on veth with every host's
//! default offloads: NGINX behind, curl, wrk and h2load in front, GRO on
//! and off on the bridge's ports. Every body arrives intact and no request
//! fails (with GRO on, every answer over one segment used to reach the
//! client with the pseudo header's sum for a checksum, and wait for its
//! retransmission). Figures are printed, not judged; docs/real-stack.md
//! has them beside kernel DNAT.

use std::{path::Path, time::Duration};
use testbed::nginx::{body, csum_errors, fetch, line};
use testbed::{require_root, wait_until, Testbed, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const N: usize = 4;
const BODIES: [(&str, usize); 3] = [("1k", 1024), ("100k", 100 * 1024), ("1m", 1024 * 1024)];

#[test]
fn nginx_bodies_arrive_intact_through_native_xdp_with_gro_on_and_off() {
    require_root();
    let mut bed = Testbed::native("real", N).expect("testbed");
    testbed::nginx::start(&mut bed, false).expect("nginx");
    let config = testbed::nginx::huddle_config(&bed).expect("config");
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &config.display().to_string()],
    )
    .expect("huddle");
    let url = |name: &str| format!("http://{VIP}/{name}");
    let got = bed.dir.join("got");
    let fetch = |name: &str| fetch(&bed.client, &url(name), &got);
    wait_until(Duration::from_secs(20), || {
        fetch("1k").is_some_and(|(b, _)| b == body(1024))
    })
    .expect("the VIP never answered");
    for gro in ["on", "off"] {
        let mut ports = vec!["pl".to_string(), "pc".to_string()];
        ports.extend((0..N).map(|i| format!("pb{i}")));
        for p in &ports {
            bed.switch
                .exec("ethtool", &["-K", p, "gro", gro])
                .expect("ethtool");
        }
        for (name, n) in BODIES {
            let (b, took) = fetch(name).unwrap_or_else(|| panic!("GRO {gro}: /{name} failed"));
            assert!(
                b == body(n),
                "GRO {gro}: /{name} came back {} bytes, not intact",
                b.len()
            );
            println!("GRO {gro}: /{name} intact in {took} s");
        }
        for (what, close) in [("Connection: close", true), ("keep-alive", false)] {
            let mut args = vec!["-t2", "-c32", "-d3s", "--latency"];
            if close {
                args.extend(["-H", "Connection: close"]);
            }
            let u = url("1k");
            args.push(&u);
            let out = bed.client.output("wrk", &args).expect("wrk");
            assert!(
                line(&out, "Non-2xx").is_none(),
                "GRO {gro}, wrk {what}: {out}"
            );
            // Connection resets on read in close runs are issue 50's open
            // point (1 in 30,000-40,000 connections here, in 2 of 2 CI runs
            // of 7 December 2026, and in hc-realload's runs before and after
            // TW_REUSED): counted, held to 1 in 10,000; any other error fails.
            let [connect, read, write, timeout] = socket_errors(&out);
            let requests = requests(&out);
            let reads_allowed = if close { requests / 10_000 + 1 } else { 0 };
            assert!(
                [connect, write, timeout] == [0; 3] && read <= reads_allowed,
                "GRO {gro}, wrk {what}: {out}"
            );
            if read > 0 {
                println!("GRO {gro}, wrk {what}: {read} read errors in {requests} requests");
            }
            println!(
                "GRO {gro}, wrk -c32 {what}: {}, p99 {}",
                line(&out, "Requests/sec").unwrap_or("?"),
                line(&out, "99%").unwrap_or("?")
            );
        }
        let h2 = format!("http://{VIP}:81/1k");
        let out = bed
            .client
            .output("h2load", &["-c8", "-m10", "-n2000", &h2])
            .expect("h2load");
        let req = line(&out, "requests:").unwrap_or("");
        assert!(
            req.contains("2000 succeeded, 0 failed"),
            "GRO {gro}, h2load: {out}"
        );
        println!(
            "GRO {gro}, h2load h2c: {}",
            line(&out, "finished in").unwrap_or("?")
        );
    }
    for (who, ns) in std::iter::once(("client", &bed.client))
        .chain(bed.backends.iter().map(|b| ("a backend", b)))
    {
        assert_eq!(
            csum_errors(ns).expect("snmp"),
            0,
            "{who} dropped segments with bad checksums"
        );
    }
    let g = bed.status().expect("status").global;
    let count = |k: &str| g.get(k).copied().unwrap_or(0);
    let (finished, dropped) = (count("csum_finished"), count("drop_csum"));
    println!("checksums finished: {finished}, dropped: {dropped}");
    assert_eq!(dropped, 0);
    assert!(
        finished > 0,
        "no frame came left to offload: the bed tests nothing"
    );
}

/// Each service probed in its own protocol (issue 51): HTTP/1.1, h2c and
/// TLS on NGINX, UDP on `hc-backend`'s echo, each backend healthy; b3
/// answering the HTTP/1.1 service's probe with 503 leaves that service's
/// ring, and only that one. With `[huddle]`'s probe alone the h2c
/// service's backends were all "not an HTTP answer".
#[test]
fn each_service_is_probed_in_its_own_protocol() {
    require_root();
    let mut bed = Testbed::native("probes", N).expect("testbed");
    testbed::nginx::start_probed(&mut bed, 3).expect("nginx");
    let backend = Path::new(env!("CARGO_BIN_EXE_hc-backend"));
    for i in 0..N {
        let (id, log) = (format!("b{i}"), bed.dir.join(format!("udp{i}.log")));
        let args = ["--id", &id, "--http", "9090", "--udp", "5353"];
        let p = testbed::spawn_in(&bed.backends[i], backend, &args, Some(&log)).expect("udp");
        bed.procs.push(p);
    }
    let list = |port: u16| {
        let v: Vec<String> = (0..N)
            .map(|i| format!("\"{}:{port}\"", testbed::backend_ip(i)))
            .collect();
        v.join(", ")
    };
    let config = bed.dir.join("probes.toml");
    std::fs::write(
        &config,
        format!(
            "interface = \"eth0\"
[huddle]
listen = \"off\"
probe = {{ path = \"/health\" }}
[[service]]
vip = \"{VIP}:80\"
backends = [{}]
[[service]]
vip = \"{VIP}:81\"
backends = [{}]
probe = {{ version = \"2\" }}
[[service]]
vip = \"{VIP}:443\"
backends = [{}]
probe = {{ kind = \"tls\", host = \"backend.test\" }}
[[service]]
vip = \"{VIP}:53/udp\"
backends = [{}]
probe = {{ send = \"ping\", expect = \":ping\" }}
",
            list(testbed::nginx::H1),
            list(testbed::nginx::H2),
            list(testbed::nginx::TLS),
            list(5353)
        ),
    )
    .expect("config");
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &config.display().to_string()],
    )
    .expect("huddle");
    // Every backend probed and passing, b3 of the first failing and out.
    let settled = |st: &huddle_user::status::Status| {
        st.services.iter().enumerate().all(|(si, s)| {
            s.backends.iter().enumerate().all(|(bi, b)| {
                let sick = si == 0 && bi == 3;
                if sick {
                    b.unhealthy.is_some() && !b.in_ring
                } else {
                    b.probe_ms.is_some() && b.probe_error.is_none() && b.unhealthy.is_none()
                }
            })
        })
    };
    let waited = wait_until(Duration::from_secs(20), || {
        bed.status().is_ok_and(|st| settled(&st))
    });
    let st = bed.status().expect("status");
    assert!(
        waited.is_ok(),
        "not every backend probed as its service says:\n{}\n{}",
        st.render(),
        bed.huddle_log()
    );
    let why = st.services[0].backends[3]
        .unhealthy
        .clone()
        .unwrap_or_default();
    assert!(why.contains("HTTP status 503"), "b3: {why}");
    for (si, s) in st.services.iter().enumerate() {
        let ms: Vec<String> = s
            .backends
            .iter()
            .map(|b| format!("{:.1}", b.probe_ms.unwrap_or(f64::NAN)))
            .collect();
        println!("{}: probe ms {}", s.name, ms.join(" / "));
        if si > 0 {
            assert!(s.backends.iter().all(|b| b.in_ring), "{}", st.render());
        }
    }
    let log = bed.huddle_log();
    for said in [
        "probed with HTTP/2 GET /health",
        "probed with TLS (SNI backend.test)",
        "probed with UDP datagram",
    ] {
        assert!(log.contains(said), "the log does not say {said:?}:\n{log}");
    }
    // The services serve: b3 is out of the first only.
    let curl = |args: &[&str]| bed.client.output("curl", args).unwrap_or_default();
    for _ in 0..8 {
        assert_eq!(
            curl(&["-s", "--max-time", "5", &format!("http://{VIP}/")]),
            "page"
        );
        let h2 = format!("http://{VIP}:81/");
        assert_eq!(
            curl(&["-s", "--max-time", "5", "--http2-prior-knowledge", &h2]),
            "page"
        );
        let tls = format!("https://{VIP}:443/");
        assert_eq!(curl(&["-sk", "--max-time", "5", &tls]), "page");
    }
}

/// wrk's "Socket errors: connect A, read B, write C, timeout D" (zeros
/// when it prints none).
fn socket_errors(out: &str) -> [u64; 4] {
    let mut n = [0; 4];
    if let Some(l) = line(out, "Socket errors:") {
        for (i, part) in l["Socket errors:".len()..].split(',').take(4).enumerate() {
            n[i] = part
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or(u64::MAX);
        }
    }
    n
}

/// wrk's "N requests in ..." count.
fn requests(out: &str) -> u64 {
    out.lines()
        .find_map(|l| {
            let l = l.trim();
            l.contains(" requests in ")
                .then(|| l.split_whitespace().next()?.parse().ok())
                .flatten()
        })
        .unwrap_or(0)
}
