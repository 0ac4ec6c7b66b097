//! What a newcomer types: every binary answers `--help` and refuses an
//! unknown flag, the commands of the README and docs/ parse as written and
//! their configs pass `huddle check`, and the tools that make namespaces remove
//! them when stopped with SIGTERM mid-run.

use std::{
    path::Path,
    process::{Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const DEMO: &str = env!("CARGO_BIN_EXE_hc-demo");
const COMPARE: &str = env!("CARGO_BIN_EXE_hc-compare");

fn run(prog: &str, args: &[&str]) -> Output {
    Command::new(prog)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {prog}: {e}"))
}

fn readme() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    std::fs::read_to_string(root.join("README.md")).expect("README.md")
}

/// The fenced blocks of `text` whose info string is `lang`.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in text.lines() {
        match (&mut cur, line.strip_prefix("```")) {
            (None, Some(info)) if info.trim() == lang => cur = Some(String::new()),
            (Some(_), Some(_)) => out.push(cur.take().unwrap()),
            (Some(b), None) => {
                b.push_str(line);
                b.push('\n');
            }
            _ => {}
        }
    }
    out
}

#[test]
fn every_binary_answers_help_and_refuses_an_unknown_flag() {
    for bin in [HUDDLE, BACKEND, DEMO, COMPARE] {
        let help = run(bin, &["--help"]);
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(
            help.status.success() && text.contains("Usage"),
            "{bin} --help: {:?} {text}",
            help.status
        );
        let bad = run(bin, &["--no-such-flag"]);
        assert!(
            !bad.status.success(),
            "{bin} accepted --no-such-flag: {}",
            String::from_utf8_lossy(&bad.stdout)
        );
        assert!(
            String::from_utf8_lossy(&bad.stderr).contains("--no-such-flag"),
            "{bin}: the refusal names the flag"
        );
    }
    for sub in ["run", "status", "top", "bench", "agent", "stop", "check"] {
        let out = run(HUDDLE, &[sub, "--help"]);
        assert!(
            out.status.success(),
            "huddle {sub} --help: {:?}",
            out.status
        );
        assert!(!run(HUDDLE, &[sub, "--no-such-flag"]).status.success());
    }
}

/// The README and every page under docs/, as (path, text).
fn pages() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut out = vec![("README.md".to_string(), readme())];
    let mut dirs = vec![root.join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("docs/").flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                let text = std::fs::read_to_string(&p).unwrap();
                out.push((p.display().to_string(), text));
            }
        }
    }
    out
}

/// `huddle check` of `text` written to a file; (passed, what it said).
fn check(text: &str) -> (bool, String) {
    let path = std::env::temp_dir().join(format!("doc-{}.toml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    let out = run(HUDDLE, &["check", &path.display().to_string()]);
    let _ = std::fs::remove_file(&path);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

#[test]
fn the_commands_of_the_readme_and_docs_parse_and_their_configs_check() {
    let mut seen = 0;
    for (page, text) in pages() {
        for block in blocks(&text, "sh") {
            for line in block.lines() {
                let cmd = line.split('#').next().unwrap_or("").trim();
                let Some(args) = cmd.strip_prefix("huddle ") else {
                    continue;
                };
                // `--help` after the rest: clap parses every flag and
                // value before it answers, so a renamed or mistyped flag
                // fails.
                let mut argv: Vec<&str> = args.split_whitespace().collect();
                argv.push("--help");
                let out = run(HUDDLE, &argv);
                assert!(
                    out.status.success(),
                    "{page}: `{cmd}` does not parse: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                seen += 1;
            }
        }
        for block in blocks(&text, "toml") {
            // The README's example is whole; a page's may be a fragment
            // (one table), checked with an interface and a service added.
            let mut whole = block.clone();
            if page != "README.md" {
                if !whole.lines().any(|l| l.starts_with("interface")) {
                    whole = format!("interface = \"eth0\"\n{whole}");
                }
                if !whole.contains("[[service]]") {
                    whole.push_str(
                        "\n[[service]]\nvip = \"10.0.100.1:80\"\nbackends = [\"10.0.0.11:8080\"]\n",
                    );
                }
            }
            // A cluster's key file, made as the page says (`huddle keygen`).
            let key = std::env::temp_dir().join(format!("hct{}-cluster.key", std::process::id()));
            if whole.contains("key_file") {
                let _ = std::fs::remove_file(&key);
                huddle_user::config::key::generate(&key).unwrap();
                whole = whole.replace("/etc/huddle/cluster.key", &key.display().to_string());
            }
            let (ok, said) = check(&whole);
            let _ = std::fs::remove_file(&key);
            assert!(ok, "{page}: its config does not pass huddle check: {said}");
        }
    }
    assert!(
        seen >= 9,
        "only {seen} huddle commands found in the README and docs"
    );
    let configs = blocks(&readme(), "toml");
    assert_eq!(configs.len(), 1, "the README has one example config");
}

/// Namespaces whose name contains `pid`.
fn namespaces_of(pid: u32) -> Vec<String> {
    let out = run("ip", &["netns", "list"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.contains(&pid.to_string()))
        .map(str::to_string)
        .collect()
}

/// Starts `prog`, waits until it has made `at_least` namespaces (and a
/// moment more), stops it with SIGTERM, and checks that nothing named for
/// it is left.
fn sigterm_mid_run(prog: &str, args: &[&str], at_least: usize) {
    let mut child = Command::new(prog)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {prog}: {e}"));
    let pid = child.id();
    let start = Instant::now();
    while namespaces_of(pid).len() < at_least {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{prog} ended ({status}) before it made {at_least} namespaces");
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("{prog} made no namespaces within 60 s");
        }
        thread::sleep(Duration::from_millis(100));
    }
    thread::sleep(Duration::from_millis(1500));
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("{prog} did not exit within 20 s of SIGTERM");
        }
        thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{prog}: {status}");
    let left = namespaces_of(pid);
    assert!(left.is_empty(), "{prog} left namespaces: {left:?}");
    let pins: Vec<_> = std::fs::read_dir("/sys/fs/bpf/huddle-tests")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(&pid.to_string()))
        .collect();
    assert!(pins.is_empty(), "{prog} left pins: {pins:?}");
}

#[test]
fn the_demo_and_the_benchmark_stopped_with_sigterm_leave_nothing() {
    testbed::require_root();
    testbed::sweep_stale();
    // The demo's client, balancer, switch and four backends.
    sigterm_mid_run(DEMO, &["--huddle", HUDDLE], 7);
    sigterm_mid_run(HUDDLE, &["bench", "--rounds", "1"], 1);
}

/// The packets-per-second part runs on this machine's kernel, whatever it
/// allows (live frames or the reflector), and every program in its table
/// forwarded frames: a part that stopped, or printed rates of nothing,
/// fails here rather than on a newcomer's machine.
#[test]
fn the_benchmark_prints_packets_per_second() {
    testbed::require_root();
    testbed::sweep_stale();
    let out = run(
        HUDDLE,
        &[
            "bench",
            "--pps-only",
            "--pps-frames",
            "20000",
            "--pps-rounds",
            "1",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "huddle bench: {}\n{text}\n{err}",
        out.status
    );
    let rows: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("| program on the receiving veth"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(rows.len(), 6, "the packets-per-second table:\n{text}");
    for row in rows {
        let mpps: f64 = row.split('|').nth(2).unwrap().trim().parse().unwrap();
        assert!(mpps > 0.0, "a program forwarded nothing: {row}");
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus >= 2 {
        assert!(text.contains("Two cores"), "no two-core table:\n{text}");
    }
}
