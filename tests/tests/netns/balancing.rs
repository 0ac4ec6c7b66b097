//! Real traffic through the attached XDP program: client, balancer and
//! backends each in their own network namespace.

use huddle_user::status::control::Request;
use std::{collections::BTreeMap, net::SocketAddr, path::Path, time::Duration};
use testbed::{
    backend_ip, http_get, in_ns, output, require_root, udp_request, xdp_attached, KeepAlive,
    Testbed, HTTP_PORT, UDP_PORT, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const TIMEOUT: Duration = Duration::from_secs(3);

fn bed(tag: &str, n: usize, udp: bool) -> Testbed {
    require_root();
    let mut bed = Testbed::new(tag, n).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    let mut args: Vec<String> = vec!["--vip".into(), format!("{VIP}:80")];
    for i in 0..n {
        args.push("--backend".into());
        args.push(format!("{}:{HTTP_PORT}", backend_ip(i)));
    }
    let config;
    if udp {
        // The UDP service comes from a config file, the TCP one from flags.
        let backends: Vec<String> = (0..n)
            .map(|i| format!("\"{}:{UDP_PORT}\"", backend_ip(i)))
            .collect();
        let text = format!(
            "[[service]]\nvip = \"{VIP}:53/udp\"\nbackends = [{}]\n",
            backends.join(", ")
        );
        config = bed.dir.join("huddle.toml");
        std::fs::write(&config, text).unwrap();
        args.push("--config".into());
        args.push(config.display().to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    bed.start_huddle(Path::new(HUDDLE), &args)
        .expect("start huddle");
    bed
}

#[test]
fn http_and_udp_are_balanced_round_robin_through_the_vip() {
    let bed = bed("rr", 3, true);
    let vip: SocketAddr = (VIP, 80).into();
    let (counts, failures) = in_ns(&bed.client, move || {
        let mut counts: BTreeMap<String, u32> = BTreeMap::new();
        let mut failures = Vec::new();
        for i in 0..1000 {
            match http_get(vip, TIMEOUT) {
                Ok(body) => *counts.entry(body).or_default() += 1,
                Err(e) => failures.push(format!("request {i}: {e:#}")),
            }
            if failures.len() >= 5 {
                break;
            }
        }
        (counts, failures)
    });
    println!(
        "1000 sequential HTTP requests: {counts:?}, failures: {}",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "failed requests: {failures:?}\n{}",
        bed.huddle_log()
    );
    assert_eq!(counts.len(), 3, "every backend must serve: {counts:?}");
    // Each CPU keeps its own round-robin position, so shares may differ by
    // at most one per CPU that carried new connections.
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
    for (b, n) in &counts {
        assert!(
            n.abs_diff(333) <= cpus + 1,
            "backend {b} got {n} of 1000: not a round-robin share"
        );
    }

    let udp_vip: SocketAddr = (VIP, 53).into();
    let (answers, udp_fail) = in_ns(&bed.client, move || {
        let mut answers: BTreeMap<String, u32> = BTreeMap::new();
        let mut fail = 0;
        for i in 0..60 {
            match udp_request(udp_vip, format!("q{i}").as_bytes(), TIMEOUT) {
                Ok(r) => {
                    *answers
                        .entry(r.split(':').next().unwrap_or("").to_string())
                        .or_default() += 1
                }
                Err(_) => fail += 1,
            }
        }
        (answers, fail)
    });
    println!("60 UDP requests: {answers:?}, failures: {udp_fail}");
    assert_eq!(udp_fail, 0);
    assert_eq!(answers.len(), 3, "{answers:?}");

    let status = bed.status().unwrap();
    let tcp = status
        .services
        .iter()
        .find(|s| s.name == "10.213.100.1:80/tcp")
        .expect("TCP service in status");
    let flows: u64 = tcp.backends.iter().map(|b| b.counters["flows_new"]).sum();
    assert_eq!(flows, 1000, "kernel counted {flows} new TCP flows");
    assert!(tcp
        .backends
        .iter()
        .all(|b| b.counters["pkts_from"] > 0 && b.counters["bytes_to"] > 0));
    let (ok, text, _) = output(
        Path::new(HUDDLE),
        &[
            "status",
            "--control-socket",
            &bed.socket().display().to_string(),
        ],
    )
    .unwrap();
    assert!(
        ok && text.contains("10.213.100.1:80/tcp") && text.contains("10.213.0.11:8080"),
        "{text}"
    );
}

#[test]
fn long_lived_connection_survives_ring_swaps_and_new_connections_follow_the_ring() {
    let bed = bed("swap", 3, false);
    let vip: SocketAddr = (VIP, 80).into();
    let socket = bed.socket();
    let result = in_ns(&bed.client, move || -> Result<(u32, u32), String> {
        let mut conn = KeepAlive::connect(vip, TIMEOUT).map_err(|e| e.to_string())?;
        let home = conn.get().map_err(|e| e.to_string())?;
        let home_idx: usize = home[1..].parse().unwrap();
        let home_addr = format!("{}:{HTTP_PORT}", backend_ip(home_idx));
        let mut swaps = 0;
        let mut new_conns = 0;
        for i in 0..100 {
            let drain = i % 2 == 0;
            let req = if drain {
                Request::Drain {
                    backend: home_addr.clone(),
                    vip: None,
                }
            } else {
                Request::Undrain {
                    backend: home_addr.clone(),
                    vip: None,
                }
            };
            let reply =
                huddle_user::status::control::call(&socket, &req).map_err(|e| e.to_string())?;
            if !reply.ok {
                return Err(format!("swap {i}: {:?}", reply.error));
            }
            swaps += 1;
            let body = conn
                .get()
                .map_err(|e| format!("long-lived connection broke after swap {i}: {e}"))?;
            if body != home {
                return Err(format!("long-lived connection moved from {home} to {body}"));
            }
            if drain {
                for _ in 0..3 {
                    let b = http_get(vip, TIMEOUT)
                        .map_err(|e| format!("new connection after swap {i}: {e}"))?;
                    new_conns += 1;
                    if b == home {
                        return Err(format!(
                            "a new connection went to drained backend {home} after swap {i}"
                        ));
                    }
                }
            }
        }
        Ok((swaps, new_conns))
    });
    let (swaps, new_conns) = result.unwrap_or_else(|e| panic!("{e}\n{}", bed.huddle_log()));
    println!("{swaps} ring swaps, {new_conns} new connections avoided the drained backend");
    assert_eq!(swaps, 100);
    let status = bed.status().unwrap();
    assert!(
        status.services[0].ring_generation >= 101,
        "generation {}",
        status.services[0].ring_generation
    );
    assert_eq!(
        status.global["ring_retry"], 0,
        "no ring read raced a swap at this rate"
    );
}

#[test]
fn unresolved_neighbours_still_get_through() {
    let bed = bed("neigh", 3, false);
    let vip: SocketAddr = (VIP, 80).into();
    for round in 0..3 {
        bed.lb.ip(&["neigh", "flush", "dev", "eth0"]).unwrap();
        // At once (next hops still cached), then once the caches have
        // expired (the daemon bumps their generation every second), when
        // the FIB has no neighbour to give and the kernel must resolve it.
        for wait in [Duration::ZERO, Duration::from_millis(1500)] {
            std::thread::sleep(wait);
            let results = in_ns(&bed.client, move || {
                (0..6)
                    .map(|_| http_get(vip, TIMEOUT).map_err(|e| e.to_string()))
                    .collect::<Vec<_>>()
            });
            for r in results {
                r.unwrap_or_else(|e| {
                    panic!("round {round}: request failed {wait:?} after a neighbour flush: {e}")
                });
            }
        }
    }
    let g = bed.status().unwrap().global;
    println!("pass_no_neigh = {}", g["pass_no_neigh"]);
    assert!(
        g["pass_no_neigh"] > 0,
        "the flushes should have exercised the kernel path: {g:?}"
    );
}

#[test]
fn sigterm_leaves_the_data_plane_running_and_stop_removes_it() {
    let mut bed = bed("term", 1, false);
    assert!(xdp_attached(&bed.lb));
    let vip: SocketAddr = (VIP, 80).into();
    let mut p = bed.huddle.take().unwrap();
    assert!(
        p.terminate(Duration::from_secs(10)).unwrap(),
        "huddle must exit 0 on SIGTERM"
    );
    assert!(bed.huddle_log().contains("the data plane keeps running"));
    assert!(
        xdp_attached(&bed.lb),
        "a plain exit must leave XDP attached"
    );
    assert!(!bed.socket().exists(), "control socket left behind");
    let body = in_ns(&bed.client, move || http_get(vip, TIMEOUT));
    assert_eq!(body.unwrap(), "b0", "traffic must flow with no daemon");

    // `huddle stop` with no daemon removes it all and restores sysctls
    // (run in the balancer's namespace, as an operator would).
    let out = huddle_user::sys::netns::command_in(&bed.lb.name, Path::new(HUDDLE))
        .unwrap()
        .args([
            "stop",
            "--control-socket",
            &bed.socket().display().to_string(),
            "--pin-dir",
            &bed.pins.display().to_string(),
        ])
        .output()
        .unwrap();
    let (ok, out, err) = (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(ok, "huddle stop failed: {out}{err}");
    assert!(out.contains("removed"), "{out}");
    assert!(
        !xdp_attached(&bed.lb),
        "XDP program still attached after stop"
    );
    assert!(!bed.pins.exists(), "pins left behind");
    let restored = in_ns(&bed.lb, || {
        std::fs::read_to_string("/proc/sys/net/ipv4/conf/eth0/forwarding").unwrap()
    });
    assert_eq!(restored.trim(), "0", "forwarding sysctl not restored");

    // With a daemon running, `huddle stop` goes through it.
    bed.restart_huddle().unwrap();
    assert!(xdp_attached(&bed.lb));
    let (ok, out, err) = output(
        Path::new(HUDDLE),
        &[
            "stop",
            "--control-socket",
            &bed.socket().display().to_string(),
            "--pin-dir",
            &bed.pins.display().to_string(),
        ],
    )
    .unwrap();
    assert!(ok, "huddle stop failed: {out}{err}");
    let mut p = bed.huddle.take().unwrap();
    assert!(p.terminate(Duration::from_secs(10)).is_ok());
    assert!(
        !xdp_attached(&bed.lb),
        "XDP program still attached after stop"
    );
    assert!(!bed.pins.exists(), "pins left behind");

    // `run --detach-on-exit`: SIGTERM removes everything.
    let sock = bed.socket().display().to_string();
    let pins = bed.pins.display().to_string();
    let b = format!("{}:{HTTP_PORT}", backend_ip(0));
    let vip_s = format!("{VIP}:80");
    let args = [
        "--vip",
        &vip_s,
        "--backend",
        &b,
        "--detach-on-exit",
        "--control-socket",
        &sock,
        "--pin-dir",
        &pins,
    ];
    let mut cmd = huddle_user::sys::netns::command_in(&bed.lb.name, Path::new(HUDDLE)).unwrap();
    cmd.args(["run", "--iface", "eth0"]).args(args);
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut p = testbed::Proc {
        child: cmd.spawn().unwrap(),
        what: "huddle --detach-on-exit".into(),
    };
    testbed::wait_until(Duration::from_secs(20), || bed.status().is_ok()).expect("huddle up");
    assert!(xdp_attached(&bed.lb));
    assert!(p.terminate(Duration::from_secs(10)).unwrap());
    assert!(!xdp_attached(&bed.lb), "--detach-on-exit left XDP attached");
    assert!(!bed.pins.exists(), "--detach-on-exit left pins behind");
}

/// Runs `huddle ARGS` in the balancer's namespace (with the testbed's
/// socket and pin folder) and checks it is refused with one line naming
/// `want`, leaving nothing attached and nothing pinned. Returns the error.
fn refused(bed: &Testbed, args: &[&str], want: &str) -> String {
    let sock = bed.socket().display().to_string();
    let pins = bed.pins.display().to_string();
    let mut full: Vec<String> = args.iter().map(ToString::to_string).collect();
    full.extend(["--control-socket".into(), sock, "--pin-dir".into(), pins]);
    let (ok, _, err) = in_ns(&bed.lb, move || {
        let args: Vec<&str> = full.iter().map(String::as_str).collect();
        output(Path::new(HUDDLE), &args).unwrap()
    });
    assert!(!ok, "{args:?} should fail");
    assert_eq!(
        err.trim().lines().count(),
        1,
        "{args:?}: error should be one line: {err:?}"
    );
    assert!(
        err.contains(want),
        "{args:?}: {err:?} should mention {want:?}"
    );
    assert!(
        !xdp_attached(&bed.lb),
        "{args:?} left an XDP program attached"
    );
    assert!(!bed.pins.exists(), "{args:?} left pins behind");
    err
}

#[test]
fn bad_invocations_fail_with_one_line_and_attach_nothing() {
    require_root();
    let bed = Testbed::new("err", 1).unwrap();
    let b = format!("{}:{HTTP_PORT}", backend_ip(0));
    let vip = format!("{VIP}:80");
    // (interface, VIP, further arguments, what the error must mention)
    let cases = [
        (
            "nosuch0",
            vip.as_str(),
            format!("--backend {b}"),
            "does not exist",
        ),
        (
            "eth0",
            "10.213.100.1",
            format!("--backend {b}"),
            "not an IP:PORT",
        ),
        (
            "eth0",
            &vip,
            "--backend 10.213.0.300:80".into(),
            "backends[0]",
        ),
        (
            "eth0",
            &vip,
            format!("--backend {b} --backend {b}"),
            "listed twice",
        ),
        ("eth0", &vip, String::new(), "has no backend"),
        (
            "eth0",
            &vip,
            format!("--backend {b} --nat-ports 40000-50000"),
            "ephemeral",
        ),
        (
            "eth0",
            &vip,
            "--backend 192.0.2.1:80".into(),
            "service[0].backends[0]: backend 192.0.2.1:80 is unreachable",
        ),
    ];
    for (iface, vip, extra, want) in cases {
        let mut args = vec!["run", "--iface", iface, "--vip", vip];
        args.extend(extra.split_whitespace());
        refused(&bed, &args, want);
    }
    // Config files: the error names the line and the field.
    let svc = format!("[[service]]\nvip = \"{vip}\"\nbackends = [\"{b}\"]\n");
    let files = [
        (
            format!("[huddle]\ncool = 0.6\nheat = 0.5\n{svc}"),
            "line 2: huddle.cool: 0.6 must be below huddle.heat",
        ),
        (
            format!("[huddle]\ntick_ms = 0\n{svc}"),
            "line 2: huddle.tick_ms: 0 is outside",
        ),
        (format!("[huddle]\ntick_ms = -5\n{svc}"), "line 2"),
        (
            format!("{svc}[[service]]\nvip = \"{vip}/tcp\"\nbackends = [\"{b}\"]\n"),
            "line 5: service[1].vip: 10.213.100.1:80/tcp is configured twice",
        ),
        (format!("[huddle\n{svc}"), "line 1"),
        (
            format!("[huddle]\nprobe = {{ kind = \"icmp\" }}\n{svc}"),
            "line 2",
        ),
        (
            format!("[huddle]\nweights = {{ latency = -1.0 }}\n{svc}"),
            "line 2: huddle.weights.latency",
        ),
    ];
    for (i, (text, want)) in files.iter().enumerate() {
        let path = bed.dir.join(format!("bad{i}.toml"));
        std::fs::write(&path, text).unwrap();
        let path = path.display().to_string();
        let err = refused(&bed, &["run", "--iface", "eth0", "--config", &path], want);
        assert!(
            err.contains(&format!("bad{i}.toml")),
            "{err:?} should name the file"
        );
    }
    // Without privileges.
    let (ok, _, err) = output(
        Path::new("setpriv"),
        &[
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            HUDDLE,
            "run",
            "--iface",
            "lo",
            "--vip",
            &vip,
            "--backend",
            &b,
            "--control-socket",
            "/tmp/x.sock",
        ],
    )
    .unwrap();
    assert!(!ok && err.contains("needs root"), "{err}");
}

/// Anyone's first try: `ip netns exec NS huddle run` with default flags on
/// plain veth pairs (nothing on the peer, checksum offload on). Native
/// XDP_TX would lose every frame there; `auto` must pick generic mode and
/// say why.
#[test]
fn default_flags_on_a_plain_veth_forward_every_request() {
    require_root();
    let mut bed = Testbed::plain("plain", 3).expect("build testbed");
    bed.ip_netns_exec = true;
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    bed.start_huddle_service(Path::new(HUDDLE), &[])
        .expect("start huddle");
    let vip: SocketAddr = (VIP, 80).into();
    let (ok, failures) = in_ns(&bed.client, move || {
        let mut ok = 0;
        let mut failures = Vec::new();
        for i in 0..300 {
            match http_get(vip, TIMEOUT) {
                Ok(_) => ok += 1,
                Err(e) => failures.push(format!("request {i}: {e:#}")),
            }
            if failures.len() >= 5 {
                break;
            }
        }
        (ok, failures)
    });
    let st = bed.status().expect("status");
    println!(
        "plain veth, default flags: {ok} of 300 answered, mode {}, notes {:?}",
        st.xdp_mode, st.notes
    );
    assert!(
        failures.is_empty(),
        "failed requests: {failures:?}\n{}",
        bed.huddle_log()
    );
    assert_eq!(st.xdp_mode, "generic");
    let log = bed.huddle_log();
    assert!(
        log.contains("xdp mode auto: generic, because the interface is a veth whose peer runs no XDP program"),
        "the log must say which mode and why:\n{log}"
    );
    assert!(
        st.notes.iter().any(|n| n.contains("generic")),
        "status must say it too: {:?}",
        st.notes
    );
}

/// Native mode insisted on where it cannot work: the daemon must notice in
/// the first seconds that nothing it sends is answered, and say so.
#[test]
fn a_mode_that_forwards_nothing_is_reported() {
    require_root();
    let mut bed = Testbed::plain("blackhole", 2).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    bed.start_huddle_service(Path::new(HUDDLE), &["--xdp-mode", "native"])
        .expect("start huddle");
    let vip: SocketAddr = (VIP, 80).into();
    let failed = in_ns(&bed.client, move || {
        let mut failed = 0;
        for _ in 0..70 {
            if http_get(vip, Duration::from_millis(100)).is_err() {
                failed += 1;
            }
        }
        failed
    });
    let st = bed.status().expect("status");
    println!(
        "native on a plain veth: {failed} of 70 failed; notes {:?}",
        st.notes
    );
    assert!(
        st.notes.iter().any(|n| n.contains("forwarding nothing")),
        "no note in the status: {:?}\n{}",
        st.notes,
        bed.huddle_log()
    );
    assert!(bed.huddle_log().contains("forwarding nothing"));
}

/// `status`, `drain` and `stop` without `--iface`: the only balancer
/// running on the host is the one meant.
#[test]
fn commands_without_iface_find_the_only_balancer() {
    require_root();
    let mut bed = Testbed::new("find", 2).expect("build testbed");
    bed.default_socket = true;
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    let b0 = format!("{}:{HTTP_PORT}", backend_ip(0));
    bed.start_huddle_service(Path::new(HUDDLE), &[])
        .expect("start huddle");
    let huddle = Path::new(HUDDLE);
    let (ok, out, err) = output(huddle, &["status", "--json"]).unwrap();
    assert!(ok, "status without --iface: {err}");
    assert!(out.contains("\"interface\": \"eth0\""), "{out}");
    let (ok, _, err) = output(huddle, &["drain", "--backend", &b0]).unwrap();
    assert!(ok, "drain without --iface: {err}");
    let st = bed.status().unwrap();
    assert!(st.services[0].backends[0].drained);
    // With a second balancer answering, it lists both and asks.
    let second = huddle_user::config::default_control_socket(&testbed::unique("two"));
    let listener = std::os::unix::net::UnixListener::bind(&second).unwrap();
    let (ok, _, err) = output(huddle, &["status"]).unwrap();
    drop(listener);
    let _ = std::fs::remove_file(&second);
    assert!(!ok);
    assert!(
        err.contains("2 balancers run on this host")
            && err.contains("eth0")
            && err.contains("--iface"),
        "{err}"
    );
    let (ok, out, err) = output(huddle, &["stop"]).unwrap();
    assert!(ok, "stop without --iface: {err}");
    println!("stop without --iface: {}", out.trim());
    assert!(!xdp_attached(&bed.lb), "the data plane stayed attached");
    let (ok, _, err) = output(huddle, &["status"]).unwrap();
    assert!(!ok);
    assert!(err.contains("no balancer runs on this host"), "{err}");
}

/// `--log-format json`: every line is a JSON object, and a rotation
/// carries its fields (service, backend, direction, reason, temperature).
#[test]
fn json_logs_carry_the_rotation_fields() {
    require_root();
    let mut bed = Testbed::new("jsonlog", 3).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    bed.start_huddle_service(Path::new(HUDDLE), &["--log-format", "json"])
        .expect("start huddle");
    let vip: SocketAddr = (VIP, 80).into();
    let load = testbed::OpenLoop::start(&bed.client, vip, 100.0, TIMEOUT);
    std::thread::sleep(Duration::from_millis(500));
    bed.signal_backend(1, libc::SIGKILL);
    let b1 = format!("{}:{HTTP_PORT}", backend_ip(1));
    let left = bed.wait_place(
        &b1,
        "outer",
        std::time::Instant::now(),
        Duration::from_secs(5),
    );
    drop(load.stop());
    left.expect("the killed backend left the ring");
    let log = bed.huddle_log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let rotation = lines
        .iter()
        .find(|v| v["event"] == "rotation" && v["backend"] == b1.as_str())
        .unwrap_or_else(|| panic!("no rotation line for {b1}:\n{log}"));
    println!("a rotation as JSON: {rotation}");
    assert_eq!(rotation["to"], "outer");
    assert_eq!(rotation["service"], format!("{VIP}:80/tcp"));
    assert!(rotation["reason"].as_str().is_some_and(|r| !r.is_empty()));
    assert!(rotation["temperature"].is_number());
    assert_eq!(rotation["level"], "INFO");
}
