//! The config's validation, line and field in every error.

use super::{file::*, model::*, values::*, Origin};
use anyhow::Result;
use std::path::PathBuf;

fn file(text: &str) -> Result<Config> {
    ConfigFile::parse(text)
        .map_err(anyhow::Error::msg)?
        .validate()
}

const GOOD: &str = r#"
interface = "eth0"
nat_ports = "20000-30000"

[[service]]
vip = "10.213.100.1:80/tcp"
backends = ["10.213.0.11:8080", { addr = "10.213.0.12:8080" }]

[[service]]
vip = "10.213.100.1:53"
proto = "udp"
backends = ["10.213.0.11:5353"]
"#;

#[test]
fn good_file_validates() {
    let c = file(GOOD).unwrap();
    assert_eq!(c.services.len(), 2);
    assert_eq!(c.services[0].backends.len(), 2);
    assert_eq!(c.services[1].proto, Proto::Udp);
    assert_eq!(
        c.nat_ports,
        PortRange {
            min: 20000,
            max: 30000
        }
    );
    assert_eq!(c.control_socket, PathBuf::from("/run/huddle/eth0.sock"));
}

#[test]
fn syntax_error_names_the_line() {
    let err =
        ConfigFile::parse("interface = \"eth0\"\n\n[[service]]\nvip = 10.0.0.1\n").unwrap_err();
    assert!(err.starts_with("line 4:"), "{err}");
}

#[test]
fn unknown_field_is_refused_with_its_line() {
    let err = ConfigFile::parse("interface = \"eth0\"\nflowtable = 3\n").unwrap_err();
    assert!(
        err.starts_with("line 2:") && err.contains("flowtable"),
        "{err}"
    );
}

fn err_of(text: &str) -> String {
    format!("{:#}", file(text).unwrap_err())
}

#[test]
fn bad_configs_name_the_field() {
    let base = "interface = \"eth0\"\n";
    let cases = [
        ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = []\n", "service[0].backends: VIP 10.0.0.1:80/tcp has no backend"),
        ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\", \"10.0.0.2:80\"]\n", "listed twice"),
        ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2\"]\n", "service[0].backends[0]"),
        ("[[service]]\nvip = \"10.0.0.1:0\"\nbackends = [\"10.0.0.2:80\"]\n", "service[0].vip"),
        ("[[service]]\nvip = \"10.0.0.1:80/sctp\"\nbackends = [\"10.0.0.2:80\"]\n", "unknown protocol"),
        ("[[service]]\nvip = \"[fd00::1]:80\"\nbackends = [\"10.0.0.2:80\"]\n", "is IPv4 but the VIP"),
        ("[[service]]\nvip = \"[::1]:80\"\nbackends = [\"[fd00::2]:80\"]\n", "routable"),
        ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n[[service]]\nvip = \"10.0.0.1:80/tcp\"\nbackends = [\"10.0.0.3:80\"]\n", "service[1].vip: 10.0.0.1:80/tcp is configured twice"),
        ("max_services = 5000\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "max_services: 5000 is outside 1..=4096"),
        ("max_backends = 1\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\", \"10.0.0.3:80\"]\n", "max_backends: 1 is fewer than the 2 configured"),
        ("flow_table_size = 10\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "flow_table_size"),
        ("maglev_key_file = \"/nonexistent/maglev.key\"\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "maglev_key_file: reading /nonexistent/maglev.key"),
        ("maglev_table_size = 65536\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "maglev_table_size: 65536 must be a prime"),
        ("[[service]]\nvip = \"10.0.0.1:80\"\nlatency = \"fast\"\nbackends = [\"10.0.0.2:80\"]\n", "unknown variant `fast`"),
        ("[[service]]\nvip = \"10.0.0.1:80\"\nselection = \"hash\"\nbackends = [\"10.0.0.2:80\"]\n", "unknown variant `hash`"),
        ("[cluster]\nmembers = [\"10.0.0.5:9477\", \"10.0.0.6:9477\"]\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "cluster.members: this balancer's huddle.listen (127.0.0.1:9477) must be one of them"),
        ("[huddle]\nlisten = \"10.0.0.5:9477\"\n[cluster]\nmembers = [\"10.0.0.5:9477\", \"10.0.0.6:9477\"]\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "cluster.key_file: required"),
        ("[huddle]\nlisten = \"10.0.0.5:9477\"\n[cluster]\nmembers = [\"10.0.0.5:9477\", \"10.0.0.6:9477\"]\nkey_file = \"/nonexistent/cluster.key\"\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "cluster.key_file: reading /nonexistent/cluster.key"),
        ("[bgp]\ndaemon = \"gobgp\"\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "bgp.daemon: \"gobgp\" is not driven"),
        ("", "no service configured"),
        ("[huddle]\ncool = 0.6\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.cool: 0.6 must be below huddle.heat"),
        ("[huddle]\ntick_ms = 0\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.tick_ms"),
        ("[huddle]\nmin_inner = 0\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.min_inner"),
        ("[huddle]\nprobe = { active_interval_ms = 100 }\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.probe.active_interval_ms: 100 ms is shorter than huddle.probe.interval_ms (250 ms)"),
        ("[huddle]\nmetrics_per_backend = \"some\"\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "unknown variant `some`"),
        ("[huddle]\nprobe = { max_per_second = 0 }\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.probe.max_per_second: 0 is outside"),
        ("[huddle]\nprobe = { max_per_second = 100, idle_per_second = 200 }\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n", "huddle.probe.idle_per_second: 200 is outside 1..=100"),
        ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [{ addr = \"10.0.0.2:80\", weight = -1.0 }]\n", "service[0].backends[0].weight"),
        ("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [{ addr = \"10.0.0.2:80\", metrics = \"ftp://x\" }]\n", "service[0].backends[0].metrics"),
    ];
    for (body, want) in cases {
        let got = err_of(&format!("{base}{body}"));
        assert!(
            got.contains(want),
            "for {body:?}: got {got:?}, want {want:?}"
        );
    }
    assert!(
        err_of("[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n")
            .contains("interface: missing")
    );
}

#[test]
fn nat_port_range_parses_and_refuses_nonsense() {
    assert_eq!(
        "1024-2047".parse::<PortRange>().unwrap(),
        PortRange {
            min: 1024,
            max: 2047
        }
    );
    assert!("2047-1024".parse::<PortRange>().is_err());
    assert!("0-10".parse::<PortRange>().is_err());
    assert!("x".parse::<PortRange>().is_err());
    let err = ConfigFile::parse("nat_ports = \"9-1\"\n").unwrap_err();
    assert!(err.starts_with("line 1:"), "{err}");
}

#[test]
fn renamed_keys_still_work_once_said_and_twice_is_refused() {
    let c = file("interface = \"eth0\"\n[huddle]\nmetrics_listen = \"10.0.0.9:9100\"\nmetrics_interval_ms = 700\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n").unwrap();
    assert_eq!(c.huddle.listen, Some("10.0.0.9:9100".parse().unwrap()));
    assert_eq!(
        c.huddle.scrape_interval,
        std::time::Duration::from_millis(700)
    );
    assert_eq!(c.renamed.len(), 2, "{:?}", c.renamed);
    assert!(c.renamed[0].contains("huddle.metrics_listen is now huddle.listen"));
    let both = file("interface = \"eth0\"\n[huddle]\nmetrics_listen = \"off\"\nlisten = \"off\"\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n");
    let e = format!("{:#}", both.unwrap_err());
    assert!(e.contains("huddle.metrics_listen and huddle.listen"), "{e}");
    let new = file("interface = \"eth0\"\n[huddle]\nlisten = \"off\"\nscrape_timeout_ms = 300\n[[service]]\nvip = \"10.0.0.1:80\"\nbackends = [\"10.0.0.2:80\"]\n").unwrap();
    assert!(new.renamed.is_empty() && new.huddle.listen.is_none());
}

#[test]
fn validation_errors_name_the_files_line_too() {
    let text = "interface = \"eth0\"\n\n[[service]]\nvip = \"10.0.100.1:80/tcp\"\nbackends = [\n  \"10.0.0.11:8080\",\n  \"10.0.0.11:8080\",\n]\n";
    let mut f = ConfigFile::parse(text).unwrap();
    f.origin = Some(Origin {
        path: "x.toml".into(),
        text: text.into(),
        from_flags: Vec::new(),
    });
    let err = format!("{:#}", f.clone().validate().unwrap_err());
    assert!(err.starts_with("line 7: service[0].backends[1]:"), "{err}");
    // A field a flag set is not the file's: no line.
    f.origin.as_mut().unwrap().from_flags = vec!["service[0]".into()];
    let err = format!("{:#}", f.validate().unwrap_err());
    assert!(err.starts_with("service[0].backends[1]:"), "{err}");
}
