//! Direct server return through namespaces: real HTTP through the VIP in
//! both DSR modes, on a testbed as anyone's first (plain veth pairs,
//! default offloads); the backends see the client's own address and
//! answer it directly.

use std::path::Path;
use testbed::{backend_ip, require_root, whoami, Testbed, CLIENT_IP, HTTP_PORT, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

/// A plain testbed of `n` backends serving `VIP:HTTP_PORT` in `mode`.
pub fn dsr_bed(tag: &str, n: usize, mode: &str, extra: &[&str]) -> Testbed {
    require_root();
    let mut bed = Testbed::plain(tag, n).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    bed.dsr_backends(Path::new(HUDDLE), mode == "dsr-ipip")
        .expect("set up the backends for DSR");
    let mut args: Vec<String> = vec![
        "--vip".into(),
        format!("{VIP}:{HTTP_PORT}"),
        "--mode".into(),
        mode.into(),
    ];
    for i in 0..n {
        args.push("--backend".into());
        args.push(format!("{}:{HTTP_PORT}", backend_ip(i)));
    }
    args.extend(extra.iter().map(ToString::to_string));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    bed.start_huddle(Path::new(HUDDLE), &args)
        .expect("start huddle");
    bed
}

fn check_mode(mode: &str) {
    let bed = dsr_bed(mode, 3, mode, &[]);
    let (counts, peers, failures) = whoami(&bed.client, (VIP, HTTP_PORT).into(), 300);
    println!(
        "{mode}: 300 requests: {counts:?}, failures {}",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "failed requests: {failures:?}\n{}",
        bed.huddle_log()
    );
    assert_eq!(counts.len(), 3, "every backend must serve: {counts:?}");
    for p in &peers {
        let ip = p.rsplit_once(':').map_or("", |(ip, _)| ip);
        assert_eq!(
            ip,
            CLIENT_IP.to_string(),
            "a backend saw {p}, not the client's address"
        );
    }
    let st = bed.status().unwrap();
    let g = &st.global;
    println!("{mode}: global counters {g:?}");
    let get = |name: &str| g.get(name).copied().unwrap_or(0);
    if mode == "dsr-ipip" {
        assert!(get("encap") >= 300, "encapsulated: {}", get("encap"));
        let m = bed.agent_metrics(0).unwrap();
        let line = m
            .lines()
            .find(|l| l.contains("result=\"decapped\""))
            .expect("decap counters in the agent's metrics");
        println!("b0 agent: {line}");
        let decapped: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(decapped > 0.0, "{m}");
    } else {
        assert_eq!(get("encap"), 0);
    }
    assert_eq!(get("drop_not_onlink"), 0);
}

#[test]
fn l2_dsr_backends_see_the_client_and_answer_it_directly() {
    check_mode("dsr-l2");
}

#[test]
fn ipip_dsr_with_the_agents_decap_serves_every_request() {
    check_mode("dsr-ipip");
}

/// Runs `huddle run ARGS` in the balancer's namespace to its exit: (exit
/// success, stderr).
fn run_refused(bed: &Testbed, args: &[&str]) -> (bool, String) {
    let mut cmd =
        huddle_user::sys::netns::command_in(&bed.lb.name, Path::new(HUDDLE)).expect("namespace");
    let sock = bed.dir.join("refused.sock").display().to_string();
    cmd.args(["run", "--iface", "eth0", "--control-socket", &sock])
        .args(["--pin-dir", &bed.pins.display().to_string()])
        .args(args);
    let out = cmd.output().expect("run huddle");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_dsr_setups_are_refused_in_one_line_with_nothing_attached() {
    require_root();
    let bed = Testbed::plain("dsrbad", 1).expect("build testbed");
    // A backend behind a gateway (the client, as far as routes go).
    bed.lb
        .ip(&[
            "route",
            "add",
            "10.99.0.0/24",
            "via",
            &CLIENT_IP.to_string(),
        ])
        .unwrap();
    let vip = format!("{VIP}:{HTTP_PORT}");
    let b0 = format!("{}:{HTTP_PORT}", backend_ip(0));
    let cases: [(&str, Vec<&str>, &str); 4] = [
        (
            "L2 backend off the segment",
            vec!["--mode", "dsr-l2", "--backend", "10.99.0.5:8080"],
            "is not on the segment of eth0",
        ),
        (
            "encapsulation prefix over the VIP",
            vec![
                "--mode",
                "dsr-ipip",
                "--backend",
                &b0,
                "--encap-prefix",
                "10.213.100.0/24",
            ],
            "holds the VIP",
        ),
        (
            "DSR backend on another port",
            vec!["--mode", "dsr-l2", "--backend", "10.213.0.11:9999"],
            "must listen on port 8080",
        ),
        (
            "IPv6 VIP with IPv4 backends",
            vec![
                "--mode",
                "dsr-ipip",
                "--backend",
                &b0,
                "--vip",
                "[fd00::1]:8080",
            ],
            "IPv6",
        ),
    ];
    for (what, extra, expect) in cases {
        let mut args = vec!["--vip", vip.as_str()];
        if extra.contains(&"[fd00::1]:8080") {
            args.clear();
        }
        args.extend(extra.iter().copied());
        let (ok, err) = run_refused(&bed, &args);
        println!("{what}: {}", err.trim());
        assert!(!ok, "{what}: accepted");
        assert!(err.contains(expect), "{what}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{what}: one line: {err}");
        assert!(!testbed::xdp_attached(&bed.lb), "{what}: left XDP attached");
    }
}
