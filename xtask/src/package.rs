//! `cargo xtask package`: a Debian package of the `huddle` binary with its
//! systemd template unit, shell completions, man page and an example
//! config, staged in a folder and built with `dpkg-deb` (part of every
//! Debian system), so no packaging tool needs installing.

use anyhow::{bail, Context, Result};
use std::{
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

/// Runs `prog args`, returning its standard output.
fn stdout_of(prog: &Path, args: &[&str]) -> Result<Vec<u8>> {
    let out = Command::new(prog)
        .args(args)
        .output()
        .with_context(|| format!("running {} {}", prog.display(), args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "{} {} failed: {}",
            prog.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::create_dir_all(path.parent().context("a path with a parent")?)?;
    fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
    Ok(())
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut child = Command::new("gzip")
        .args(["-9", "-n", "-c"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("running gzip")?;
    child.stdin.take().context("gzip stdin")?.write_all(bytes)?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("gzip failed");
    }
    Ok(out.stdout)
}

/// Builds `huddle_VERSION_ARCH.deb` in `out` from `binary` and the files in
/// `packaging`; returns its path.
pub fn build(binary: &Path, packaging: &Path, out: &Path) -> Result<PathBuf> {
    let version_line = String::from_utf8(stdout_of(binary, &["--version"])?)?;
    let version = version_line
        .split_whitespace()
        .nth(1)
        .context("`huddle --version` printed no version")?
        .to_string();
    let arch = String::from_utf8(stdout_of(Path::new("dpkg"), &["--print-architecture"])?)?
        .trim()
        .to_string();
    let stage = out.join(format!("huddle_{version}_{arch}"));
    if stage.exists() {
        fs::remove_dir_all(&stage)?;
    }
    stage_files(binary, packaging, &stage)?;
    let size_kib = fs::metadata(binary)?.len() / 1024 + 64;
    write(
        &stage.join("DEBIAN/control"),
        control(&version, &arch, size_kib).as_bytes(),
        0o644,
    )?;
    write(
        &stage.join("DEBIAN/conffiles"),
        b"/etc/huddle/example.toml\n",
        0o644,
    )?;
    // An upgrade restarts running balancers on the new binary (hitless).
    write(
        &stage.join("DEBIAN/postinst"),
        &fs::read(packaging.join("postinst")).context("packaging/postinst")?,
        0o755,
    )?;
    let deb = out.join(format!("huddle_{version}_{arch}.deb"));
    let status = Command::new("dpkg-deb")
        .args(["--root-owner-group", "--build"])
        .arg(&stage)
        .arg(&deb)
        .stdout(std::process::Stdio::null())
        .status()
        .context("running dpkg-deb")?;
    if !status.success() {
        bail!("dpkg-deb --build failed ({status})");
    }
    fs::remove_dir_all(&stage)?;
    Ok(deb)
}

/// The binary, the unit, the example config, completions and the man page,
/// under `stage` where they install.
fn stage_files(binary: &Path, packaging: &Path, stage: &Path) -> Result<()> {
    write(
        &stage.join("usr/bin/huddle"),
        &fs::read(binary).with_context(|| format!("reading {}", binary.display()))?,
        0o755,
    )?;
    write(
        &stage.join("lib/systemd/system/huddle@.service"),
        &fs::read(packaging.join("huddle@.service"))?,
        0o644,
    )?;
    write(
        &stage.join("etc/huddle/example.toml"),
        &fs::read(packaging.join("example.toml"))?,
        0o644,
    )?;
    for (shell, path) in [
        ("bash", "usr/share/bash-completion/completions/huddle"),
        ("zsh", "usr/share/zsh/vendor-completions/_huddle"),
        ("fish", "usr/share/fish/vendor_completions.d/huddle.fish"),
    ] {
        write(
            &stage.join(path),
            &stdout_of(binary, &["completions", shell])?,
            0o644,
        )?;
    }
    write(
        &stage.join("usr/share/man/man1/huddle.1.gz"),
        &gzip(&stdout_of(binary, &["man"])?)?,
        0o644,
    )?;
    Ok(())
}

/// The package's `DEBIAN/control`.
fn control(version: &str, arch: &str, size_kib: u64) -> String {
    format!(
        "Package: huddle\n\
         Version: {version}\n\
         Architecture: {arch}\n\
         Maintainer: HuddleCluster developers <huddle@localhost>\n\
         Installed-Size: {size_kib}\n\
         Depends: libc6\n\
         Recommends: iproute2\n\
         Section: net\n\
         Priority: optional\n\
         Description: XDP load balancer that rests its hot backends\n \
         HuddleCluster balances TCP and UDP services in the kernel (XDP) and\n \
         moves slow, failing or hung backends out of the ring until they\n \
         cool down. One binary: the daemon (huddle@IFACE.service) and the CLI.\n"
    )
}
