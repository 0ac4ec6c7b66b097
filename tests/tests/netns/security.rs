//! Trust boundaries on the host: who may use a running balancer's control
//! socket, what its listeners hold, and what a namespace made again under
//! a dead one's name inherits (nothing).

use std::{
    os::unix::fs::PermissionsExt,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};
use testbed::{
    backend_ip, backends_total, http_get, in_ns, output, require_root, wait_until, whoami, Testbed,
    HTTP_PORT, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

/// `huddle ARGS` as user nobody: (succeeded, stdout and stderr).
fn as_nobody(args: &[&str]) -> (bool, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", HUDDLE])
        .args(args)
        .output()
        .expect("run setpriv (util-linux)");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A balancer with the service VIP:80 over two backends.
fn bed(tag: &str) -> Testbed {
    require_root();
    let mut bed = Testbed::new(tag, 2).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    bed.start_huddle_service(Path::new(HUDDLE), &[])
        .expect("start huddle");
    bed
}

#[test]
fn a_control_socket_client_of_another_uid_is_refused() {
    let bed = bed("uid");
    let b0 = format!("{}:{HTTP_PORT}", backend_ip(0));
    let socket = bed.socket();
    let path = socket.display().to_string();
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the control socket is root's only");
    // Let others reach the socket's folder: the socket's own mode keeps
    // them out.
    std::fs::set_permissions(&bed.dir, PermissionsExt::from_mode(0o755)).unwrap();
    let (ok, text) = as_nobody(&["status", "--control-socket", &path]);
    assert!(!ok, "nobody read the status: {text}");
    // A socket made wider by hand: the daemon refuses the peer itself.
    std::fs::set_permissions(&socket, PermissionsExt::from_mode(0o666)).unwrap();
    for args in [
        vec!["status", "--control-socket", &path],
        vec!["drain", "--control-socket", &path, "--backend", &b0],
        vec![
            "stop",
            "--control-socket",
            &path,
            "--pin-dir",
            "/nonexistent",
        ],
    ] {
        let (ok, text) = as_nobody(&args);
        assert!(!ok, "nobody ran {args:?}: {text}");
        assert!(text.contains("refused"), "{args:?}: {text}");
    }
    let st = bed.status().expect("root still reads the status");
    assert!(
        st.services[0].backends.iter().all(|b| !b.drained),
        "nobody's drain took effect"
    );
    assert!(bed
        .huddle_log()
        .contains("refused: the control socket answers root"));
}

/// 2,000 idle connections to the HTTP listener and 2,000 to the control
/// socket, held 20 s, while a client keeps requesting through the VIP: the
/// listeners close what is past their caps, probes keep their descriptors,
/// no backend turns unhealthy or moves, and status still answers at once.
#[test]
fn thousands_of_idle_connections_to_its_listeners_change_nothing() {
    let bed = bed("idle");
    // The descriptors a daemon started from a shell or by systemd gets
    // (soft limit 1,024), not this harness's 20,000: at 1,024 the old
    // listeners ran out, and probes failed with EMFILE.
    let daemon = bed
        .huddle
        .as_ref()
        .expect("the daemon's process")
        .child
        .id()
        .to_string();
    let (ok, _, err) = output(
        Path::new("prlimit"),
        &["--pid", &daemon, "--nofile=1024:1024"],
    )
    .unwrap();
    assert!(ok, "prlimit: {err}");
    let socket = bed.socket();
    let path = socket.display().to_string();
    let held = in_ns(&bed.lb, move || {
        let mut held: Vec<Box<dyn Send>> = Vec::new();
        let mut opened = (0, 0);
        for _ in 0..2000 {
            if let Ok(s) = std::net::TcpStream::connect("127.0.0.1:9477") {
                held.push(Box::new(s));
                opened.0 += 1;
            }
            if let Ok(s) = std::os::unix::net::UnixStream::connect(&socket) {
                held.push(Box::new(s));
                opened.1 += 1;
            }
        }
        (held, opened)
    });
    let (held, opened) = held;
    println!(
        "opened {} HTTP and {} control connections",
        opened.0, opened.1
    );
    let until = Instant::now() + Duration::from_secs(20);
    let (mut requests, mut failed, mut slowest) = (0, 0, Duration::ZERO);
    while Instant::now() < until {
        let to = std::net::SocketAddr::from((VIP, 80));
        match in_ns(&bed.client, move || http_get(to, Duration::from_secs(2))) {
            Ok(_) => requests += 1,
            Err(_) => failed += 1,
        }
        // From a process of its own, as an operator's `huddle status`.
        let t = Instant::now();
        let (ok, out, err) = output(
            Path::new(HUDDLE),
            &["status", "--json", "--control-socket", &path],
        )
        .unwrap();
        slowest = slowest.max(t.elapsed());
        assert!(ok, "status during the flood: {err}");
        let st: huddle_user::status::Status = serde_json::from_str(&out).unwrap();
        for b in &st.services[0].backends {
            assert!(
                b.unhealthy.is_none(),
                "{} unhealthy: {:?}",
                b.addr,
                b.unhealthy
            );
            assert_eq!(b.place, "inner", "{} moved", b.addr);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(held);
    println!("{requests} requests through the VIP, {failed} failed; slowest status {slowest:?}");
    assert_eq!(failed, 0);
    assert!(requests > 20, "{requests} requests in 20 s");
    assert!(
        bed.huddle_log().contains("past the limit"),
        "the HTTP listener said it closed connections past its limit"
    );
}

/// `huddle run` under `ip netns exec` with its default pin folder, ended
/// by SIGTERM (which leaves the data plane pinned for a restart); then the
/// namespace is deleted and another made with the same name and interface,
/// and the same command started in it. The kernel may give the new
/// namespace the old one's inode number (the old pin folders were named by
/// it) but never its cookie: nothing of the first is adopted (flows,
/// counters, temperatures, drains), and its pins are gone.
#[test]
fn a_namespace_made_again_adopts_nothing_of_the_deleted_one() {
    require_root();
    let mut bed = Testbed::plain("renew", 2).expect("testbed");
    bed.ip_netns_exec = true;
    bed.default_pins = true;
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    bed.start_huddle_service(Path::new(HUDDLE), &[])
        .expect("huddle");
    let vip = std::net::SocketAddr::from((VIP, 80));
    let (_, _, failures) = whoami(&bed.client, vip, 20);
    assert!(failures.is_empty(), "{failures:?}");
    let b0 = format!("{}:{HTTP_PORT}", backend_ip(0));
    let r = bed
        .control(huddle_user::status::control::Request::Drain {
            backend: b0.clone(),
            vip: None,
        })
        .expect("drain");
    assert!(r.ok, "{:?}", r.error);
    // The state file is written every second.
    std::thread::sleep(Duration::from_millis(1500));
    let first = bed.pins.clone();
    let ino = |name: &str| {
        std::os::unix::fs::MetadataExt::ino(
            &std::fs::metadata(format!("/run/netns/{name}")).expect("namespace file"),
        )
    };
    let first_ino = ino(&bed.lb.name);
    bed.kill_huddle(libc::SIGTERM);
    assert!(
        first.join("link").exists(),
        "SIGTERM keeps the data plane pinned for a restart"
    );
    bed.renew_lb().expect("the namespace made again");
    // The kernel tears a deleted namespace's devices down in the
    // background; the pinned link loses its device when it does.
    let detached = wait_until(Duration::from_secs(10), || {
        huddle_user::kernel::dataplane::stale::pinned_xdp(&first.join("link"))
            .is_ok_and(|l| l.ifindex == 0)
    });
    assert!(detached.is_ok(), "the old link kept its device");
    let second_ino = ino(&bed.lb.name);
    bed.restart_huddle()
        .unwrap_or_else(|e| panic!("second start: {e:#}"));
    let st = bed.status().expect("status");
    let log = bed.huddle_log();
    println!(
        "namespace inode {first_ino} then {second_ino}; pins {} then {}; mode {}",
        first.display(),
        bed.pins.display(),
        st.xdp_mode
    );
    assert_ne!(bed.pins, first, "the same pin folder");
    assert!(!first.exists(), "the dead namespace's pins are left\n{log}");
    assert_ne!(st.xdp_mode, "adopted", "{log}");
    assert_eq!(backends_total(&st, "flows_new"), 0, "flow counters carried");
    for b in &st.services[0].backends {
        assert!(!b.drained, "{} is still drained", b.addr);
        assert_eq!(b.place, "inner", "{}", b.addr);
    }
    assert!(
        log.contains("written in another network namespace"),
        "{log}"
    );
    assert!(log.contains("whose interface is gone"), "{log}");
    let (seen, _, failures) = whoami(&bed.client, vip, 20);
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(seen.len(), 2, "both backends answer: {seen:?}");
}

/// Files the daemon writes as root (the state file, its NAT walk beside
/// it, bird's routes) where someone planted symlinks to files they want
/// overwritten: the links are replaced, never followed.
#[test]
fn a_symlink_planted_at_the_state_or_routes_path_is_not_followed() {
    require_root();
    let mut bed = Testbed::new("symlink", 2).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    let state = bed.socket().with_extension("state");
    let walk = state.with_extension("nat");
    let routes = bed.dir.join("routes.conf");
    let mut victims = Vec::new();
    for (i, path) in [&state, &walk, &routes].into_iter().enumerate() {
        let victim = bed.dir.join(format!("victim-{i}"));
        std::fs::write(&victim, "precious\n").unwrap();
        std::os::unix::fs::symlink(&victim, path).unwrap();
        victims.push((path.clone(), victim));
    }
    // bird is not running: the routes are written, then bird is asked.
    let config = bed.dir.join("huddle.toml");
    std::fs::write(
        &config,
        format!(
            "[bgp]\ncontrol_socket = \"{}\"\nroutes_file = \"{}\"\n",
            bed.dir.join("no-bird.ctl").display(),
            routes.display()
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    bed.start_huddle_service(Path::new(HUDDLE), &["--config", &config])
        .expect("start huddle");
    // The state file is written every second.
    std::thread::sleep(Duration::from_millis(2500));
    for (path, victim) in &victims {
        assert_eq!(
            std::fs::read_to_string(victim).unwrap(),
            "precious\n",
            "{} was written through its link",
            victim.display()
        );
        if let Ok(m) = std::fs::symlink_metadata(path) {
            assert!(
                !m.file_type().is_symlink(),
                "{} is still the planted link",
                path.display()
            );
        }
    }
    let written = victims
        .iter()
        .filter(|(p, _)| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_file()))
        .count();
    println!("{written} of 3 paths replaced by the daemon's own files");
    assert_eq!(written, 3, "{}", bed.huddle_log());
    // And once more on the way out (the state is saved at exit).
    bed.kill_huddle(libc::SIGTERM);
    for (_, victim) in &victims {
        assert_eq!(std::fs::read_to_string(victim).unwrap(), "precious\n");
    }
}
