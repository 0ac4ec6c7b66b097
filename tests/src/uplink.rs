//! A router the balancer announces its VIPs to: bird in the client's
//! namespace, peering over eBGP with a bird beside the balancer that
//! reads the huddle's routes file (`[bgp]`), as `docs/operations` sets
//! one up. For the BGP test and the slowloris test's `[bgp]` phase.

use crate::{start_bird, Proc, Testbed, CLIENT_IP, LB_IP, VIP};
use anyhow::Result;
use huddle_user::cluster::bgp;
use std::{collections::BTreeSet, path::PathBuf};

/// The two birds and their files.
pub struct Uplink {
    pub router_bird: Proc,
    /// The router's control socket.
    pub router: PathBuf,
    pub lb_bird: Proc,
    /// The balancer's bird's control socket, and its config (to start
    /// it again).
    pub lb_sock: PathBuf,
    pub lb_conf: String,
    /// The routes file the huddle writes and bird includes.
    pub routes: PathBuf,
}

impl Uplink {
    /// Starts the router and the balancer's bird, the routes file empty.
    pub fn start(bed: &Testbed) -> Result<Uplink> {
        let routes = bed.dir.join("huddle-vips.conf");
        std::fs::write(&routes, bgp::routes_text(&BTreeSet::new()))?;
        let (router_bird, router) = start_bird(
            &bed.client,
            &bed.dir,
            "router",
            &format!(
                "router id {CLIENT_IP};\nprotocol device {{ scan time 1; }}\n\
                 protocol bgp balancer {{ local {CLIENT_IP} as 65000; neighbor {LB_IP} as 65001; \
                 hold time 3; connect retry time 1; ipv4 {{ import all; export none; }}; }}\n"
            ),
        )?;
        let lb_conf = format!(
            "router id {LB_IP};\nprotocol device {{ scan time 1; }}\ninclude \"{}\";\n\
             protocol bgp uplink {{ local {LB_IP} as 65001; neighbor {CLIENT_IP} as 65000; \
             hold time 3; connect retry time 1; \
             ipv4 {{ import none; export where proto = \"huddle_v4\"; next hop self; }}; }}\n",
            routes.display()
        );
        let (lb_bird, lb_sock) = start_bird(&bed.lb, &bed.dir, "lb", &lb_conf)?;
        Ok(Uplink {
            router_bird,
            router,
            lb_bird,
            lb_sock,
            lb_conf,
            routes,
        })
    }

    /// The `[bgp]` table of the huddle's config.
    #[must_use]
    pub fn bgp_table(&self) -> String {
        format!(
            "[bgp]\ncontrol_socket = \"{}\"\nroutes_file = \"{}\"\n",
            self.lb_sock.display(),
            self.routes.display()
        )
    }

    /// Whether the router has a route to the VIP via the balancer.
    #[must_use]
    pub fn router_has_vip(&self) -> bool {
        bgp::bird(&self.router, &format!("show route {VIP}/32"))
            .map(|lines| lines.iter().any(|l| l.contains(&format!("via {LB_IP}"))))
            .unwrap_or(false)
    }
}
