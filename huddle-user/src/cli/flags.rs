//! `huddle run`'s configuration: the file, with the flags given set
//! over it, each noted so an error about its field names no line of the
//! file.

use super::RunArgs;
use crate::config::{BackendEntry, ConfigFile, ServiceFile};
use anyhow::{bail, Context, Result};

impl RunArgs {
    /// The configuration: the file, with flags given overriding it.
    pub(super) fn config(&self) -> Result<crate::config::Config> {
        let this = self.clone();
        let mut file = match &this.config {
            Some(path) => ConfigFile::load(path)?,
            None => ConfigFile::default(),
        };
        // Each flag given overrides its field, which is then noted so its
        // errors do not point at the file's line for it.
        let mut flags = Vec::new();
        macro_rules! flag {
            ($given:expr, $field:expr, $path:literal) => {
                if let Some(v) = $given {
                    $field = Some(v);
                    flags.push($path.to_string());
                }
            };
        }
        flag!(this.iface, file.interface, "interface");
        if !this.snat_ips.is_empty() {
            file.snat_ip = None;
            file.snat_ips = Some(this.snat_ips.clone());
            flags.extend(["snat_ip".into(), "snat_ips".into()]);
        }
        flag!(this.xdp_mode, file.xdp_mode, "xdp_mode");
        flag!(this.encap_prefix, file.encap_prefix, "encap_prefix");
        flag!(this.nat_ports, file.nat_ports, "nat_ports");
        flag!(
            this.flow_table_size,
            file.flow_table_size,
            "flow_table_size"
        );
        flag!(this.control_socket, file.control_socket, "control_socket");
        if this.no_rotation {
            file.huddle.rotation = Some(false);
            flags.push("huddle.rotation".into());
        }
        flag!(this.tick_ms, file.huddle.tick_ms, "huddle.tick_ms");
        if let Some(listen) = this.listen {
            // The old key's value goes too, or it would win.
            file.huddle.metrics_listen = None;
            file.huddle.listen = Some(listen);
            flags.extend(["huddle.listen".into(), "huddle.metrics_listen".into()]);
        }
        flag!(this.pin_dir, file.pin_dir, "pin_dir");
        if this.detach_on_exit {
            file.detach_on_exit = Some(true);
            flags.push("detach_on_exit".into());
        }
        match (this.vip, this.backends.is_empty()) {
            (Some(vip), _) => {
                flags.push(format!("service[{}]", file.services.len()));
                file.services.push(ServiceFile {
                    vip,
                    proto: None,
                    backends: this.backends.into_iter().map(BackendEntry::Addr).collect(),
                    udp_idle_ms: None,
                    mode: this.mode,
                    selection: this.selection,
                    latency: this.latency,
                    probe: None,
                });
            }
            (None, false) => bail!("--backend given without --vip"),
            (None, true) if this.mode.is_some() => bail!("--mode given without --vip"),
            (None, true) if this.selection.is_some() => bail!("--selection given without --vip"),
            (None, true) if this.latency.is_some() => bail!("--latency given without --vip"),
            (None, true) => {}
        }
        if let Some(o) = &mut file.origin {
            o.from_flags = flags;
        }
        let what = this.config.as_ref().map_or_else(
            || "command line".to_string(),
            |p| format!("config {}", p.display()),
        );
        file.validate().with_context(|| what)
    }
}
