//! Which backends to probe this round. A probe tells most about a backend
//! the kernel's counters say little of, in this order (`Need`): one
//! resting, unhealthy or suspect (owing an answer, failing attempts); one
//! carrying too little traffic to be judged on it; one idle. One whose
//! own turns fill its window is measured passively, so it is probed only
//! every `active_interval`, for the health its traffic does not show (an
//! HTTP 500 is invisible to the kernel). An address in several services is
//! probed once. A round never holds more than the budget (`max_per_second`
//! x `interval`): those that tell most first, then the longest unprobed.
//!
//! Idle backends came after the busy ones when, at 4,096 services x 16
//! backends, the 2,000 probes a second went round all 65,536 alike: a 5x
//! slow backend of a service taking 6 connections a second each (too few
//! for its window, so judged on probes) was probed every 30 s or so and
//! left its ring 6 s after it slowed (hc-scale; 600 ms at 16 x 16).
//!
//! Before this every backend was probed every 250 ms, all at once: 4,096
//! probes a second at the 1,024-backend limit.

use std::{collections::HashMap, net::SocketAddr, time::Duration};

/// How often, and how many.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Budget {
    /// A round's period: how often a backend that needs it is probed.
    pub interval: Duration,
    /// How often a healthy backend carrying traffic is probed.
    pub active_interval: Duration,
    /// The most probes a second, over all backends.
    pub max_per_second: u32,
}

impl Budget {
    /// The most probes one round sends (at least one).
    #[must_use]
    pub fn per_round(&self) -> usize {
        let n = f64::from(self.max_per_second) * self.interval.as_secs_f64();
        (n.floor() as usize).max(1)
    }
}

/// How much a probe of a backend would tell, most first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Need {
    /// Resting, unhealthy or suspect: every round.
    Now,
    /// Carrying traffic too thin to judge it on: every round.
    Thin,
    /// Idle: every round, after the others.
    Idle,
    /// Measured by its own traffic: every `active_interval`.
    Measured,
}

/// When each address was last probed.
#[derive(Default)]
pub struct Planner {
    last: HashMap<SocketAddr, Duration>,
}

impl Planner {
    /// The addresses to probe at `now`, from `wants`: each target's
    /// address and how much a probe tells (`Need`); an address listed
    /// twice counts as the more needed.
    pub fn plan(
        &mut self,
        wants: &[(SocketAddr, Need)],
        now: Duration,
        b: &Budget,
    ) -> Vec<SocketAddr> {
        // A little early counts as due: rounds drift by a few ms.
        let slack = b.interval / 4;
        // (need, when last probed: never sorts first, address)
        let mut due: Vec<(Need, Option<Duration>, SocketAddr)> = wants
            .iter()
            .filter_map(|&(a, n)| {
                let every = if n == Need::Measured {
                    b.active_interval
                } else {
                    b.interval
                };
                let last = self.last.get(&a).copied();
                let is_due = last.is_none_or(|t| now.saturating_sub(t) + slack >= every);
                is_due.then_some((n, last, a))
            })
            .collect();
        // Most needed first, then the longest unprobed, then by address:
        // only the round's share is sorted (at 65,536 backends sorting all
        // of them every round was a sixth of an idle daemon's time).
        type Due = (Need, Option<Duration>, SocketAddr);
        let order = |x: &Due, y: &Due| x.0.cmp(&y.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2));
        let k = b.per_round();
        if due.len() > k {
            due.select_nth_unstable_by(k - 1, order);
            due.truncate(k);
        }
        due.sort_by(order);
        // An address in two services is probed once, as the more urgent
        // (sorted first); not one map of every address a round.
        let mut once = std::collections::HashSet::with_capacity(due.len());
        let chosen: Vec<SocketAddr> = due
            .into_iter()
            .filter(|d| once.insert(d.2))
            .map(|(_, _, a)| a)
            .collect();
        for a in &chosen {
            self.last.insert(*a, now);
        }
        // Forget addresses no longer configured.
        if self.last.len() > 2 * wants.len().max(1) {
            let known: std::collections::HashSet<_> = wants.iter().map(|(a, _)| *a).collect();
            self.last.retain(|a, _| known.contains(a));
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(n: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], n))
    }

    const MS: Duration = Duration::from_millis(1);

    fn budget(max_per_second: u32) -> Budget {
        Budget {
            interval: 250 * MS,
            active_interval: 2000 * MS,
            max_per_second,
        }
    }

    #[test]
    fn active_backends_are_probed_every_active_interval_the_others_every_round() {
        let mut p = Planner::default();
        let b = budget(10_000);
        let wants = [
            (a(1), Need::Now),
            (a(2), Need::Measured),
            (a(3), Need::Measured),
        ];
        assert_eq!(p.plan(&wants, Duration::ZERO, &b).len(), 3, "all at first");
        for k in 1..8u32 {
            assert_eq!(p.plan(&wants, 250 * k * MS, &b), vec![a(1)], "round {k}");
        }
        let mut r = p.plan(&wants, 2000 * MS, &b);
        r.sort();
        assert_eq!(r, vec![a(1), a(2), a(3)]);
    }

    #[test]
    fn an_address_in_two_services_is_probed_once_and_urgent_if_either_says() {
        let mut p = Planner::default();
        let b = budget(10_000);
        let wants = [(a(1), Need::Measured), (a(1), Need::Now)];
        assert_eq!(p.plan(&wants, Duration::ZERO, &b), vec![a(1)]);
        assert_eq!(p.plan(&wants, 250 * MS, &b), vec![a(1)]);
    }

    #[test]
    fn the_budget_takes_urgent_first_then_the_longest_unprobed() {
        let mut p = Planner::default();
        // 8 a second: 2 a round.
        let b = budget(8);
        let wants: Vec<_> = (1..=6)
            .map(|n| (a(n), if n == 5 { Need::Now } else { Need::Idle }))
            .collect();
        let r1 = p.plan(&wants, Duration::ZERO, &b);
        assert_eq!(r1, vec![a(5), a(1)]);
        let r2 = p.plan(&wants, 250 * MS, &b);
        assert_eq!(r2, vec![a(5), a(2)], "then the never probed, in order");
        let r3 = p.plan(&wants, 500 * MS, &b);
        assert_eq!(r3, vec![a(5), a(3)]);
        // Every address gets its turn within the budget's reach.
        let mut seen = std::collections::HashSet::new();
        for k in 3..12u32 {
            seen.extend(p.plan(&wants, 250 * k * MS, &b));
        }
        assert_eq!(seen.len(), 6);
    }

    #[test]
    fn thin_traffic_is_probed_every_round_before_the_idle() {
        let mut p = Planner::default();
        // 8 a second: 2 a round, among 1 suspect, 1 thin and 100 idle.
        let b = budget(8);
        let mut wants: Vec<_> = (1..=100).map(|n| (a(n), Need::Idle)).collect();
        wants.push((a(200), Need::Thin));
        wants.push((a(201), Need::Now));
        for k in 0..20u32 {
            let r = p.plan(&wants, 250 * k * MS, &b);
            assert_eq!(r, vec![a(201), a(200)], "round {k}");
        }
        // With room, the idle get the rest of each round.
        let mut p = Planner::default();
        let r = p.plan(&wants, Duration::ZERO, &budget(1_000));
        assert_eq!(r.len(), 102);
    }
}
