//! The comparison benchmark cannot rot: its quick mode runs every balancer
//! in every scenario (one short trial each) and must produce complete,
//! sane figures and a plot per scenario. The figures themselves are not
//! judged here.

use std::path::Path;

const COMPARE: &str = env!("CARGO_BIN_EXE_hc-compare");
const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");

#[test]
fn quick_comparison_produces_every_cell() {
    testbed::require_root();
    let out = std::env::temp_dir().join(format!("hc-compare-{}", std::process::id()));
    let status = std::process::Command::new(COMPARE)
        .args([
            "--quick",
            "--huddle",
            HUDDLE,
            "--out",
            &out.display().to_string(),
        ])
        .status()
        .expect("run hc-compare");
    assert!(status.success(), "hc-compare --quick failed");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let cells = json["cells"].as_array().expect("cells");
    let scenarios = ["normal", "slow", "killed", "hung", "degrading"];
    let balancers = [
        "huddle",
        "xdp-rr",
        "huddle-dsr",
        "nginx-rr",
        "nginx-lc",
        "haproxy-rr",
        "haproxy-lc",
    ];
    for s in scenarios {
        assert!(
            Path::new(&out.join(format!("{s}.svg"))).exists(),
            "no plot for {s}"
        );
        for b in balancers {
            let c = cells
                .iter()
                .find(|c| c["scenario"] == s && c["balancer"] == b)
                .unwrap_or_else(|| panic!("no cell for {s} / {b}"));
            let trials = c["trials"].as_array().expect("trials");
            assert!(!trials.is_empty(), "{s} / {b}: no trial");
            for t in trials {
                let requests = t["requests"].as_u64().unwrap();
                let failed = t["failed"].as_u64().unwrap();
                assert!(requests > 100 && failed <= requests, "{s} / {b}: {t}");
                for k in [
                    "p50_ms",
                    "p95_ms",
                    "p99_ms",
                    "p999_ms",
                    "max_ms",
                    "mean_ms",
                    "throughput",
                ] {
                    let v = t[k].as_f64().unwrap_or(f64::NAN);
                    assert!(v.is_finite() && v > 0.0, "{s} / {b}: {k} = {v}");
                }
                let p = |k: &str| t[k].as_f64().unwrap();
                assert!(
                    p("p50_ms") <= p("p95_ms")
                        && p("p95_ms") <= p("p99_ms")
                        && p("p99_ms") <= p("max_ms")
                );
                let share = p("degraded_share");
                assert!((0.0..=1.0).contains(&share), "{s} / {b}: share {share}");
            }
        }
    }
    // The closed loop: each kind of balancer, short and keep-alive.
    let closed = json["closed_loop"].as_array().expect("closed_loop");
    assert_eq!(closed.len(), 6, "{closed:?}");
    for c in closed {
        for k in ["rps", "p50_ms", "p99_ms", "cpu_us_per_request"] {
            let v = c[k].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "closed loop {c}: {k} = {v}");
        }
    }
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert_eq!(md.matches("| balancer |").count(), scenarios.len() + 1);
    let _ = std::fs::remove_dir_all(&out);
}
