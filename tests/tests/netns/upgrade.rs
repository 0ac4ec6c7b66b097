//! Upgrades over a running data plane whose map layouts changed (issue
//! 30). The previous release (`fabdcf1`, built from git by `cargo xtask
//! test`, which names it in `HC_PREVIOUS_HUDDLE`) runs under keep-alive
//! and new-connection load with a flow table of 131,072 more flows; this
//! build starts over it and migrates its maps. Then a downgrade, and a
//! layout this build does not know, are each refused with the data plane
//! left forwarding.

use huddle_common::{maps, FlowKey, KernelConfig, LAYOUT_VERSION};
use huddle_user::kernel::rawmap::{pod_bytes as bytes, read_pod as read, RawMap, ANY};
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::atomic::Ordering,
    thread,
    time::{Duration, Instant},
};
use testbed::{
    backend_ip, require_root, xdp_attached, HeldConnections, OpenLoop, Testbed, HTTP_PORT, VIP,
};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");
const N: usize = 4;
/// Keep-alive connections: 4 threads of 50, each asking every 50 ms.
const THREADS: usize = 4;
const PER_THREAD: usize = 50;
/// Flows written into the old flow table besides the real ones.
const FILL: u32 = 131_072;

/// The upgrade under the load runs alone: beside the two other
/// testbeds its start took 10-14 s, not 9, and in two of five such runs
/// one new connection opened between the copy and the swap timed out
/// (docs/operations/restarts.md, known gap).
static ALONE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// The previous release's `huddle`.
fn previous() -> PathBuf {
    let p = std::env::var_os("HC_PREVIOUS_HUDDLE").map(PathBuf::from).expect(
        "HC_PREVIOUS_HUDDLE: the previous release's huddle, which `cargo xtask test` builds from git",
    );
    assert!(p.exists(), "{} is missing", p.display());
    p
}

fn args(bed: &Testbed) -> Vec<String> {
    let config = bed.dir.join("huddle.toml");
    std::fs::write(&config, "flow_table_size = 262144\n").unwrap();
    let mut a = vec![
        "--config".to_string(),
        config.display().to_string(),
        "--vip".into(),
        format!("{VIP}:80"),
    ];
    for i in 0..N {
        a.push("--backend".into());
        a.push(format!("{}:{HTTP_PORT}", backend_ip(i)));
    }
    a
}

/// Writes `n` made-up established flows into the flow table pinned in
/// `pins`, each a copy of a real one but for its client.
fn fill_flows(pins: &Path, n: u32) {
    let flows = RawMap::open(&pins.join(maps::FLOWS)).expect("FLOWS");
    let real = flows.keys().expect("keys");
    let value = real
        .iter()
        .find_map(|k| flows.get(k).ok().flatten())
        .expect("a real flow to copy");
    let template: FlowKey = read(&real[0]);
    for i in 0..n {
        let mut k = template;
        k.client = huddle_common::addr_v4([10, 96 + (i >> 16) as u8, (i >> 8) as u8, i as u8]);
        k.client_port_be = 40_000u16.to_be();
        flows.put(&bytes(&k), &value, ANY).expect("a made-up flow");
    }
}

/// `threads` x `per_thread` keep-alive connections asking every 50 ms,
/// once all are open, and 100 new connections a second, to the VIP.
fn traffic(bed: &Testbed, threads: usize, per_thread: usize) -> (HeldConnections, OpenLoop) {
    let vip: SocketAddr = (VIP, 80).into();
    let held = HeldConnections::start(
        &bed.client,
        vip,
        threads,
        per_thread,
        Duration::from_millis(50),
    );
    let load = OpenLoop::start(&bed.client, vip, 100.0, Duration::from_secs(3));
    held.wait_opened((threads * per_thread) as u64, Duration::from_secs(10))
        .expect("keep-alive connections opened");
    (held, load)
}

/// The client's ports of `HeldHandshake`s: the first opened before the
/// upgrade, the rest during it. Above the kernel's ephemeral ports
/// (32768-60999), which the load's connections take: their tuples and the
/// firewall rule would otherwise meet.
const HELD_PORTS: std::ops::Range<u16> = 61_001..61_401;

/// A connection whose handshake is under way in the balancer across the
/// upgrade: the client's firewall (`hold`) drops all but SYNs from its
/// port, so its ACK of the SYN-ACK never came and the flow sits in the
/// half-open tables; `finish` asks a request once `release` let it out.
struct HeldHandshake(Result<std::net::TcpStream, String>);

/// `nft` in namespace `ns`.
fn nft(ns: &str, rule: &str) {
    let (ok, _, err) =
        testbed::output(Path::new("ip"), &["netns", "exec", ns, "nft", rule]).expect("nft");
    assert!(ok, "nft {rule}: {err}");
}

/// Drops all but SYNs from `HELD_PORTS` in namespace `ns`.
fn hold(ns: &str) {
    nft(ns, "add table ip held");
    nft(
        ns,
        "add chain ip held out { type filter hook output priority 0 ; }",
    );
    nft(
        ns,
        &format!(
            "add rule ip held out tcp sport {}-{} tcp flags & syn == 0 drop",
            HELD_PORTS.start,
            HELD_PORTS.end - 1
        ),
    );
}

fn release(ns: &str) {
    nft(ns, "delete table ip held");
}

impl HeldHandshake {
    fn open(ns: &str, port: u16) -> HeldHandshake {
        let name = ns.to_string();
        let stream = std::thread::spawn(move || {
            huddle_user::sys::netns::enter(&name).expect("enter namespace");
            connect_from(port, std::net::SocketAddrV4::new(VIP, 80))
        })
        .join()
        .unwrap()
        .map_err(|e| format!("connect: {e}"));
        HeldHandshake(stream)
    }

    /// The answer's first line, or why there is none.
    fn finish(self) -> Result<String, String> {
        use std::io::{BufRead, BufReader, Write};
        let mut s = self.0?;
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(s)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        Ok(line.trim_end().to_string())
    }
}

/// From when the log at `log` says the migration's copy is made until
/// `done`, opens a `HeldHandshake` every 20 ms: those before the swap (a
/// window of 50 ms to 2 s here) only the pass after it can carry.
fn hold_during(
    ns: &str,
    log: PathBuf,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> thread::JoinHandle<Vec<HeldHandshake>> {
    let ns = ns.to_string();
    thread::spawn(move || {
        let t = Instant::now();
        let mut held = Vec::new();
        let mut ports = HELD_PORTS.skip(1);
        while !done.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(60) {
            if held.is_empty() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if !text.contains("migrated layout") {
                    thread::sleep(Duration::from_millis(5));
                    continue;
                }
            }
            let Some(port) = ports.next() else { break };
            held.push(HeldHandshake::open(&ns, port));
            thread::sleep(Duration::from_millis(20));
        }
        held
    })
}

/// A TCP connection from `port` of this namespace's address to `to`.
fn connect_from(port: u16, to: std::net::SocketAddrV4) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let sin = |a: std::net::SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain system calls on a socket this function owns (the
    // stream closes it on every return), with addresses of `len` bytes.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = std::net::TcpStream::from_raw_fd(fd);
        let one: libc::c_int = 1;
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            std::ptr::from_ref(&one).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        );
        let local = sin(std::net::SocketAddrV4::new(
            std::net::Ipv4Addr::UNSPECIFIED,
            port,
        ));
        if libc::bind(fd, std::ptr::from_ref(&local).cast(), len) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let remote = sin(to);
        if libc::connect(fd, std::ptr::from_ref(&remote).cast(), len) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

/// A counter of the service.
fn service_counter(bed: &Testbed, counter: &str) -> u64 {
    bed.status().expect("status").services[0].counters[counter]
}

/// Sum of a counter over the service's backends.
fn total(bed: &Testbed, counter: &str) -> u64 {
    bed.status().expect("status").services[0]
        .backends
        .iter()
        .map(|b| b.counters[counter])
        .sum()
}

/// Starts `bin` over the running data plane, expecting a refusal: its
/// reason (the log's last line naming the pinned data plane).
fn refused(bed: &mut Testbed, bin: &Path, args: &[String]) -> String {
    let before = bed.huddle_log().len();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let e = bed
        .start_huddle(bin, &a)
        .expect_err("a start over a data plane it cannot take over");
    let log = bed.huddle_log();
    let reason = log[before..]
        .lines()
        .rev()
        .find(|l| l.contains("pinned under"))
        .unwrap_or_else(|| panic!("no reason given: {e:#}\n{}", &log[before..]))
        .to_string();
    bed.huddle = None;
    reason
}

/// Errors over the connections and requests since `load` and `held`
/// started: (failed new-connection requests, broken keep-alive ones).
fn outcome(load: OpenLoop, held: HeldConnections) -> (Vec<String>, Vec<String>, usize, u64) {
    let asked = held.asked.load(Ordering::Relaxed);
    let broken = held.stop();
    let outcomes = load.stop();
    let failed = outcomes
        .iter()
        .filter_map(|o| {
            o.result
                .as_ref()
                .err()
                .map(|e| format!("at {:?}: {e}", o.at))
        })
        .collect();
    (failed, broken, outcomes.len(), asked)
}

/// One upgrade from the previous release under load; `flows`: whether
/// the migration carries the flow and NAT tables (off: the control).
fn upgrade(tag: &str, flows: bool) -> (Testbed, Vec<String>, Vec<String>) {
    let mut bed = Testbed::new(tag, N).expect("testbed");
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    let args = args(&bed);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    bed.start_huddle(&previous(), &a)
        .unwrap_or_else(|e| panic!("the previous release: {e:#}"));
    // The control's broken connections each wait out a request timeout
    // (5 s), one after the other in their thread: fewer a thread there.
    let (threads, per_thread) = if flows {
        (THREADS, PER_THREAD)
    } else {
        (20, 2)
    };
    let (held, load) = traffic(&bed, threads, per_thread);
    thread::sleep(Duration::from_secs(1));
    if flows {
        fill_flows(&bed.pins, FILL);
    }
    let lost_before = service_counter(&bed, "half_open_lost");
    hold(&bed.client.name);
    let handshake = HeldHandshake::open(&bed.client.name, HELD_PORTS.start);
    // As `systemctl restart` after `dpkg -i` does: SIGTERM leaves the
    // data plane running; the new build starts over it.
    bed.kill_huddle(libc::SIGTERM);
    let opened_before = load.start.elapsed();
    if !flows {
        bed.huddle_env = vec![("HUDDLE_MIGRATE_FLOWS".into(), "0".into())];
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let during = hold_during(&bed.client.name, bed.dir.join("huddle.log"), done.clone());
    let t0 = Instant::now();
    bed.start_huddle(Path::new(HUDDLE), &a)
        .unwrap_or_else(|e| panic!("this build over the previous release: {e:#}"));
    let took = t0.elapsed();
    bed.huddle_env.clear();
    done.store(true, Ordering::Relaxed);
    let during = during.join().unwrap();
    release(&bed.client.name);
    let opened = during.len();
    // All at once: each one not carried waits out its 5 s.
    let answers: Vec<Result<String, String>> = std::iter::once(handshake)
        .chain(during)
        .map(|h| thread::spawn(move || h.finish()))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|j| j.join().unwrap())
        .collect();
    let ok = answers
        .iter()
        .filter(|a| a.as_deref().is_ok_and(|l| l.contains(" 200")))
        .count();
    // A SYN whose half-open slot is taken takes it over (a flood never
    // fills the table): a handshake held for seconds beside 100 SYNs a
    // second may lose its slot, upgrade or not, and is counted.
    let lost = service_counter(&bed, "half_open_lost").saturating_sub(lost_before);
    println!(
        "{tag}: handshakes under way across the upgrade (1 opened before it, {opened} from its copy on), answered after it: {ok} of {}; half-open slots taken over meanwhile: {lost}; {:?}",
        answers.len(),
        answers.iter().find(|a| a.is_err())
    );
    assert!(opened > 0, "no handshake opened during the upgrade");
    if flows {
        assert!(
            answers.len() - ok <= lost as usize,
            "{} unanswered, {lost} slots lost: {answers:?}",
            answers.len() - ok
        );
    } else {
        assert!(
            answers[0].is_err(),
            "the control carried a handshake: {answers:?}"
        );
    }
    // Long enough for a keep-alive request without its flow to time out.
    thread::sleep(Duration::from_secs(if flows { 3 } else { 7 }));
    let st = bed.status().expect("status");
    let active: u64 = st.services[0].backends.iter().map(|b| b.active_flows).sum();
    let per_backend: Vec<String> = st.services[0]
        .backends
        .iter()
        .map(|b| {
            let c = |n: &str| b.counters.get(n).copied().unwrap_or(0);
            format!(
                "{} (new {}, closed {})",
                b.active_flows,
                c("flows_new"),
                c("flows_closed")
            )
        })
        .collect();
    let flows_new = total(&bed, "flows_new");
    let (failed, broken, sent, asked) = outcome(load, held);
    let log = bed.huddle_log();
    let migrated = log
        .lines()
        .find(|l| l.contains("migrated layout"))
        .unwrap_or("(no migration line)")
        .to_string();
    let steps: Vec<&str> = log
        .lines()
        .filter(|l| {
            ["layout 1:", "after the swap", "took over", "attached to"]
                .iter()
                .any(|w| l.contains(w))
        })
        .collect();
    println!(
        "{tag}: upgrade from the previous release (flows carried: {flows}) started in {} ms, {} s into the load: {}\n{}\n  \
         {sent} new-connection requests, {} failed; {} keep-alive connections asked {asked} times, {} broken; \
         status after: {active} active flows ({}), flows_new {flows_new}; xdp {}",
        took.as_millis(),
        opened_before.as_secs(),
        migrated,
        steps.join("\n"),
        failed.len(),
        threads * per_thread,
        broken.len(),
        per_backend.join(", "),
        st.xdp_mode
    );
    // What the start did between the copy and the swap (the window in
    // which the old program still opens connections).
    let window: Vec<&str> = log
        .lines()
        .skip_while(|l| !l.contains("migrated layout"))
        .take_while(|l| !l.contains("after the swap"))
        .skip(1)
        .take(20)
        .collect();
    println!("  between the copy and the swap:\n{}", window.join("\n"));
    if flows {
        assert!(migrated.contains("TCP flows"), "{log}");
        // The keep-alive connections and every connection the old build
        // counted carried on in the new build's counters.
        // Counts the old program made between the copy and the swap are
        // added after it: without that a connection it opened there and
        // the new one closed counted as closed, never opened (199 of 200
        // in a CI run of 4 December). A connection of the load may be
        // open as status reads.
        assert!(active >= (THREADS * PER_THREAD) as u64, "active {active}");
        assert!(
            flows_new as usize >= THREADS * PER_THREAD,
            "flows_new {flows_new}"
        );
    }
    (bed, failed, broken)
}

#[test]
fn an_upgrade_from_the_previous_release_keeps_every_flow_and_a_downgrade_is_refused() {
    require_root();
    let _alone = ALONE
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (mut bed, failed, broken) = upgrade("upgrade", true);
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(
        broken.is_empty(),
        "keep-alive connections broken: {broken:?}"
    );

    // Downgrade: the previous release over this build's data plane is
    // refused, and the data plane forwards on.
    let (held, load) = traffic(&bed, 1, 20);
    bed.kill_huddle(libc::SIGTERM);
    let args = args(&bed);
    let why = refused(&mut bed, &previous(), &args);
    println!("downgrade refused: {why}");
    thread::sleep(Duration::from_secs(1));
    assert!(
        xdp_attached(&bed.lb),
        "the refused start detached the data plane"
    );
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    bed.start_huddle(Path::new(HUDDLE), &a)
        .expect("this build again");
    thread::sleep(Duration::from_secs(1));
    let (failed, broken, sent, _) = outcome(load, held);
    println!(
        "around the refused downgrade: {sent} requests, {} failed, {} broken",
        failed.len(),
        broken.len()
    );
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(broken.is_empty(), "broken: {broken:?}");
    bed.stop_huddle();
}

/// The control: the same upgrade with the flow and NAT tables left
/// behind breaks the keep-alive connections, so the test above can fail.
#[test]
fn the_same_upgrade_without_the_flows_breaks_connections() {
    require_root();
    let _shared = ALONE
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (mut bed, failed, broken) = upgrade("upnoflow", false);
    println!(
        "without the flows: {} failed, {} broken",
        failed.len(),
        broken.len()
    );
    assert!(!broken.is_empty(), "no connection broke without its flow");
    bed.stop_huddle();
}

/// A data plane recording a layout newer than this build's is refused
/// with a one-line reason and left forwarding.
#[test]
fn an_unknown_layout_is_refused_and_left_forwarding() {
    require_root();
    let _shared = ALONE
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut bed = Testbed::new("uplayout", N).expect("testbed");
    bed.start_backends(Path::new(BACKEND)).expect("backends");
    let args = args(&bed);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    bed.start_huddle(Path::new(HUDDLE), &a).expect("huddle");
    let (held, load) = traffic(&bed, 1, 20);
    bed.kill_huddle(libc::SIGTERM);
    // What a newer build would have written.
    let config = RawMap::open(&bed.pins.join(maps::CONFIG)).expect("CONFIG");
    let mut c: KernelConfig = read(&config.get(&0u32.to_ne_bytes()).unwrap().unwrap());
    c.layout = LAYOUT_VERSION + 1;
    config.put(&0u32.to_ne_bytes(), &bytes(&c), ANY).unwrap();
    let why = refused(&mut bed, Path::new(HUDDLE), &args);
    println!("refused: {why}");
    assert!(
        why.contains(&format!("layout {}", LAYOUT_VERSION + 1)),
        "{why}"
    );
    thread::sleep(Duration::from_secs(1));
    assert!(xdp_attached(&bed.lb));
    let (failed, broken, sent, _) = outcome(load, held);
    println!(
        "{sent} requests, {} failed, {} broken",
        failed.len(),
        broken.len()
    );
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(broken.is_empty(), "broken: {broken:?}");
    bed.stop_huddle();
}
