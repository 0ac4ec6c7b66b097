//! Bad input to a running balancer: reloads that must change nothing,
//! reloads that change services and backends under live connections, and
//! backend metrics endpoints that hang, lie or flood.

use huddle_user::status::Status;
use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};
use testbed::{
    backend_ip, http_get, in_ns, output, require_root, udp_request, KeepAlive, Testbed, HTTP_PORT,
    UDP_PORT, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const TIMEOUT: Duration = Duration::from_secs(3);

fn addr(i: usize) -> String {
    format!("{}:{HTTP_PORT}", backend_ip(i))
}

/// A config with the TCP service on `tcp` backends and, if any, a UDP
/// service on `udp` backends, plus `huddle` lines.
fn config(huddle: &str, tcp: &[usize], udp: &[usize]) -> String {
    let list = |ids: &[usize], port: u16| -> String {
        ids.iter()
            .map(|i| format!("\"{}:{port}\"", backend_ip(*i)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut t = format!(
        "[huddle]\n{huddle}\n\n[[service]]\nvip = \"{VIP}:80\"\nbackends = [{}]\n",
        list(tcp, HTTP_PORT)
    );
    if !udp.is_empty() {
        t += &format!(
            "\n[[service]]\nvip = \"{VIP}:53/udp\"\nbackends = [{}]\n",
            list(udp, UDP_PORT)
        );
    }
    t
}

fn reload(bed: &Testbed) -> (bool, String) {
    let (ok, out, err) = output(
        Path::new(HUDDLE),
        &[
            "reload",
            "--control-socket",
            &bed.socket().display().to_string(),
        ],
    )
    .unwrap();
    (ok, format!("{out}{err}"))
}

fn backends_of(st: &Status, service: usize) -> Vec<String> {
    st.services[service]
        .backends
        .iter()
        .map(|b| b.addr.clone())
        .collect()
}

#[test]
fn reloads_change_services_in_place_and_bad_ones_change_nothing() {
    require_root();
    // Rings that change only by reloads: a huddle resting a backend slowed
    // by a busy machine (other tests run beside this one) is not what is
    // tested here, and moved its ring under a refused reload.
    let cfg = |huddle: &str, tcp: &[usize], udp: &[usize]| {
        config(&format!("rotation = false\n{huddle}"), tcp, udp)
    };
    let mut bed = Testbed::new("reload", 4).expect("testbed");
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    let file = bed.dir.join("huddle.toml");
    std::fs::write(&file, cfg("", &[0, 1, 2], &[])).unwrap();
    let file_s = file.display().to_string();
    bed.start_huddle(Path::new(HUDDLE), &["--config", &file_s])
        .expect("huddle");
    let vip: SocketAddr = (VIP, 80).into();
    let ns = bed.client.name.clone();
    // A long-lived connection that must survive every reload.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let held = thread::spawn(move || -> Result<(String, u32), String> {
        huddle_user::sys::netns::enter(&ns).map_err(|e| e.to_string())?;
        let mut c = KeepAlive::connect(vip, TIMEOUT).map_err(|e| format!("{e:#}"))?;
        let first = c.get().map_err(|e| format!("{e:#}"))?;
        let mut n = 1;
        while rx.recv_timeout(Duration::from_millis(20)).is_err() {
            let b = c.get().map_err(|e| format!("request {n}: {e:#}"))?;
            if b != first {
                return Err(format!("connection moved from {first} to {b}"));
            }
            n += 1;
        }
        Ok((first, n))
    });
    thread::sleep(Duration::from_millis(300));
    let before = bed.status().unwrap();

    // Invalid, or changing what needs a restart: refused, nothing changes.
    for (text, want) in [
        (cfg("cool = 0.9", &[1, 2, 3], &[]), "huddle.cool"),
        ("[[service]\nvip = 1".to_string(), "line 1"),
        (cfg("", &[1, 1], &[]), "listed twice"),
        (
            format!("nat_ports = \"21000-30000\"\n{}", cfg("", &[0, 1, 2], &[])),
            "nat_ports cannot change",
        ),
        (
            cfg("", &[0, 1], &[]).replace(&backend_ip(1).to_string(), "192.0.2.7"),
            "unreachable",
        ),
    ] {
        std::fs::write(&file, &text).unwrap();
        let (ok, msg) = reload(&bed);
        assert!(!ok, "reload of {text:?} should fail: {msg}");
        assert!(
            msg.contains(want) && msg.contains("nothing changed"),
            "{msg:?} should say {want:?} and that nothing changed"
        );
        let now = bed.status().unwrap();
        assert_eq!(now.services.len(), before.services.len());
        assert_eq!(now.services[0].ring, before.services[0].ring, "{msg}");
        assert_eq!(
            now.services[0].ring_generation,
            before.services[0].ring_generation
        );
        assert_eq!(backends_of(&now, 0), backends_of(&before, 0));
    }

    // Valid: b0 leaves, b3 joins, and a UDP service appears.
    std::fs::write(&file, cfg("", &[1, 2, 3], &[0, 1, 2, 3])).unwrap();
    let (ok, msg) = reload(&bed);
    assert!(ok, "{msg}");
    let st = bed.status().unwrap();
    assert_eq!(backends_of(&st, 0), vec![addr(1), addr(2), addr(3)]);
    assert_eq!(st.services[0].ring, vec![addr(1), addr(2), addr(3)]);
    assert_eq!(st.services.len(), 2);
    let answers = in_ns(&bed.client, move || {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..30 {
            seen.insert(http_get(vip, TIMEOUT).expect("request after reload"));
        }
        let udp: SocketAddr = (VIP, 53).into();
        let u = udp_request(udp, b"q", TIMEOUT).expect("UDP service added by reload");
        (seen, u)
    });
    assert_eq!(
        answers.0.into_iter().collect::<Vec<_>>(),
        vec!["b1", "b2", "b3"],
        "new connections follow the reloaded ring"
    );
    assert!(answers.1.contains(":q"), "{}", answers.1);

    // SIGHUP does the same: b0 back in.
    std::fs::write(&file, cfg("", &[0, 1, 2, 3], &[])).unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(bed.huddle.as_ref().unwrap().child.id() as i32, libc::SIGHUP) };
    let t = Instant::now();
    while backends_of(&bed.status().unwrap(), 0).len() != 4 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "SIGHUP reload not applied:\n{}",
            bed.huddle_log()
        );
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        bed.status().unwrap().services.len(),
        1,
        "the UDP service is gone again"
    );

    tx.send(()).unwrap();
    let (on, n) = held
        .join()
        .unwrap()
        .expect("the long-lived connection broke across reloads");
    println!(
        "a keep-alive connection on {on} made {n} requests across 6 refused and 2 applied reloads"
    );
}

#[test]
fn hanging_lying_and_flooding_metrics_endpoints_never_stop_the_daemon() {
    require_root();
    let mut bed = Testbed::new("metrics", 2).expect("testbed");
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    let file = bed.dir.join("huddle.toml");
    let text = format!(
        "[huddle]\nscrape_interval_ms = 200\nscrape_timeout_ms = 300\n\n[[service]]\nvip = \"{VIP}:80\"\nbackends = [{}]\n",
        (0..2)
            .map(|i| format!("{{ addr = \"{}\", metrics = \"http://{}/metrics\" }}", addr(i), addr(i)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    std::fs::write(&file, text).unwrap();
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &file.display().to_string()],
    )
    .expect("huddle");
    let b0 = |st: &Status| st.services[0].backends[0].clone();
    // Normal first: both known.
    let t = Instant::now();
    while b0(&bed.status().unwrap()).cpu.is_none() {
        assert!(t.elapsed() < Duration::from_secs(5), "metrics never read");
        thread::sleep(Duration::from_millis(50));
    }
    for (mode, what, want) in [
        (1, "hangs", "no full answer within"),
        (2, "answers garbage", "no usable"),
        (3, "answers NaN", "no usable"),
        (4, "answers negative values", "no usable"),
        (5, "answers absurd values", "no usable"),
        (6, "sends a 10 MB body", "larger than"),
    ] {
        bed.backend_admin(0, &format!("metrics={mode}")).unwrap();
        let t = Instant::now();
        let mut last_uptime = 0.0;
        let mut slowest = Duration::ZERO;
        loop {
            let asked = Instant::now();
            let st = bed.status().unwrap();
            let took = asked.elapsed();
            slowest = slowest.max(took);
            // Status is answered from the next tick's snapshot: alone,
            // within 90-102 ms (a tick); in a CI run of 4 December, beside
            // this binary's three other testbeds, 632 ms. A daemon stuck
            // on a scrape would not answer at all: the bound only needs to
            // tell that from a late tick.
            assert!(
                took < Duration::from_secs(2),
                "status took {took:?} while b0 {what}"
            );
            assert!(st.uptime_s >= last_uptime);
            last_uptime = st.uptime_s;
            for b in &st.services[0].backends {
                assert!((0.0..=1.0).contains(&b.temperature), "{b:?}");
            }
            let b = b0(&st);
            if b.cpu.is_none()
                && b.memory.is_none()
                && b.host_note.as_deref().is_some_and(|n| n.contains(want))
            {
                println!(
                    "b0 {what}: host terms unknown, note {:?}; status answered within {slowest:?}",
                    b.host_note.unwrap()
                );
                // b1's scrapes go on: its host terms are known now or
                // soon (on a loaded CI machine one of its own scrapes
                // can miss the 300 ms timeout; seen 4 December).
                let since = Instant::now();
                while bed.status().unwrap().services[0].backends[1].cpu.is_none() {
                    assert!(
                        since.elapsed() < Duration::from_secs(5),
                        "b1's metrics must be unaffected: {:?}",
                        bed.status().unwrap().services[0].backends[1].host_note
                    );
                    thread::sleep(Duration::from_millis(50));
                }
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "b0 {what}: not reported as unknown: {b:?}"
            );
            thread::sleep(Duration::from_millis(50));
        }
        bed.backend_admin(0, "metrics=0").unwrap();
        let t = Instant::now();
        while b0(&bed.status().unwrap()).memory.is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "b0 did not recover after it {what}"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }
    // The daemon ticked all along: traffic still flows.
    let vip: SocketAddr = (VIP, 80).into();
    in_ns(&bed.client, move || http_get(vip, TIMEOUT)).expect("traffic after bad metrics");
}

/// Members of a `[cluster]` that answer garbage (a web server that knows
/// nothing of `/ring`, `/readings` or `/flows`) or nothing at all: the
/// balancer passes them over, decides its rings alone, pools no readings
/// and adopts no flows, says each in status, and forwards all along; and
/// its own cluster pages answer nobody without the cluster key.
#[test]
fn cluster_members_that_answer_garbage_or_nothing_leave_the_balancer_deciding_alone() {
    require_root();
    let mut bed = Testbed::plain("peers", 2).expect("testbed");
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    bed.dsr_backends(Path::new(HUDDLE), false)
        .expect("DSR backends");
    // Backend 0's web server answers every path with its name; nothing
    // is at the other address.
    let garbage = addr(0);
    let silent = format!("{}:9477", backend_ip(229));
    let me = format!("{}:9477", testbed::LB_IP);
    let file = bed.dir.join("huddle.toml");
    let key = bed.dir.join("cluster.key");
    huddle_user::config::key::generate(&key).unwrap();
    let key = key.display();
    let text = format!(
        "[huddle]\nlisten = \"{me}\"\n\n[cluster]\nmembers = [\"{garbage}\", \"{silent}\", \"{me}\"]\nkey_file = \"{key}\"\n\n\
         [[service]]\nvip = \"{VIP}:{HTTP_PORT}\"\nmode = \"dsr-l2\"\nselection = \"maglev\"\nbackends = [\"{}\", \"{}\"]\n",
        addr(0),
        addr(1)
    );
    std::fs::write(&file, text).unwrap();
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &file.display().to_string()],
    )
    .expect("huddle");
    let notes = |bed: &Testbed| bed.status().map(|st| st.notes).unwrap_or_default();
    let want = |n: &Vec<String>| {
        n.iter().any(|l| {
            l.starts_with("cluster: this balancer decides alone; passed over")
                && l.contains(&format!("{garbage}: /ring: the answer is not signed"))
                && l.contains(&silent)
        }) && n.iter().any(|l| {
            l.starts_with("readings: this balancer's alone; passed over")
                && l.contains(&format!("{garbage}: /readings: the answer is not signed"))
                && l.contains(&silent)
        }) && n.iter().any(|l| {
            l.starts_with("handoff: shares 0 flows")
                && l.contains(&format!("{garbage}: no answer, its last list kept"))
        })
    };
    let t = Instant::now();
    while !want(&notes(&bed)) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "status never said it: {:#?}",
            notes(&bed)
        );
        thread::sleep(Duration::from_millis(100));
    }
    for n in notes(&bed).iter().filter(|n| !n.starts_with("xdp")) {
        println!("{n}");
    }
    // It decides alone: a drained backend leaves its ring.
    let r = huddle_user::status::control::call(
        &bed.socket(),
        &huddle_user::status::control::Request::Drain {
            backend: addr(1),
            vip: None,
        },
    )
    .unwrap();
    assert!(r.ok, "{:?}", r.error);
    assert_eq!(bed.status().unwrap().services[0].ring, vec![addr(0)]);
    let vip: SocketAddr = (VIP, HTTP_PORT).into();
    for _ in 0..20 {
        in_ns(&bed.client, move || http_get(vip, TIMEOUT)).expect("traffic with bad peers");
    }
    // And it gives its own pages only to a member holding the key: a
    // client with none, with a forged header or with another key, from
    // the client's namespace, is refused at every one.
    let listen: SocketAddr = me.parse().unwrap();
    let wrong = huddle_user::config::key::ClusterKey::from_hex(&"ab".repeat(32)).unwrap();
    let answers = in_ns(&bed.client, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut out = Vec::new();
        for path in ["/ring", "/readings", "/flows"] {
            let forged = format!("v1 {} 00 00", 0);
            for headers in [
                vec![],
                vec![(huddle_user::cluster::auth::AUTH_HEADER, forged)],
                vec![(
                    huddle_user::cluster::auth::AUTH_HEADER,
                    huddle_user::cluster::auth::sign_request(&wrong, path).0,
                )],
            ] {
                let r = rt.block_on(huddle_user::net::http::get_with(
                    listen,
                    &listen.to_string(),
                    path,
                    TIMEOUT,
                    1 << 20,
                    &headers,
                ));
                out.push((
                    path,
                    r.map(|r| (r.status, String::from_utf8_lossy(&r.body).into_owned())),
                ));
            }
        }
        out
    });
    for (path, a) in answers {
        let (status, body) = a.unwrap_or_else(|e| panic!("{path}: {e:#}"));
        assert_eq!(status, 401, "{path}: {body}");
        assert!(
            !body.contains("rings") && !body.contains("flows"),
            "{path}: {body}"
        );
    }
}

/// A member before this balancer in `[cluster]` that holds the key and
/// lies: its ring names one backend a thousand times and a backend this
/// balancer has drained, its readings name a thousand services and
/// backends this balancer does not have, and it shares 100,000 flows. It
/// leads (it signs), and nothing goes past the caps: the ring here is the
/// undrained backend once, the unknown readings are dropped, no more than
/// `MAX_SHARED` of its flows are taken, and traffic carries on.
#[test]
fn a_member_with_the_key_that_lies_changes_nothing_past_the_caps() {
    use huddle_user::cluster::{auth, handoff, pooled};
    use std::io::{Read, Write};
    require_root();
    let mut bed = Testbed::plain("liar", 2).expect("testbed");
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    bed.dsr_backends(Path::new(HUDDLE), false)
        .expect("DSR backends");
    let key_path = bed.dir.join("cluster.key");
    huddle_user::config::key::generate(&key_path).unwrap();
    let key = huddle_user::config::key::ClusterKey::load(&key_path, "cluster.key_file").unwrap();
    let liar: SocketAddr = (testbed::CLIENT_IP, 9477).into();
    let me = format!("{}:9477", testbed::LB_IP);
    let service = format!("{VIP}:{HTTP_PORT}/tcp");
    let (a0, a1) = (addr(0), addr(1));
    let ring = serde_json::json!({ "rings": {
        service.clone(): std::iter::repeat_n(a0.clone(), 1000)
            .chain(std::iter::repeat_n(a1.clone(), 1000))
            .collect::<Vec<_>>()
    }});
    let mut services = serde_json::Map::new();
    let zero = pooled::reading(
        a0.parse().unwrap(),
        &Default::default(),
        &Default::default(),
        &Default::default(),
        &Default::default(),
    );
    for i in 0..1000 {
        services.insert(
            format!("10.9.{}.{}:80/tcp", i / 250, i % 250),
            serde_json::json!([zero]),
        );
    }
    let stranger = pooled::reading(
        "10.213.0.99:80".parse().unwrap(),
        &Default::default(),
        &Default::default(),
        &Default::default(),
        &Default::default(),
    );
    services.insert(service.clone(), serde_json::json!([zero, stranger]));
    let readings = serde_json::json!({ "fields": pooled::fields(), "services": services });
    let flows: Vec<serde_json::Value> = (0..100_000u32)
        .map(|i| {
            serde_json::json!([
                format!("10.{}.{}.{}", 100 + i / 65_536, (i / 256) % 256, i % 256),
                40_000 + (i % 20_000),
                format!("{VIP}:{HTTP_PORT}"),
                6,
                a1
            ])
        })
        .collect();
    let flows = serde_json::json!({ "flows": flows, "truncated": false });
    let pages: Vec<(&'static str, String)> = vec![
        ("/ring", ring.to_string()),
        ("/readings", readings.to_string()),
        ("/flows", flows.to_string()),
    ];
    // The liar, in the client's namespace, until the test stops it (at most
    // 60 s or 2,000 requests). It lived 15 s or 400 requests: on a loaded
    // host the balancer's start took long enough for the liar to go before
    // the status (polled 12 s) showed it, and its notes said "refused".
    let serve_key = key.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let listener = in_ns(&bed.client, move || {
        std::net::TcpListener::bind(liar).unwrap()
    });
    listener.set_nonblocking(true).unwrap();
    let server = thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(60);
        let mut served = 0;
        while Instant::now() < until && served < 2_000 && !stopped.load(Ordering::Relaxed) {
            let Ok((mut s, _)) = listener.accept() else {
                thread::sleep(Duration::from_millis(10));
                continue;
            };
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            // A peer whose namespace is deleted mid-answer sends no RST: without
            // this, the write waits out TCP's retransmissions (about 15 min).
            let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]).to_string();
            let path = req.split(' ').nth(1).unwrap_or("").to_string();
            let hdr = req
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{}: ", auth::AUTH_HEADER)))
                .map(str::trim);
            let page = pages.iter().find(|(p, _)| *p == path);
            let answer = match (page, auth::check_request(&serve_key, hdr, &path)) {
                (Some((_, body)), Ok(nonce)) => format!(
                    "HTTP/1.1 200 OK\r\n{}: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    auth::MAC_HEADER,
                    auth::sign_answer(&serve_key, &nonce, &path, body.as_bytes()),
                    body.len()
                ),
                _ => "HTTP/1.1 404 No\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string(),
            };
            let _ = s.write_all(answer.as_bytes());
            served += 1;
        }
        served
    });
    let file = bed.dir.join("huddle.toml");
    std::fs::write(
        &file,
        format!(
            "[huddle]\nlisten = \"{me}\"\n\n[cluster]\nmembers = [\"{liar}\", \"{me}\"]\nkey_file = \"{}\"\n\n\
             [[service]]\nvip = \"{VIP}:{HTTP_PORT}\"\nmode = \"dsr-l2\"\nselection = \"maglev\"\nbackends = [\"{a0}\", \"{a1}\"]\n",
            key_path.display()
        ),
    )
    .unwrap();
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--config", &file.display().to_string()],
    )
    .expect("huddle");
    let r = huddle_user::status::control::call(
        &bed.socket(),
        &huddle_user::status::control::Request::Drain {
            backend: a1.clone(),
            vip: None,
        },
    )
    .unwrap();
    assert!(r.ok, "{:?}", r.error);
    let done = |st: &Status| {
        let n = &st.notes;
        n.iter()
            .any(|l| l == &format!("cluster: rings from {liar}"))
            && n.iter().any(|l| {
                l.contains(&format!(
                    "dropped readings of backends not configured here: 1001 from {liar}"
                ))
            })
            && n.iter().any(|l| {
                l.contains(&format!(
                    "past the {} a peer may share",
                    handoff::MAX_SHARED
                ))
            })
    };
    let t = Instant::now();
    let st = loop {
        let st = bed.status().expect("status");
        if done(&st) {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(12),
            "status never said it: {:#?}\n{}",
            st.notes,
            bed.huddle_log()
        );
        thread::sleep(Duration::from_millis(200));
    };
    for n in st.notes.iter().filter(|n| !n.starts_with("xdp")) {
        println!("{n}");
    }
    assert_eq!(
        st.services[0].ring,
        vec![a0.clone()],
        "the liar's ring, deduplicated and without the drained backend"
    );
    let vip: SocketAddr = (VIP, HTTP_PORT).into();
    for _ in 0..20 {
        in_ns(&bed.client, move || http_get(vip, TIMEOUT)).expect("traffic beside the liar");
    }
    let t = Instant::now();
    drop(bed);
    stop.store(true, Ordering::Relaxed);
    let served = server.join().unwrap();
    println!(
        "the liar answered {served} requests; stopping took {:?}",
        t.elapsed()
    );
}
