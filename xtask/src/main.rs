//! `cargo xtask setup|test|demo|bench|bench-huddle|bench-scale`: the commands of the
//! README.
//! Each installs what is missing first (nightly rust-src, bpf-linker linked
//! against the nightly's own LLVM, Debian packages, bpffs) and says what it
//! is doing; on a machine that has everything, setup takes a second.

mod package;
mod previous;
mod setup;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
};

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building and testing need; fast when all is there.
    Setup,
    /// Run every test (unit, PROG_TEST_RUN, network namespaces). Root.
    Test {
        /// Extra arguments for `cargo test` (after `--`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Demo: namespaces, balancer, backends, real traffic, a table. Root.
    Demo {
        /// How the VIP reaches its backends: snat (default), dsr-l2 or
        /// dsr-ipip (direct server return; the backends run the agent's
        /// decap).
        #[arg(long, default_value = "snat")]
        mode: String,
        /// Several balancers behind a router (BGP, ECMP, Maglev, L2 DSR)
        /// instead of one; at least 2.
        #[arg(long)]
        balancers: Option<usize>,
    },
    /// Build the Debian package (binary, systemd unit, completions, man
    /// page, example config) into target/debian.
    Package {
        /// Package this `huddle` binary instead of a fresh release build.
        #[arg(long)]
        binary: Option<PathBuf>,
        /// Folder for the .deb.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Per-packet cost of the XDP program next to baselines. Root.
    Bench {
        /// Arguments for `huddle bench` (after `--`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// HuddleCluster against round robin, NGINX and HAProxy on slow and
    /// failing backends, plus the data plane figures. Root.
    BenchHuddle {
        /// Arguments for `hc-compare` (after `--`), e.g. `--quick`,
        /// `--trials 5`, `--out DIR`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// What the control plane costs as services and backends grow: one
    /// row per size (start, RSS, CPU, ticks, probes, /metrics, reloads, a
    /// slow backend's leave). Root.
    BenchScale {
        /// Arguments for `hc-scale` (after `--`), e.g. `--sizes 1x4,64x16`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// The huddle beside kernel DNAT with NGINX backends and wrk, h2load
    /// and curl clients on one bed (downloads checked, req/s, P99, shares,
    /// moves). Root.
    BenchReal {
        /// Arguments for `hc-realload` (after `--`), e.g. `--starve --gro off`.
        #[arg(last = true)]
        args: Vec<String>,
    },
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{what} needs root (network namespaces and XDP); run it with sudo or as root");
    }
    Ok(())
}

/// Runs a command in the workspace root, echoing it first.
fn run(prog: &str, args: &[&str]) -> Result<()> {
    run_with(prog, args, &[])
}

/// Runs a command in the workspace root with extra environment variables,
/// echoing it first.
fn run_with(prog: &str, args: &[&str], envs: &[(&str, &std::path::Path)]) -> Result<()> {
    println!("==> {prog} {}", args.join(" "));
    let status = Command::new(prog)
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(root())
        .status()
        .with_context(|| format!("running {prog}"))?;
    if !status.success() {
        bail!("{prog} {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Runs `cargo args`, echoing its output, and ends with one line that
/// adds up every test binary's result.
fn run_tests(args: &[&str]) -> Result<()> {
    // The upgrade test starts this build over the previous release's.
    let previous = previous::build(&root())?;
    println!("==> cargo {}", args.join(" "));
    let mut child = Command::new("cargo")
        .args(args)
        .env("HC_PREVIOUS_HUDDLE", previous)
        .current_dir(root())
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo test")?;
    let (mut passed, mut failed) = (0u64, 0u64);
    for line in BufReader::new(child.stdout.take().context("cargo stdout")?).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            let num = |word: &str| {
                rest.split(';')
                    .find_map(|part| {
                        part.trim()
                            .strip_suffix(word)
                            .and_then(|n| n.trim().rsplit(' ').next()?.parse::<u64>().ok())
                    })
                    .unwrap_or(0)
            };
            passed += num(" passed");
            failed += num(" failed");
        }
    }
    let status = child.wait()?;
    println!("\ntests: {passed} passed, {failed} failed");
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Builds the release binaries of `packages`.
fn build_release(packages: &[&str]) -> Result<()> {
    let mut a = vec!["build", "--release", "--bins"];
    for p in packages {
        a.extend(["-p", p]);
    }
    run("cargo", &a)
}

/// The path of release binary `name`.
fn release_bin(name: &str) -> Result<String> {
    root()
        .join("target/release")
        .join(name)
        .to_str()
        .map(str::to_string)
        .context("a non-UTF-8 path")
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::all(),
        Cmd::Test { args } => {
            require_root("cargo xtask test")?;
            setup::all()?;
            let mut a = vec!["test", "--workspace", "--exclude", "huddle-ebpf"];
            a.extend(args.iter().map(String::as_str));
            run_tests(&a)
        }
        Cmd::Demo { mode, balancers } => {
            require_root("cargo xtask demo")?;
            setup::all()?;
            build_release(&["huddle-user", "tests"])?;
            let huddle = release_bin("huddle")?;
            let n = balancers.map(|n| n.to_string());
            let mut a = vec!["--huddle", huddle.as_str(), "--mode", mode.as_str()];
            if let Some(n) = &n {
                a.extend(["--balancers", n.as_str()]);
            }
            run(&release_bin("hc-demo")?, &a)
        }
        Cmd::BenchHuddle { args } => {
            require_root("cargo xtask bench-huddle")?;
            setup::all()?;
            build_release(&["huddle-user", "tests"])?;
            let huddle = release_bin("huddle")?;
            let huddle = huddle.as_str();
            println!("\n## Data plane: ns per packet (BPF_PROG_TEST_RUN) and packets per second on veth\n");
            run(huddle, &["bench"])?;
            println!("\n## Balancers compared on slow and failing backends\n");
            let mut a = vec!["--huddle", huddle];
            a.extend(args.iter().map(String::as_str));
            run(&release_bin("hc-compare")?, &a)
        }
        Cmd::BenchReal { args } => {
            require_root("cargo xtask bench-real")?;
            setup::all()?;
            build_release(&["huddle-user", "tests"])?;
            let huddle = release_bin("hc-huddle")?;
            let mut a = vec!["--huddle", huddle.as_str()];
            a.extend(args.iter().map(String::as_str));
            run(&release_bin("hc-realload")?, &a)
        }
        Cmd::BenchScale { args } => {
            require_root("cargo xtask bench-scale")?;
            setup::all()?;
            build_release(&["huddle-user", "tests"])?;
            let huddle = release_bin("huddle")?;
            let mut a = vec!["--huddle", huddle.as_str()];
            a.extend(args.iter().map(String::as_str));
            run(&release_bin("hc-scale")?, &a)
        }
        Cmd::Package { binary, out } => {
            let binary = match binary {
                Some(b) => b,
                None => {
                    setup::all()?;
                    build_release(&["huddle-user"])?;
                    PathBuf::from(release_bin("huddle")?)
                }
            };
            let out = out.unwrap_or_else(|| root().join("target/debian"));
            let deb = package::build(&binary, &root().join("packaging"), &out)?;
            println!("{}", deb.display());
            Ok(())
        }
        Cmd::Bench { args } => {
            require_root("cargo xtask bench")?;
            setup::all()?;
            build_release(&["huddle-user"])?;
            let mut a = vec!["bench"];
            a.extend(args.iter().map(String::as_str));
            run(&release_bin("huddle")?, &a)
        }
    }
}
