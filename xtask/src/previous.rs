//! The previous release, built from git for the upgrade test
//! (`tests/netns/upgrade.rs`): a start of this build over its running
//! data plane must keep every flow. README and docs/upgrades.md name it.

use anyhow::{bail, Context, Result};
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// The previous release: the commit issue 30 was filed on.
pub const COMMIT: &str = "fabdcf12f63671bbdc03765b0a073f3441c9876c";

/// Its `huddle`, built once per checkout into `target/previous` from a
/// `git archive` of the commit, with this checkout's target folder (the
/// dependencies are shared; only its own crates are built).
pub fn build(root: &Path) -> Result<PathBuf> {
    let dir = root.join("target/previous");
    let out = dir.join(format!("huddle-{}", &COMMIT[..7]));
    if out.exists() {
        return Ok(out);
    }
    let src = dir.join("src");
    if src.exists() {
        std::fs::remove_dir_all(&src).with_context(|| format!("removing {}", src.display()))?;
    }
    std::fs::create_dir_all(&src)?;
    println!(
        "==> the previous release {} from git into {}",
        &COMMIT[..7],
        src.display()
    );
    let mut archive = Command::new("git")
        .args(["archive", "--format=tar", COMMIT])
        .current_dir(root)
        .stdout(Stdio::piped())
        .spawn()
        .context("running git archive")?;
    let tar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(&src)
        .stdin(archive.stdout.take().context("git archive's output")?)
        .status()
        .context("running tar")?;
    if !archive.wait()?.success() || !tar.success() {
        bail!("git archive {COMMIT} (is this a full clone with its history?)");
    }
    // Its crates under another version: cargo names a workspace crate's
    // artifacts by its path relative to the workspace, which both
    // checkouts share, so under the same version each build would take
    // the other's `huddle-common` as its own. (The uplifted binaries
    // `debug/huddle` and the XDP objects are linked again by each build.)
    let manifest = src.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)?;
    let patched = text.replacen(
        "[workspace.package]\nversion = \"0.1.0\"",
        "[workspace.package]\nversion = \"0.0.1-previous\"",
        1,
    );
    if patched == text {
        bail!("the previous release's Cargo.toml has no version to set apart");
    }
    std::fs::write(&manifest, patched)?;
    let target = root.join("target");
    let status = Command::new("cargo")
        .args(["build", "-p", "huddle-user", "--bin", "huddle"])
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", &target)
        .status()
        .context("building the previous release")?;
    if !status.success() {
        bail!("building the previous release {COMMIT} failed ({status})");
    }
    // This checkout's build puts its own `huddle` back in target/debug.
    let tmp = out.with_extension("tmp");
    std::fs::copy(target.join("debug/huddle"), &tmp)?;
    std::fs::rename(&tmp, &out)?;
    Ok(out)
}
