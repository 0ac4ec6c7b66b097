//! Reloads: services added or removed are balanced or dropped at once
//! (not balanced, to the VIP: `GUARDED`).

use super::fixture::*;

/// The program finds services through the live half of an index the
/// control plane rewrites on every reload: a service added is balanced
/// and one removed passes at once, through two reloads (both halves).
#[test]
fn services_added_or_removed_by_a_reload_are_balanced_or_dropped_at_once() {
    let mut env = env("pr-svcidx");
    let backends = [backend(0), backend(1), backend(2)];
    let syn_to = |env: &ProgRun, sport: u16, port: u16| {
        let f = Frame::tcp((CLIENT, sport), (VIP, port))
            .syn()
            .macs(mac_of(CLIENT), BALANCER_MAC);
        env.run(&f.build()).unwrap().0
    };
    let udp_to = |env: &ProgRun, sport: u16| {
        let f = Frame::udp((CLIENT, sport), (VIP, 53))
            .payload(b"query")
            .macs(mac_of(CLIENT), BALANCER_MAC);
        env.run(&f.build()).unwrap().0
    };
    // Not balanced but to the VIP: dropped (`GUARDED`), not forwarded.
    assert_eq!(syn_to(&env, 42000, 81), XDP_DROP, "no service on :81 yet");
    assert_eq!(udp_to(&env, 42001), XDP_TX);
    let mut reloaded = config(&backends, false);
    let extra = Service::plain(
        (VIP, 81).into(),
        Proto::Tcp,
        backends
            .iter()
            .map(|b| SocketAddr::from((*b, 8081)))
            .collect(),
    );
    reloaded.services.push(extra);
    env.dp.reconcile(&reloaded).unwrap();
    assert_eq!(syn_to(&env, 42002, 81), XDP_TX, "the service added");
    assert_eq!(syn_to(&env, 42003, 80), XDP_TX, "the service kept");
    assert_eq!(udp_to(&env, 42004), XDP_DROP, "the service removed");
    env.dp.reconcile(&config(&backends, true)).unwrap();
    assert_eq!(syn_to(&env, 42005, 81), XDP_DROP, "removed again");
    assert_eq!(udp_to(&env, 42006), XDP_TX, "back again");
    assert_eq!(syn_to(&env, 42007, 80), XDP_TX);
}
