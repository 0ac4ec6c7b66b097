//! Real servers and clients through native XDP on veth with every host's
//! default offloads: NGINX behind, curl, wrk and h2load in front, GRO on
//! and off on the bridge's ports. Every body arrives intact and no request
//! fails (with GRO on, every answer over one segment used to reach the
//! client with the pseudo header's sum for a checksum, and wait for its
//! retransmission). Figures are printed, not judged; docs/real-stack.md
//! has them beside kernel DNAT.

use std::{path::Path, time::Duration};
use testbed::{backend_ip, require_root, wait_until, Testbed, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const N: usize = 4;
/// NGINX's HTTP/1.1 and h2c (prior knowledge) ports on every backend.
const H1: u16 = 8080;
const H2: u16 = 8081;
const BODIES: [(&str, usize); 3] = [("1k", 1024), ("100k", 100 * 1024), ("1m", 1024 * 1024)];

/// Bytes that are not all alike, so a wrong sum or a lost segment shows.
fn body(n: usize) -> Vec<u8> {
    let mut x = 0x2545_f491u32;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn nginx_conf(dir: &Path, i: usize) -> String {
    let (d, ip) = (dir.display(), backend_ip(i));
    format!(
        "user root; worker_processes 1; daemon off; pid {d}/ngx{i}.pid; error_log {d}/ngx{i}.err;
events {{ worker_connections 4096; }}
http {{ access_log off; sendfile on; keepalive_requests 100000;
  server {{ listen {ip}:{H1} backlog=4096; listen {ip}:{H2} http2; root {d}/www; }} }}\n"
    )
}

/// TCP segments that host `ns` dropped for a bad checksum (`Tcp:
/// InCsumErrors` of its /proc/net/snmp): what a frame sent on with a sum
/// left to offload comes to.
fn csum_errors(ns: &huddle_user::sys::netns::Netns) -> u64 {
    let snmp = ns.output("cat", &["/proc/net/snmp"]).expect("snmp");
    let tcp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Tcp:")).collect();
    let at = tcp[0].split_whitespace().position(|w| w == "InCsumErrors");
    at.and_then(|i| tcp[1].split_whitespace().nth(i)?.parse().ok())
        .expect("InCsumErrors")
}

/// The line of `text` that starts with `key`, if any.
fn line<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().map(str::trim).find(|l| l.starts_with(key))
}

#[test]
fn nginx_bodies_arrive_intact_through_native_xdp_with_gro_on_and_off() {
    require_root();
    let mut bed = Testbed::native("real", N).expect("testbed");
    let www = bed.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    for (name, n) in BODIES {
        std::fs::write(www.join(name), body(n)).unwrap();
    }
    for i in 0..N {
        let conf = bed.dir.join(format!("ngx{i}.conf"));
        std::fs::write(&conf, nginx_conf(&bed.dir, i)).unwrap();
        let log = bed.dir.join(format!("ngx{i}.log"));
        let p = testbed::spawn_in(
            &bed.backends[i],
            Path::new("/usr/sbin/nginx"),
            &["-c", &conf.display().to_string()],
            Some(&log),
        )
        .expect("nginx");
        bed.procs.push(p);
    }
    let service = |port: u16, to: u16| {
        let b: Vec<String> = (0..N)
            .map(|i| format!("\"{}:{to}\"", backend_ip(i)))
            .collect();
        format!(
            "[[service]]\nvip = \"{VIP}:{port}/tcp\"\nbackends = [{}]\n",
            b.join(", ")
        )
    };
    let config = bed.dir.join("huddle.toml");
    std::fs::write(
        &config,
        format!(
            "interface = \"eth0\"\n[huddle]\nprobe = {{ kind = \"tcp\" }}\nlisten = \"off\"\n{}{}",
            service(80, H1),
            service(81, H2)
        ),
    )
    .unwrap();
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &config.display().to_string()],
    )
    .expect("huddle");
    let url = |name: &str| format!("http://{VIP}/{name}");
    let got = bed.dir.join("got");
    let fetch = |name: &str| -> Option<(Vec<u8>, String)> {
        let _ = std::fs::remove_file(&got);
        let took = bed
            .client
            .output(
                "curl",
                &[
                    "-s",
                    "--max-time",
                    "10",
                    "-w",
                    "%{time_total}",
                    "-o",
                    &got.display().to_string(),
                    &url(name),
                ],
            )
            .ok()?;
        Some((std::fs::read(&got).ok()?, took))
    };
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
            for bad in ["Socket errors", "Non-2xx"] {
                assert!(line(&out, bad).is_none(), "GRO {gro}, wrk {what}: {out}");
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
            csum_errors(ns),
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
