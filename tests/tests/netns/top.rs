//! `huddle top` in a real terminal (tmux, 80x24): it shows the rings and
//! backends, drains the selected backend on `d`, says "reconnecting" while
//! the daemon is away and carries on once it is back, and quits on `q`.

use std::{
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};
use testbed::{backend_ip, require_root, unique, OpenLoop, Testbed, HTTP_PORT, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

fn tmux(args: &[&str]) -> String {
    let o = Command::new("tmux")
        .args(args)
        .output()
        .expect("running tmux");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The screen once it shows `want` (waits up to 5 s).
fn screen_with(session: &str, want: &str) -> String {
    let t = Instant::now();
    loop {
        let s = tmux(&["capture-pane", "-p", "-t", session]);
        if s.contains(want) || t.elapsed() > Duration::from_secs(5) {
            return s;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

struct Session(String);

impl Drop for Session {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .output();
    }
}

#[test]
fn top_shows_the_huddle_drains_on_a_key_and_survives_a_restart() {
    require_root();
    let mut bed = Testbed::new("top", 3).expect("testbed");
    bed.start_backends_with(Path::new(BACKEND), &["--delay-ms", "10"])
        .expect("backends");
    let [b0, b1, b2] = [0, 1, 2].map(|i| format!("{}:{HTTP_PORT}", backend_ip(i)));
    bed.start_huddle_service(Path::new(HUDDLE), &[])
        .expect("huddle");
    let session = Session(unique("top"));
    let cmd = format!("{HUDDLE} top --control-socket {}", bed.socket().display());
    tmux(&[
        "new-session",
        "-d",
        "-s",
        &session.0,
        "-x",
        "80",
        "-y",
        "24",
        &cmd,
    ]);
    let s = screen_with(&session.0, &b2);
    println!("huddle top at 80x24:\n{s}");
    assert!(s.contains("huddle on eth0"), "{s}");
    assert!(s.contains(&b0) && s.contains(&b1) && s.contains(&b2), "{s}");
    assert!(s.contains("rotations"), "{s}");
    assert!(s.lines().all(|l| l.chars().count() <= 80));

    // `d` drains the selected (first) backend.
    tmux(&["send-keys", "-t", &session.0, "d"]);
    let t = Instant::now();
    while !bed.status().unwrap().services[0].backends[0].drained {
        assert!(t.elapsed() < Duration::from_secs(5), "d did not drain");
        thread::sleep(Duration::from_millis(50));
    }
    screen_with(&session.0, "drained");
    // `u` puts it back.
    tmux(&["send-keys", "-t", &session.0, "u"]);
    let t = Instant::now();
    while bed.status().unwrap().services[0].backends[0].drained {
        assert!(t.elapsed() < Duration::from_secs(5), "u did not undrain");
        thread::sleep(Duration::from_millis(50));
    }

    // A backend turned 5x slow under load leaves the ring; the screen shows
    // it resting within a second of the rotation.
    let vip: std::net::SocketAddr = (VIP, 80).into();
    let load = OpenLoop::start(&bed.client, vip, 100.0, Duration::from_secs(2));
    thread::sleep(Duration::from_millis(1500));
    bed.backend_admin(2, "delay_ms=50").unwrap();
    let left = bed.wait_place(&b2, "outer", Instant::now(), Duration::from_secs(5));
    let rotated = Instant::now();
    let s = screen_with(&session.0, "-> outer");
    let shown = rotated.elapsed();
    drop(load.stop());
    left.expect("the slow backend left the ring");
    println!(
        "a slow backend resting, {} ms after its rotation:\n{s}",
        shown.as_millis()
    );
    assert!(s.contains("-> outer"), "{s}");
    assert!(
        s.lines().any(|l| l.starts_with(&b2) && l.contains("outer")),
        "{s}"
    );
    assert!(shown < Duration::from_secs(1), "shown after {shown:?}");
    // Selecting it shows how long it still rests.
    tmux(&["send-keys", "-t", &session.0, "Down", "Down"]);
    let s = screen_with(&session.0, "more");
    assert!(
        s.lines()
            .any(|l| l.starts_with(&format!("{b2}: hot")) && l.contains("rests")),
        "{s}"
    );

    // The daemon goes away and comes back: top says so, then carries on.
    bed.kill_huddle(libc::SIGKILL);
    let s = screen_with(&session.0, "reconnecting");
    assert!(s.contains("reconnecting"), "{s}");
    bed.restart_huddle().expect("restart");
    let t = Instant::now();
    loop {
        let s = tmux(&["capture-pane", "-p", "-t", &session.0]);
        if !s.contains("reconnecting") && s.contains(&b2) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "still reconnecting:\n{s}"
        );
        thread::sleep(Duration::from_millis(100));
    }
    tmux(&["send-keys", "-t", &session.0, "q"]);
    let t = Instant::now();
    while tmux(&["list-sessions"]).contains(&session.0) {
        assert!(t.elapsed() < Duration::from_secs(5), "q did not quit");
        thread::sleep(Duration::from_millis(50));
    }
}
