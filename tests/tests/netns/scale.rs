//! A middle size: 512 services of 8 backends (4,096) on one balancer, through
//! `hc-scale --check`: twenty VIPs picked at random answer, 200 new
//! connections a second are all answered, a reload that moves a backend
//! shows it, and a 5x slow backend of one service leaves its ring. The
//! figures it prints are for reading, not asserted.

const SCALE: &str = env!("CARGO_BIN_EXE_hc-scale");
const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");

#[test]
fn five_hundred_twelve_services_of_eight_backends_forward_reload_and_rotate() {
    testbed::require_root();
    let out = std::process::Command::new(SCALE)
        .args([
            "--sizes", "512x8", "--secs", "2", "--check", "--huddle", HUDDLE,
        ])
        .output()
        .expect("run hc-scale");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "hc-scale --check failed:\n{text}");
}
