//! Announcing the VIPs through bird2, the BGP daemon on this host: huddle
//! writes the routes of the VIPs it serves now into a file bird.conf
//! includes (two static protocols, `huddle_v4` and `huddle_v6`, whose
//! routes the operator's BGP sessions export), then asks bird over its
//! control socket to read its configuration again. A VIP is announced
//! while the data plane is attached and one of its services has a ring
//! with a healthy backend; everything is withdrawn on `drain-balancer` and
//! before `huddle stop` removes the data plane.
//!
//! bird2 rather than FRR or GoBGP: one small Debian package, a config that
//! includes a file, BFD built in, and a line protocol on its control
//! socket that needs no client library (FRR needs vtysh and several
//! daemons, GoBGP a gRPC client).

use crate::config::Bgp;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader, Write},
    net::IpAddr,
    os::unix::net::UnixStream,
    path::Path,
    time::{Duration, Instant},
};

/// How long a talk with bird may take.
const BIRD_TIMEOUT: Duration = Duration::from_secs(2);
/// A failed announcement is tried again this often, and bird's sessions
/// are looked at this often.
const RETRY: Duration = Duration::from_secs(2);

/// What `huddle status` shows of the announcements.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BgpStatus {
    /// VIPs bird was last told to announce and accepted.
    pub announced: Vec<String>,
    /// Withdrawn on purpose (`huddle drain-balancer`).
    pub drained: bool,
    /// Why the last attempt failed, if it did.
    pub error: Option<String>,
}

pub struct Announcer {
    cfg: Bgp,
    /// What bird accepted last; `None` before the first success.
    announced: Option<BTreeSet<IpAddr>>,
    pub drained: bool,
    error: Option<String>,
    retry_at: Option<Instant>,
    checked_at: Option<Instant>,
}

impl Announcer {
    #[must_use]
    pub fn new(cfg: Bgp) -> Announcer {
        Announcer {
            cfg,
            announced: None,
            drained: false,
            error: None,
            retry_at: None,
            checked_at: None,
        }
    }

    /// Makes bird announce exactly `want` (nothing while drained). Does
    /// nothing when that is what bird has; after a failure, tries again
    /// every `RETRY`. Returns what to log: a change made, or a failure.
    pub fn sync(&mut self, want: BTreeSet<IpAddr>) -> Option<Result<String, String>> {
        let want = if self.drained { BTreeSet::new() } else { want };
        if self.announced.as_ref() == Some(&want) {
            return self.check();
        }
        if self.retry_at.is_some_and(|t| Instant::now() < t) {
            return None;
        }
        match announce(&self.cfg, &want) {
            Ok(()) => {
                self.announced = Some(want.clone());
                self.retry_at = None;
                let was_failing = self.error.take().is_some();
                let list = list(&want);
                Some(Ok(if was_failing {
                    format!("bgp: bird answers again; announcing {list}")
                } else {
                    format!("bgp: announcing {list}")
                }))
            }
            Err(e) => {
                let msg = format!("{e:#}");
                self.retry_at = Some(Instant::now() + RETRY);
                let first = self.error.as_deref() != Some(msg.as_str());
                self.error = Some(msg.clone());
                first.then(|| {
                    Err(format!(
                        "bgp: {msg}; the VIPs are not announced as they should be (the data plane keeps forwarding what reaches it); retrying every {}s",
                        RETRY.as_secs()
                    ))
                })
            }
        }
    }

    /// Every `RETRY`: whether bird answers and has an established BGP
    /// session (a bird that is gone, or a router refusing the session,
    /// announces nothing, whatever the routes file says).
    fn check(&mut self) -> Option<Result<String, String>> {
        if self.checked_at.is_some_and(|t| t.elapsed() < RETRY) {
            return None;
        }
        self.checked_at = Some(Instant::now());
        let problem = match bird(&self.cfg.control_socket, "show protocols") {
            Err(e) => Some(format!("{e:#}")),
            Ok(lines) => {
                let (up, down) = sessions(&lines);
                match (up, down.is_empty()) {
                    (0, true) => Some("bird runs no BGP session".to_string()),
                    (0, false) => Some(format!("no BGP session established ({})", down.join(", "))),
                    _ => None,
                }
            }
        };
        match problem {
            None => self.error.take().map(|_| {
                Ok("bgp: bird answers again and a BGP session is established".to_string())
            }),
            Some(p) => {
                let first = self.error.as_deref() != Some(p.as_str());
                self.error = Some(p.clone());
                first.then(|| {
                    Err(format!(
                        "bgp: {p}: the VIPs are not announced to the router (the data plane keeps forwarding what reaches it)"
                    ))
                })
            }
        }
    }

    /// Lets the next `sync` try at once, even after a recent failure.
    pub fn retry_now(&mut self) {
        self.retry_at = None;
    }

    /// Withdraws every VIP now (before the data plane goes).
    pub fn withdraw_all(&mut self) -> Result<()> {
        announce(&self.cfg, &BTreeSet::new())?;
        self.announced = Some(BTreeSet::new());
        Ok(())
    }

    #[must_use]
    pub fn status(&self) -> BgpStatus {
        BgpStatus {
            announced: self
                .announced
                .iter()
                .flatten()
                .map(ToString::to_string)
                .collect(),
            drained: self.drained,
            error: self.error.clone(),
        }
    }
}

fn list(vips: &BTreeSet<IpAddr>) -> String {
    if vips.is_empty() {
        return "nothing (every VIP withdrawn)".into();
    }
    vips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The routes file for `vips`: both static protocols always, so the BGP
/// sessions' export filters naming them stay valid with nothing to say.
#[must_use]
pub fn routes_text(vips: &BTreeSet<IpAddr>) -> String {
    let routes = |v6: bool| {
        vips.iter()
            .filter(|ip| ip.is_ipv6() == v6)
            .map(|ip| format!("  route {ip}/{} blackhole;\n", if v6 { 128 } else { 32 }))
            .collect::<String>()
    };
    format!(
        "# Written by huddle: the VIPs this balancer announces now.\n\
         protocol static huddle_v4 {{\n  ipv4;\n{}}}\n\
         protocol static huddle_v6 {{\n  ipv6;\n{}}}\n",
        routes(false),
        routes(true)
    )
}

/// Of bird's `show protocols` answer: how many BGP sessions are
/// established, and the others as "name: state info".
fn sessions(lines: &[String]) -> (usize, Vec<String>) {
    let mut up = 0;
    let mut down = Vec::new();
    for line in lines {
        // "1002-name proto table state since info", or the same after a
        // leading space (a continuation line).
        let body = match line.as_bytes().get(4) {
            Some(b'-') => line.get(5..).unwrap_or(""),
            _ => line.as_str(),
        };
        let f: Vec<&str> = body.split_whitespace().collect();
        if f.len() < 4 || f[1] != "BGP" {
            continue;
        }
        if body.contains("Established") {
            up += 1;
        } else {
            let info = f.get(5..).unwrap_or_default().join(" ");
            down.push(format!("{}: {} {info}", f[0], f[3]).trim_end().to_string());
        }
    }
    (up, down)
}

/// Writes the routes file (whole, by rename) and has bird read it.
fn announce(cfg: &Bgp, vips: &BTreeSet<IpAddr>) -> Result<()> {
    let file = &cfg.routes_file;
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    crate::sys::files::write_atomic(file, routes_text(vips).as_bytes(), 0o644)?;
    bird(&cfg.control_socket, "configure")?;
    Ok(())
}

/// Longest line read from bird's socket, and most lines in one answer: a
/// socket that answers without end is refused, not read into memory.
const MAX_BIRD_LINE: u64 = 4096;
const MAX_BIRD_LINES: usize = 10_000;

/// One line from bird's socket, at most `MAX_BIRD_LINE` bytes, without its
/// line end; bytes that are not UTF-8 are replaced, never trusted.
fn bird_line<R: BufRead>(r: &mut R) -> Result<String> {
    let mut buf = Vec::new();
    let n = <&mut R as std::io::Read>::take(r, MAX_BIRD_LINE).read_until(b'\n', &mut buf)?;
    if n == 0 {
        bail!("bird closed the connection in the middle of an answer");
    }
    if buf.last() != Some(&b'\n') && n as u64 == MAX_BIRD_LINE {
        bail!("a line of bird's answer runs past {MAX_BIRD_LINE} bytes");
    }
    Ok(String::from_utf8_lossy(&buf).trim_end().to_string())
}

/// Sends `command` to bird's control socket and returns its answer's
/// lines; an error carries bird's own words.
pub fn bird(socket: &Path, command: &str) -> Result<Vec<String>> {
    let s = UnixStream::connect(socket)
        .with_context(|| format!("bird's control socket {}", socket.display()))?;
    s.set_read_timeout(Some(BIRD_TIMEOUT))?;
    s.set_write_timeout(Some(BIRD_TIMEOUT))?;
    let mut r = BufReader::new(s.try_clone()?);
    let greeting = bird_line(&mut r).context("reading bird's greeting")?;
    if !greeting.starts_with("0001 ") {
        bail!(
            "{} does not answer as bird does: {greeting:?}",
            socket.display()
        );
    }
    (&s).write_all(format!("{command}\n").as_bytes())?;
    let mut lines = Vec::new();
    // Every line: a 4-digit code, then '-' (more follows) or ' ' (last);
    // a line starting with a space continues the one before.
    loop {
        let line = bird_line(&mut r).context("reading bird's answer")?;
        if lines.len() >= MAX_BIRD_LINES {
            bail!("bird's answer to {command:?} runs past {MAX_BIRD_LINES} lines");
        }
        let coded = line
            .as_bytes()
            .get(..4)
            .is_some_and(|c| c.iter().all(u8::is_ascii_digit));
        let last = coded && matches!(line.as_bytes().get(4), None | Some(b' '));
        if last && !line.starts_with('0') && !line.starts_with('1') {
            bail!("bird refused {command:?}: {}", line.get(5..).unwrap_or(""));
        }
        lines.push(line);
        if last {
            return Ok(lines);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn the_routes_file_has_both_protocols_whatever_is_announced() {
        let none = routes_text(&BTreeSet::new());
        assert!(none.contains("protocol static huddle_v4 {\n  ipv4;\n}"));
        assert!(none.contains("protocol static huddle_v6 {\n  ipv6;\n}"));
        let some: BTreeSet<IpAddr> =
            ["10.0.100.1".parse().unwrap(), "fd00::100".parse().unwrap()].into();
        let text = routes_text(&some);
        assert!(text.contains("  ipv4;\n  route 10.0.100.1/32 blackhole;\n}"));
        assert!(text.contains("  ipv6;\n  route fd00::100/128 blackhole;\n}"));
    }

    /// A fake bird answering one connection with `answer`.
    fn fake_bird(dir: &Path, answer: &'static str) -> std::path::PathBuf {
        let path = dir.join("bird.ctl");
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"0001 BIRD 2.0.12 ready.\n").unwrap();
            let mut cmd = String::new();
            BufReader::new(s.try_clone().unwrap())
                .read_line(&mut cmd)
                .unwrap();
            s.write_all(answer.as_bytes()).unwrap();
        });
        path
    }

    #[test]
    fn sessions_are_read_from_show_protocols() {
        let lines: Vec<String> = [
            "1002-Name       Proto      Table      State  Since         Info",
            "device1    Device     ---        up     22:50:45.280  ",
            " r1         BGP        ---        up     22:50:50.095  Established   ",
            " r2         BGP        ---        start  22:50:45.280  Active        Socket: Connection refused",
            "0000 ",
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        let (up, down) = sessions(&lines);
        assert_eq!(up, 1);
        assert_eq!(down, vec!["r2: start Active Socket: Connection refused"]);
    }

    #[test]
    fn birds_answers_and_refusals_are_read() {
        let dir = std::env::temp_dir().join(format!("huddle-bird-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ok = fake_bird(
            &dir,
            "0002-Reading configuration from b.conf\n0003 Reconfigured\n",
        );
        assert_eq!(
            bird(&ok, "configure").unwrap().last().unwrap(),
            "0003 Reconfigured"
        );
        std::fs::remove_file(&ok).unwrap();
        let bad = fake_bird(
            &dir,
            "0002-Reading configuration from b.conf\n8002 /run/huddle/x.conf:3:25 syntax error\n",
        );
        let e = format!("{:#}", bird(&bad, "configure").unwrap_err());
        assert!(
            e.contains("bird refused \"configure\": /run/huddle/x.conf:3:25 syntax error"),
            "{e}"
        );
        std::fs::remove_file(&bad).unwrap();
        let e = format!(
            "{:#}",
            bird(&dir.join("none.ctl"), "configure").unwrap_err()
        );
        assert!(e.contains("bird's control socket"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn short_multibyte_and_endless_answers_neither_panic_nor_grow() {
        // Four fields, not established: once a slice past the end.
        let lines: Vec<String> = [" r3 BGP --- start", "é1 BGP x y", "\u{1F427}-é"]
            .iter()
            .map(ToString::to_string)
            .collect();
        let (up, down) = sessions(&lines);
        assert_eq!(
            (up, down),
            (0, vec!["r3: start".to_string(), "é1: y".to_string()])
        );
        let dir = std::env::temp_dir().join(format!("huddle-bird-odd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A multibyte character across the code's four bytes, then a last
        // line: read, not a panic.
        let odd = fake_bird(&dir, "0\u{e9}02-x\n0003 done\n");
        assert_eq!(bird(&odd, "configure").unwrap().len(), 2);
        std::fs::remove_file(&odd).unwrap();
        // One line without end: refused at the bound.
        let endless: &'static str = Box::leak("1".repeat(1 << 20).into_boxed_str());
        let big = fake_bird(&dir, endless);
        let e = format!("{:#}", bird(&big, "configure").unwrap_err());
        assert!(e.contains("runs past 4096 bytes"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
