//! Trust boundaries on the host: who may use a running balancer's control
//! socket.

use std::{os::unix::fs::PermissionsExt, path::Path, process::Command};
use testbed::{backend_ip, require_root, Testbed, HTTP_PORT, VIP};

const HUDDLE: &str = env!("CARGO_BIN_EXE_hc-huddle");
const BACKEND: &str = env!("CARGO_BIN_EXE_hc-backend");

/// `huddle ARGS` as user nobody: (succeeded, stdout and stderr).
fn as_nobody(args: &[&str]) -> (bool, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", HUDDLE])
        .args(args)
        .output()
        .expect("run setpriv (util-linux)");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn a_control_socket_client_of_another_uid_is_refused() {
    require_root();
    let mut bed = Testbed::new("uid", 2).expect("build testbed");
    bed.start_backends(Path::new(BACKEND))
        .expect("start backends");
    let b0 = format!("{}:{HTTP_PORT}", backend_ip(0));
    let b1 = format!("{}:{HTTP_PORT}", backend_ip(1));
    let vip = format!("{VIP}:80");
    bed.start_huddle(
        Path::new(HUDDLE),
        &["--vip", &vip, "--backend", &b0, "--backend", &b1],
    )
    .expect("start huddle");
    let socket = bed.socket();
    let path = socket.display().to_string();
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the control socket is root's only");
    // Let others reach the socket's folder: the socket's own mode keeps
    // them out.
    std::fs::set_permissions(&bed.dir, PermissionsExt::from_mode(0o755)).unwrap();
    let (ok, text) = as_nobody(&["status", "--control-socket", &path]);
    assert!(!ok, "nobody read the status: {text}");
    // A socket made wider by hand: the daemon refuses the peer itself.
    std::fs::set_permissions(&socket, PermissionsExt::from_mode(0o666)).unwrap();
    for args in [
        vec!["status", "--control-socket", &path],
        vec!["drain", "--control-socket", &path, "--backend", &b0],
        vec![
            "stop",
            "--control-socket",
            &path,
            "--pin-dir",
            "/nonexistent",
        ],
    ] {
        let (ok, text) = as_nobody(&args);
        assert!(!ok, "nobody ran {args:?}: {text}");
        assert!(text.contains("refused"), "{args:?}: {text}");
    }
    let st = bed.status().expect("root still reads the status");
    assert!(
        st.services[0].backends.iter().all(|b| !b.drained),
        "nobody's drain took effect"
    );
    assert!(bed
        .huddle_log()
        .contains("refused: the control socket answers root"));
}
