//! Running the real XDP program on crafted frames with BPF_PROG_TEST_RUN.
//!
//! The program asks the kernel's FIB for next hops, so runs happen inside a
//! namespace of their own holding the balancer's interface (one end of a
//! veth pair), its address and permanent neighbour entries: the output
//! frames are then fully determined, MAC addresses included.

use crate::{
    config::{Config, Huddle, PortRange, Service, XdpMode},
    kernel::dataplane::Dataplane,
    sys::netns::Netns,
};
use anyhow::{Context, Result};
use aya::{programs::Xdp, TestRun, TestRunOptions};
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::Duration,
};

/// The balancer's interface inside the namespace.
pub const IFACE: &str = "hb0";
pub const BALANCER_IP: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
pub const BALANCER_MAC: [u8; 6] = [0x02, 0x00, 10, 213, 0, 1];

/// A configuration for the program run here: the namespace's interface and
/// SNAT address, nothing pinned or kept after the process, `services`.
#[must_use]
pub fn config(
    services: Vec<Service>,
    nat_ports: PortRange,
    flow_table_size: u32,
    half_open_table_size: u32,
) -> Config {
    Config {
        limits: Default::default(),
        renamed: Vec::new(),
        origin: None,
        interface: IFACE.into(),
        snat_ips: vec![BALANCER_IP],
        snat_ips6: Vec::new(),
        encap_prefix: None,
        xdp_mode: XdpMode::Auto,
        nat_ports,
        flow_table_size,
        half_open_table_size,
        maglev_table_size: huddle_common::DEFAULT_MAGLEV_SIZE,
        maglev_key: None,
        control_socket: "/dev/null".into(),
        pin_dir: None,
        state_file: "/dev/null".into(),
        detach_on_exit: true,
        services,
        huddle: Huddle::default(),
        bgp: None,
        cluster: None,
    }
}

/// The MAC address the environment gives a neighbour.
#[must_use]
pub fn mac_of(ip: Ipv4Addr) -> [u8; 6] {
    let o = ip.octets();
    [0x02, 0x00, o[0], o[1], o[2], o[3]]
}

/// The MAC address the environment gives an IPv6 neighbour.
#[must_use]
pub fn mac_of6(ip: Ipv6Addr) -> [u8; 6] {
    let o = ip.octets();
    [0x02, 0x06, o[12], o[13], o[14], o[15]]
}

fn mac_str(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

thread_local! {
    /// The namespace of the `ProgRun` this thread entered last.
    static ENTERED: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// A namespace with the balancer's interface and the program loaded.
pub struct ProgRun {
    pub dp: Dataplane,
    pub ifindex: u32,
    pub ns: Netns,
}

impl ProgRun {
    /// Builds the namespace `ns_name`, gives `neighbours` permanent entries,
    /// moves the calling thread into it and loads the program with `cfg`
    /// (its SNAT addresses, `BALANCER_IP` first, are the interface's).
    pub fn new(ns_name: &str, cfg: &Config, neighbours: &[Ipv4Addr]) -> Result<ProgRun> {
        ProgRun::with_queues(ns_name, cfg, neighbours, 1)
    }

    /// `new`, with `queues` receive and send queues on each end of the
    /// veth pair: a stream sent from each of that many CPUs keeps to its
    /// own queue (veth picks the queue by CPU), as on a multi-queue NIC.
    pub fn with_queues(
        ns_name: &str,
        cfg: &Config,
        neighbours: &[Ipv4Addr],
        queues: u32,
    ) -> Result<ProgRun> {
        let ns = Netns::create(ns_name)?;
        let q = queues.to_string();
        let qs: &[&str] = if queues > 1 {
            &["numtxqueues", &q, "numrxqueues", &q]
        } else {
            &[]
        };
        let mut add = vec!["link", "add", IFACE];
        add.extend(qs);
        add.extend(["type", "veth", "peer", "name", "hb1"]);
        add.extend(qs);
        ns.ip(&add)?;
        ns.ip(&["link", "set", IFACE, "address", &mac_str(BALANCER_MAC)])?;
        ns.ip(&["addr", "add", &format!("{BALANCER_IP}/16"), "dev", IFACE])?;
        for extra in cfg.snat_ips.iter().filter(|a| **a != BALANCER_IP) {
            ns.ip(&["addr", "add", &format!("{extra}/32"), "dev", IFACE])?;
        }
        for (i, v6) in cfg.snat_ips6.iter().enumerate() {
            let len = if i == 0 { 64 } else { 128 };
            ns.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{v6}/{len}"),
                "dev",
                IFACE,
                "nodad",
            ])?;
        }
        ns.ip(&["link", "set", IFACE, "up"])?;
        ns.ip(&["link", "set", "hb1", "up"])?;
        for n in neighbours {
            ns.ip(&[
                "neigh",
                "replace",
                &n.to_string(),
                "lladdr",
                &mac_str(mac_of(*n)),
                "dev",
                IFACE,
                "nud",
                "permanent",
            ])?;
        }
        ns.sysctl(&format!("net.ipv4.conf.{IFACE}.forwarding"), "1")?;
        if !cfg.snat_ips6.is_empty() {
            ns.sysctl(&format!("net.ipv6.conf.{IFACE}.forwarding"), "1")?;
        }
        ns.enter()?;
        ENTERED.with(|e| e.replace(ns.name.clone()));
        let ifindex = crate::sys::addresses::ifindex(IFACE)?;
        let snat = if cfg.snat_ips.is_empty() {
            vec![BALANCER_IP]
        } else {
            cfg.snat_ips.clone()
        };
        let dp = Dataplane::load(cfg, &snat, &cfg.snat_ips6, None, None)?;
        Ok(ProgRun { dp, ifindex, ns })
    }

    /// Gives IPv6 neighbour `ip` a permanent entry with MAC `mac_of6(ip)`.
    pub fn neighbour6(&self, ip: Ipv6Addr) -> Result<()> {
        self.ns.ip(&[
            "-6",
            "neigh",
            "replace",
            &ip.to_string(),
            "lladdr",
            &mac_str(mac_of6(ip)),
            "dev",
            IFACE,
            "nud",
            "permanent",
        ])
    }

    /// Runs the balancer program once on `frame`: (verdict, output frame).
    /// The run happens in this environment's namespace (its FIB answers
    /// the program), entered first if the thread is in another one's.
    pub fn run(&self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        if ENTERED.with(|e| *e.borrow() != self.ns.name) {
            self.ns.enter()?;
            ENTERED.with(|e| e.replace(self.ns.name.clone()));
        }
        let (verdict, out, _) = test_run(self.dp.program()?, frame, self.ifindex)?;
        Ok((verdict, out))
    }
}

/// Runs `prog` once on `frame` as if it arrived on `ifindex`:
/// (verdict, output frame, kernel-measured duration).
pub fn test_run(prog: &Xdp, frame: &[u8], ifindex: u32) -> Result<(u32, Vec<u8>, Duration)> {
    let mut out = vec![0u8; frame.len() + 256];
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex,
    // rx_queue_index, egress_ifindex. The kernel wants data_end = length.
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(frame);
    opts.data_out = Some(&mut out);
    opts.ctx_in = Some(&ctx);
    let r = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
    out.truncate(r.data_size_out as usize);
    Ok((r.return_value, out, r.duration))
}
