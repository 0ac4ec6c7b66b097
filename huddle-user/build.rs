//! Builds the XDP program with the nightly toolchain and hands the object
//! to the crate, which embeds it, so `huddle` is one self-contained binary.
//!
//! The nested cargo runs in `huddle-ebpf/` (its `.cargo/config.toml` sets
//! the BPF target and build-std) with its own target folder, shared by all
//! profiles of the outer build, so the object is built once and then only
//! when its sources change.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

const OBJECTS: [&str; 4] = ["huddle", "baseline", "trafficgen", "decap"];

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
    let target_dir = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| if d.is_absolute() { d } else { root.join(d) })
        .unwrap_or_else(|| root.join("target"))
        .join("ebpf");

    let mut cmd = Command::new("rustup");
    cmd.current_dir(&ebpf)
        .args([
            "run",
            "nightly",
            "cargo",
            "build",
            "--release",
            "--target-dir",
        ])
        .arg(&target_dir);
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
    for name in OBJECTS {
        copy(
            &target_dir.join("bpfel-unknown-none/release").join(name),
            &out.join(name),
        );
    }
}

fn copy(from: &Path, to: &Path) {
    fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copy {} -> {}: {e}", from.display(), to.display()));
}
