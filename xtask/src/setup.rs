//! Installing build and test prerequisites, idempotently.

use crate::{run, run_with};
use anyhow::{bail, Context, Result};
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

/// Debian packages the tests, demo and benchmarks use, as (command,
/// package): `ip`, `ethtool` (checksum offload on test hosts), `setpriv`
/// (unprivileged test), `tmux` (drives `huddle top` in a real terminal),
/// `nft` (a backend's firewall dropping SYNs, in the retry test), NGINX
/// and HAProxy, the peers the comparison benchmark (and its quick test)
/// runs against, bird2, the BGP daemon the balancers announce their
/// VIPs through (its service is never started; tests run their own),
/// `ping` (a looping ping through a router, in the routing test), and the
/// real-stack test's clients: curl, wrk, h2load (nghttp2-client) and ab
/// (apache2-utils), and openssl (the probe test's backends' certificate).
const PACKAGES: [(&str, &str); 15] = [
    ("ip", "iproute2"),
    ("/usr/sbin/nft", "nftables"),
    ("ethtool", "ethtool"),
    ("setpriv", "util-linux"),
    ("tmux", "tmux"),
    ("/usr/sbin/nginx", "nginx"),
    // NGINX's L4 proxy, a separate module in Debian.
    (
        "/usr/lib/nginx/modules/ngx_stream_module.so",
        "libnginx-mod-stream",
    ),
    ("/usr/sbin/haproxy", "haproxy"),
    ("/usr/sbin/bird", "bird2"),
    ("ping", "iputils-ping"),
    ("curl", "curl"),
    ("wrk", "wrk"),
    ("h2load", "nghttp2-client"),
    ("ab", "apache2-utils"),
    ("openssl", "openssl"),
];

/// Stops Debian's maintainer scripts from starting the packages' services
/// (NGINX and HAProxy would otherwise claim ports on the host); removed
/// when dropped.
struct NoServiceStarts(&'static str);

impl NoServiceStarts {
    fn new() -> Result<NoServiceStarts> {
        let path = "/usr/sbin/policy-rc.d";
        if Path::new(path).exists() {
            return Ok(NoServiceStarts(""));
        }
        fs::write(
            path,
            "#!/bin/sh\n# written by cargo xtask setup while installing\nexit 101\n",
        )?;
        run("chmod", &["755", path])?;
        Ok(NoServiceStarts(path))
    }
}

impl Drop for NoServiceStarts {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let _ = fs::remove_file(self.0);
        }
    }
}

fn say(msg: &str) {
    println!("[setup] {msg}");
}

fn output(prog: &str, args: &[&str]) -> Result<String> {
    let o = Command::new(prog)
        .args(args)
        .output()
        .with_context(|| format!("running {prog}"))?;
    if !o.status.success() {
        bail!(
            "{prog} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

pub fn all() -> Result<()> {
    rust_src()?;
    bpf_linker()?;
    packages()?;
    bpffs()?;
    say("ready");
    Ok(())
}

fn nightly_sysroot() -> Result<PathBuf> {
    let s = output("rustc", &["+nightly", "--print", "sysroot"])
        .context("the nightly toolchain is needed to build the XDP program (rustup toolchain install nightly)")?;
    Ok(PathBuf::from(s.trim()))
}

fn rust_src() -> Result<()> {
    let src = nightly_sysroot()?.join("lib/rustlib/src/rust/library/core");
    if src.exists() {
        say("nightly rust-src: present");
        return Ok(());
    }
    say("nightly rust-src: installing (rustup component add rust-src --toolchain nightly)");
    run_with(
        "rustup",
        &["component", "add", "rust-src", "--toolchain", "nightly"],
        &[],
    )
}

/// bpf-linker must use the same LLVM as the nightly's rustc. The nightly
/// ships it as a shared library; bpf-linker is built against it through a
/// folder of symlinks named after that library, which must stay in place.
fn bpf_linker() -> Result<()> {
    let sysroot = nightly_sysroot()?;
    let lib = fs::read_dir(sysroot.join("lib"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so."))
        })
        .context("the nightly toolchain has no libLLVM.so.* in its lib folder")?;
    let lib_name = lib
        .file_name()
        .and_then(|n| n.to_str())
        .context("LLVM library name")?
        .to_string();
    let version = output("rustc", &["+nightly", "-vV"])?;
    let major = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("rustc +nightly -vV shows no LLVM version")?
        .to_string();
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    let prefix = cargo_home.join("huddle-llvm").join(&lib_name);
    let linker = cargo_home.join("bin/bpf-linker");
    let marker = prefix.join("bpf-linker-built");
    if linker.exists()
        && marker.exists()
        && Command::new(&linker)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        say(&format!("bpf-linker: present, built against {lib_name}"));
        return Ok(());
    }
    say(&format!(
        "bpf-linker: building against the nightly's LLVM {major} ({lib_name}), about a minute"
    ));
    let libdir = prefix.join("lib");
    fs::create_dir_all(&libdir)?;
    for name in ["libLLVM.so", lib_name.as_str()] {
        let link = libdir.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link)
            .with_context(|| format!("symlink {}", link.display()))?;
    }
    let feature = format!("llvm-{major}");
    run_with(
        "cargo",
        &[
            "install",
            "bpf-linker",
            "--locked",
            "--force",
            "--no-default-features",
            "--features",
            &feature,
        ],
        &[("LLVM_PREFIX", &prefix)],
    )?;
    fs::write(&marker, &feature)?;
    Ok(())
}

fn have(cmd: &str) -> bool {
    if cmd.starts_with('/') {
        return Path::new(cmd).exists();
    }
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(cmd, _)| !have(cmd))
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        say("Debian packages: present");
        return Ok(());
    }
    say(&format!(
        "Debian packages: installing {}",
        missing.join(" ")
    ));
    let _guard = NoServiceStarts::new()?;
    run("apt-get", &["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(missing);
    run("apt-get", &args)
}

fn bpffs() -> Result<()> {
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    if mounts
        .lines()
        .any(|l| l.split_whitespace().nth(2) == Some("bpf"))
    {
        say("bpffs: mounted");
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        say("bpffs: not mounted (needs root; skipped)");
        return Ok(());
    }
    say("bpffs: mounting at /sys/fs/bpf");
    run("mount", &["-t", "bpf", "bpf", "/sys/fs/bpf"])
}
