//! The probe keys, `[huddle]`'s and a service's own: what each builds,
//! and each error with its field and the file's line.

use super::{file::*, model::*, Origin};
use anyhow::Result;

/// `text` validated as the file `p.toml`.
fn load(text: &str) -> Result<Config> {
    let mut f = ConfigFile::parse(text).map_err(anyhow::Error::msg)?;
    f.origin = Some(Origin {
        path: "p.toml".into(),
        text: text.into(),
        from_flags: Vec::new(),
    });
    f.validate()
}

const FOUR: &str = r#"interface = "eth0"
[huddle]
probe = { path = "/health", timeout_ms = 400 }

[[service]]
vip = "10.0.0.1:80"
backends = ["10.0.0.2:80"]

[[service]]
vip = "10.0.0.1:81"
backends = ["10.0.0.2:81"]
probe = { version = "2", host = "api.example", status = ["200", "204-205"] }

[[service]]
vip = "10.0.0.1:443"
backends = ["10.0.0.2:443"]
probe = { kind = "tls", host = "www.example", path = "/ready" }

[[service]]
vip = "10.0.0.1:53/udp"
backends = ["10.0.0.2:53"]
probe = { send = "ping", expect = "pong", fall = 3 }

[[service]]
vip = "10.0.0.1:54/udp"
backends = ["10.0.0.2:54"]

[[service]]
vip = "10.0.0.1:82"
backends = ["10.0.0.2:82"]
probe = { kind = "none" }
"#;

#[test]
fn each_service_gets_huddles_probe_with_its_own_keys_over_it() {
    let c = load(FOUR).unwrap();
    let p: Vec<&Probe> = c.services.iter().map(|s| &*s.probe).collect();
    // The first: [huddle]'s, as it is.
    assert_eq!(*p[0], c.huddle.probe);
    assert_eq!(
        (p[0].kind, p[0].path.as_str()),
        (ProbeKind::Http, "/health")
    );
    assert!(p[0].passes(200) && p[0].passes(399) && !p[0].passes(503));
    // h2c: its keys over [huddle]'s path and timeout.
    assert_eq!(
        (p[1].kind, p[1].version),
        (ProbeKind::Http, HttpVersion::Http2)
    );
    assert_eq!(
        (p[1].path.as_str(), p[1].timeout.as_millis()),
        ("/health", 400)
    );
    assert_eq!(p[1].host.as_deref(), Some("api.example"));
    assert!(p[1].passes(204) && !p[1].passes(301));
    // TLS: the Host header is the server name sent.
    assert_eq!(p[2].kind, ProbeKind::Tls);
    assert_eq!(p[2].sni.as_deref(), Some("www.example"));
    // A UDP service with a probe: udp, by default.
    assert_eq!(p[3].kind, ProbeKind::Udp);
    assert_eq!(
        (p[3].send.as_slice(), p[3].expect.as_slice()),
        (&b"ping"[..], &b"pong"[..])
    );
    assert_eq!(p[3].fall, 3);
    assert!(p[3].asks_the_application());
    // A UDP service without one is not probed, as before.
    assert_eq!(p[4].kind, ProbeKind::None);
    assert_eq!(p[5].kind, ProbeKind::None);
    // The round's timing is [huddle]'s for all.
    assert!(p.iter().all(|q| q.interval == c.huddle.probe.interval));
    // Services probing alike share one probe (the prober's key).
    let again = load(&format!(
        "{FOUR}\n[[service]]\nvip = \"10.0.0.1:83\"\nbackends = [\"10.0.0.2:83\"]\n"
    ))
    .unwrap();
    assert!(std::sync::Arc::ptr_eq(
        &again.services[0].probe,
        &again.services[6].probe
    ));
}

#[test]
fn probe_key_errors_name_the_field_and_line() {
    let svc = |probe: &str, proto: &str| {
        format!("interface = \"eth0\"\n\n[[service]]\nvip = \"10.0.0.1:80/{proto}\"\nbackends = [\"10.0.0.2:80\"]\nprobe = {{ {probe} }}\n")
    };
    let cases = [
        (
            svc("kind = \"udp\", send = \"x\"", "tcp"),
            "service[0].probe.kind: \"udp\" probes a UDP service",
        ),
        (
            svc("kind = \"http\"", "udp"),
            "service[0].probe.kind: a UDP service is probed with",
        ),
        (
            svc("kind = \"udp\"", "udp"),
            "service[0].probe.send: a udp probe needs a datagram",
        ),
        (
            svc("send = \"x\"", "tcp"),
            "service[0].probe.send: only a udp probe uses it",
        ),
        (
            svc("sni = \"a.example\"", "tcp"),
            "service[0].probe.sni: only a tls probe uses it",
        ),
        (
            svc("kind = \"tls\", sni = \"not a name\"", "tcp"),
            "service[0].probe.sni: \"not a name\" is not a DNS name",
        ),
        (
            svc("kind = \"tcp\", version = \"2\"", "tcp"),
            "service[0].probe.version: only a http or tls probe",
        ),
        (
            svc("status = [\"200-99\"]", "tcp"),
            "service[0].probe.status: \"200-99\" is not a status",
        ),
        (
            svc("status = [\"abc\"]", "tcp"),
            "service[0].probe.status: \"abc\"",
        ),
        (svc("status = []", "tcp"), "service[0].probe.status: empty"),
        (
            svc("host = \"a b\"", "tcp"),
            "service[0].probe.host: \"a b\" must be a host name",
        ),
        (
            svc("path = \"health\"", "tcp"),
            "service[0].probe.path: \"health\" must start with /",
        ),
        (
            svc("interval_ms = 100", "tcp"),
            "service[0].probe.interval_ms: one round probes every service",
        ),
        (
            svc("max_per_second = 9", "tcp"),
            "service[0].probe.max_per_second: one round",
        ),
        (
            svc("timeout_ms = 5", "tcp"),
            "service[0].probe.timeout_ms: 5 is outside 10..=60000",
        ),
    ];
    for (text, want) in &cases {
        let got = format!("{:#}", load(text).unwrap_err());
        assert!(got.contains(want), "got {got:?}, want {want:?}");
        assert!(got.contains("line 6"), "no line in {got:?}");
    }
    // A key no probe has: refused by name at its line.
    let got = format!("{:#}", load(&svc("hots = \"x\"", "tcp")).unwrap_err());
    assert!(got.contains("hots") && got.contains("line 6"), "{got}");
    // [huddle]'s probe speaks to TCP services.
    let got = format!(
        "{:#}",
        load("interface = \"eth0\"\n[huddle]\nprobe = { kind = \"udp\", send = \"x\" }\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n").unwrap_err()
    );
    assert!(
        got.contains("huddle.probe.kind: \"udp\" probes UDP services only")
            && got.contains("line 3"),
        "{got}"
    );
}
