//! `cargo xtask package`: the Debian package holds the binary, the systemd
//! template unit, completions, the man page and the example config; the
//! unit passes `systemd-analyze verify` where that tool exists, and the
//! example config passes `huddle check`.

use std::{path::Path, process::Command};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");

fn run(prog: &str, args: &[&str]) -> (bool, String) {
    let o = Command::new(prog)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {prog}: {e}"));
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

#[test]
fn the_debian_package_holds_what_an_operator_needs() {
    let dir = std::env::temp_dir().join(format!("huddle-pkg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.join("out");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let o = Command::new(env!("CARGO"))
        .current_dir(root)
        .args([
            "run", "-q", "-p", "xtask", "--", "package", "--binary", HUDDLE, "--out",
        ])
        .arg(&out)
        .output()
        .expect("running cargo xtask package");
    assert!(
        o.status.success(),
        "cargo xtask package failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let deb = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let (ok, listing) = run("dpkg-deb", &["-c", &deb]);
    assert!(ok, "{listing}");
    for want in [
        "./usr/bin/huddle",
        "./lib/systemd/system/huddle@.service",
        "./etc/huddle/example.toml",
        "./usr/share/bash-completion/completions/huddle",
        "./usr/share/zsh/vendor-completions/_huddle",
        "./usr/share/fish/vendor_completions.d/huddle.fish",
        "./usr/share/man/man1/huddle.1.gz",
    ] {
        assert!(
            listing.contains(want),
            "{want} missing from the package:\n{listing}"
        );
    }
    let (ok, control) = run(
        "dpkg-deb",
        &["-f", &deb, "Package", "Version", "Architecture"],
    );
    assert!(ok && control.contains("Package: huddle"), "{control}");
    let x = dir.join("x");
    let (ok, msg) = run("dpkg-deb", &["-x", &deb, &x.display().to_string()]);
    assert!(ok, "{msg}");
    let (ok, msg) = run(
        &x.join("usr/bin/huddle").display().to_string(),
        &[
            "check",
            &x.join("etc/huddle/example.toml").display().to_string(),
        ],
    );
    assert!(ok, "the example config fails `huddle check`: {msg}");
    let unit = std::fs::read_to_string(x.join("lib/systemd/system/huddle@.service")).unwrap();
    for want in [
        "Type=notify",
        "ExecReload=",
        "Restart=on-failure",
        "--iface %i",
        "LimitNOFILE=",
        "RuntimeDirectoryMode=0700",
    ] {
        assert!(unit.contains(want), "{want} missing from the unit:\n{unit}");
    }
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok()
    {
        // An instance of the template, pointing at the packaged binary.
        let units = dir.join("units");
        std::fs::create_dir_all(&units).unwrap();
        let local = unit.replace(
            "/usr/bin/huddle",
            &x.join("usr/bin/huddle").display().to_string(),
        );
        std::fs::write(units.join("huddle@.service"), &local).unwrap();
        let instance = units.join("huddle@eth0.service");
        std::fs::write(&instance, &local).unwrap();
        let (ok, msg) = run(
            "systemd-analyze",
            &["verify", "--man=no", &instance.display().to_string()],
        );
        assert!(ok, "systemd-analyze verify refused the unit: {msg}");
        println!("systemd-analyze verify: the unit passes");
    } else {
        println!("systemd-analyze is not installed: the unit was not verified");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
