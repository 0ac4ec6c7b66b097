//! Builds the XDP program with the nightly toolchain and hands the object
//! to the crate, which embeds it, so `huddle` is one self-contained binary.
//!
//! The nested cargo runs in `huddle-ebpf/` (its `.cargo/config.toml` sets
//! the BPF target and build-std) with target folders of its own, shared by
//! all profiles of the outer build, so the objects are built once and then
//! only when their sources change.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

/// Built allowing misaligned loads and stores: a 4-byte address or a
/// 6-byte MAC in a packet is then read and written in one or two
/// instructions instead of byte by byte (about 10 ns of an established
/// packet's path). The kernel allows misaligned packet access wherever
/// unaligned access is cheap (x86-64, arm64), but never on the stack.
const WIDE: [&str; 3] = ["huddle", "baseline", "trafficgen"];
/// Built without it: LLVM widened this program's stack reads of packet
/// bytes it had copied there, and the verifier refuses misaligned stack
/// access.
const STRICT: [&str; 1] = ["decap"];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest.parent().expect("workspace root").to_path_buf();
    let ebpf = root.join("huddle-ebpf");
    for p in [
        ebpf.join("src"),
        ebpf.join("Cargo.toml"),
        ebpf.join(".cargo/config.toml"),
        root.join("huddle-common/src"),
        root.join("Cargo.lock"),
    ] {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let targets = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| if d.is_absolute() { d } else { root.join(d) })
        .unwrap_or_else(|| root.join("target"));
    // Each kind in a target folder of its own: the flags differ, and one
    // folder would rebuild `core` for each kind on every build.
    for (objects, dir, wide) in [
        (&WIDE[..], targets.join("ebpf"), true),
        (&STRICT[..], targets.join("ebpf-strict"), false),
    ] {
        build(&ebpf, objects, &dir, wide);
        for name in objects {
            copy(
                &dir.join("bpfel-unknown-none/release").join(name),
                &out.join(name),
            );
        }
    }
}

/// Builds `objects` in `target_dir` with the nightly toolchain; `wide`:
/// allowing misaligned access (added to the config's `rustflags`:
/// `--config` arrays are appended).
fn build(ebpf: &Path, objects: &[&str], target_dir: &Path, wide: bool) {
    let mut cmd = Command::new("rustup");
    cmd.current_dir(ebpf).args(["run", "nightly", "cargo"]);
    if wide {
        cmd.args([
            "--config",
            r#"target.bpfel-unknown-none.rustflags=["-C", "target-feature=+allows-misaligned-mem-access"]"#,
        ]);
    }
    cmd.args(["build", "--release", "--target-dir"])
        .arg(target_dir);
    for name in objects {
        cmd.args(["--bin", name]);
    }
    // The outer cargo's settings must not leak into the BPF build.
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        let leaks = (key.starts_with("CARGO_") && key != "CARGO_HOME")
            || key.starts_with("RUSTC")
            || key == "RUSTFLAGS"
            || key == "RUSTDOCFLAGS"
            || key == "RUSTUP_TOOLCHAIN"
            || key == "CARGO";
        if leaks {
            cmd.env_remove(key.as_ref());
        }
    }
    let status = cmd.status().unwrap_or_else(|e| {
        panic!("cannot run `rustup run nightly cargo` to build the XDP program: {e}. Run `cargo xtask setup` first.")
    });
    if !status.success() {
        panic!(
            "building the XDP program failed ({status}). If rust-src or bpf-linker is missing, \
             `cargo xtask setup` installs them."
        );
    }
}

fn copy(from: &Path, to: &Path) {
    fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copy {} -> {}: {e}", from.display(), to.display()));
}
