//! The rotation engine's rules, step by step.

use super::*;

const S: Duration = Duration::from_secs(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn engine(n: usize) -> Engine {
    Engine::new(RotationParams::default(), &vec![1.0; n], Duration::ZERO)
}

fn temps(e: &mut Engine, t: &[f64]) {
    for (m, t) in e.members.iter_mut().zip(t) {
        m.temperature = *t;
    }
}

#[test]
fn a_hot_member_rests_and_returns_only_when_cool_and_rested() {
    let mut e = engine(4);
    temps(&mut e, &[0.1, 0.1, 0.9, 0.1]);
    let m = e.tick(10 * S);
    assert_eq!(m.len(), 1);
    assert_eq!(
        (m[0].member, m[0].to, &m[0].reason),
        (2, Place::Outer, &Reason::Hot)
    );
    assert_eq!(e.inner(), vec![0, 1, 3]);
    // Cooled at once, but it must rest min_rest.
    temps(&mut e, &[0.1, 0.1, 0.0, 0.1]);
    assert!(e.tick(19 * S).is_empty());
    let m = e.tick(20 * S);
    assert_eq!((m[0].member, &m[0].reason), (2, &Reason::Cooled));
    assert_eq!(e.inner(), vec![0, 1, 2, 3]);
}

#[test]
fn hysteresis_holds_across_a_wobble_between_the_thresholds() {
    let mut e = engine(4);
    temps(&mut e, &[0.1, 0.1, 0.6, 0.1]);
    assert_eq!(e.tick(10 * S).len(), 1);
    // Wobbling between cool and heat: rested long enough, yet stays out.
    for k in 0..100u64 {
        let t = if k % 2 == 0 { 0.31 } else { 0.54 };
        temps(&mut e, &[0.1, 0.1, t, 0.1]);
        assert!(e.tick(30 * S + ms(100 * k)).is_empty(), "tick {k}");
    }
    // And an inner member wobbling below heat never leaves.
    let mut e = engine(4);
    for k in 0..100u64 {
        let t = if k % 2 == 0 { 0.31 } else { 0.54 };
        temps(&mut e, &[0.1, t, 0.1, 0.1]);
        assert!(e.tick(10 * S + ms(100 * k)).is_empty());
    }
}

#[test]
fn evictions_are_capped_per_tick_and_stop_at_the_minimum() {
    let mut e = engine(9);
    temps(&mut e, &[0.9; 9]);
    assert_eq!(e.tick(10 * S).len(), 3, "max(1, 9/3)");
    assert_eq!(e.tick(10 * S + ms(100)).len(), 2, "max(1, 6/3)");
    assert_eq!(e.tick(10 * S + ms(200)).len(), 1);
    assert_eq!(e.tick(10 * S + ms(300)).len(), 1);
    assert_eq!(e.inner().len(), 2, "never below min_inner");
    assert!(e.tick(10 * S + ms(400)).is_empty());
}

#[test]
fn weight_scales_the_heat_threshold() {
    let mut e = Engine::new(
        RotationParams::default(),
        &[1.0, 1.0, 1.5, 1.0],
        Duration::ZERO,
    );
    temps(&mut e, &[0.0, 0.0, 0.8, 0.0]);
    assert!(e.tick(10 * S).is_empty(), "0.8 < 0.55 x 1.5");
    temps(&mut e, &[0.0, 0.0, 0.83, 0.0]);
    assert_eq!(e.tick(10 * S).len(), 1);
}

#[test]
fn an_unhealthy_member_leaves_at_once_but_never_empties_the_ring() {
    let mut e = engine(3);
    e.members[1].unhealthy = Some("hung".into());
    let m = e.tick(ms(100));
    assert_eq!(m[0].reason, Reason::Unhealthy("hung".into()));
    assert_eq!(e.inner(), vec![0, 2]);
    assert!(!e.panic);
    // A second one: min_inner 2 and nobody healthy to replace it.
    e.members[2].unhealthy = Some("refused".into());
    assert!(e.tick(ms(200)).is_empty());
    assert_eq!(e.inner(), vec![0, 2]);
    assert!(e.panic, "keeping an unhealthy member is panic mode");
    // All three sick: the ring still holds two, the least hot.
    e.members[0].unhealthy = Some("refused".into());
    e.members[1].temperature = 0.9;
    e.tick(ms(300));
    assert_eq!(e.inner().len(), 2);
    assert!(e.panic);
    // One recovers (still resting): it is called back early to replace
    // an unhealthy one.
    e.members[1].unhealthy = None;
    let m = e.tick(ms(400));
    assert!(
        m.iter()
            .any(|m| m.member == 1 && m.reason == Reason::Refill),
        "{m:?}"
    );
    assert!(e.inner().contains(&1));
}

#[test]
fn repeated_evictions_back_off() {
    let mut e = engine(4);
    let mut t = 10 * S;
    let mut rests = Vec::new();
    for _ in 0..4 {
        temps(&mut e, &[0.0, 0.0, 0.9, 0.0]);
        assert_eq!(e.tick(t).len(), 1);
        temps(&mut e, &[0.0, 0.0, 0.0, 0.0]);
        let out = t;
        while e.tick(t).is_empty() {
            t += ms(100);
        }
        rests.push((t - out).as_secs());
        t += 6 * S; // past the cooldown, then hot again
    }
    assert_eq!(rests, vec![10, 20, 40, 80]);
}

#[test]
fn the_outer_ring_is_ordered_by_current_temperature() {
    let mut e = Engine::new(
        RotationParams {
            min_inner: 1,
            ..RotationParams::default()
        },
        &[1.0; 6],
        Duration::ZERO,
    );
    temps(&mut e, &[0.9, 0.9, 0.9, 0.9, 0.9, 0.0]);
    for k in 0..5 {
        e.tick(10 * S + ms(100 * k));
    }
    assert_eq!(e.outer().len(), 5);
    temps(&mut e, &[0.5, 0.1, 0.4, 0.2, 0.3, 0.0]);
    assert_eq!(e.outer(), vec![1, 3, 4, 2, 0]);
    temps(&mut e, &[0.05, 0.6, 0.4, 0.2, 0.3, 0.0]);
    assert_eq!(e.outer(), vec![0, 3, 4, 2, 1]);
    // Coolest first: at a tick where all have rested, those at or
    // below cool return in that order.
    let m = e.tick(60 * S);
    let back: Vec<usize> = m.iter().map(|m| m.member).collect();
    assert_eq!(back, vec![0, 3, 4]);
}

#[test]
fn warm_up_keeps_new_members_out_but_never_empties_the_ring() {
    let p = RotationParams {
        warmup: 3 * S,
        ..RotationParams::default()
    };
    let mut e = Engine::new(p, &[1.0; 4], Duration::ZERO);
    assert_eq!(e.inner(), vec![0, 1], "min_inner called in at once");
    assert!(e.tick(2 * S).is_empty());
    let m = e.tick(3 * S);
    assert_eq!(m.len(), 2);
    assert!(m.iter().all(|m| m.reason == Reason::WarmedUp));
}

use crate::test_rng::Rng;

#[test]
fn property_random_signals_never_break_the_rules() {
    for seed in 1..=300u64 {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let n = 1 + r.below(10) as usize;
        let p = RotationParams {
            min_inner: 1 + r.below(4) as usize,
            warmup: if r.below(3) == 0 {
                2 * S
            } else {
                Duration::ZERO
            },
            ..RotationParams::default()
        };
        let mut e = Engine::new(p, &vec![1.0; n], Duration::ZERO);
        let mut last_hot: Vec<Option<Duration>> = vec![None; n];
        let mut now = Duration::ZERO;
        for step in 0..600 {
            now += ms(50 + r.below(200));
            for m in &mut e.members {
                // Sticky signals with occasional jumps, NaN included.
                if r.below(10) == 0 {
                    m.temperature = match r.below(20) {
                        0 => f64::NAN,
                        _ => r.unit(),
                    };
                    if !m.temperature.is_finite() {
                        m.temperature = 1.0; // the daemon sanitises
                    }
                }
                if r.below(30) == 0 {
                    m.unhealthy = if r.below(3) == 0 {
                        Some("x".into())
                    } else {
                        None
                    };
                }
            }
            let inner_before = e.inner().len();
            let moves = e.tick(now);
            let ctx = format!("seed {seed} step {step} n {n} {p:?}");
            let inner = e.inner();
            assert!(!inner.is_empty(), "empty inner ring: {ctx}");
            assert!(inner.len() >= p.min_inner.min(n), "below minimum: {ctx}");
            let healthy = e.members.iter().filter(|m| m.unhealthy.is_none()).count();
            if healthy >= p.min_inner {
                assert!(
                    inner.iter().all(|i| e.members[*i].unhealthy.is_none()),
                    "unhealthy member kept though healthy ones exist: {ctx}"
                );
            }
            let hot = moves.iter().filter(|m| m.reason == Reason::Hot).count();
            assert!(hot <= (inner_before / 3).max(1), "eviction cap: {ctx}");
            for m in &moves {
                match m.reason {
                    Reason::Hot => {
                        if let Some(t) = last_hot[m.member] {
                            assert!(now - t >= p.cooldown, "flapping: {ctx}");
                        }
                        last_hot[m.member] = Some(now);
                    }
                    Reason::Cooled => {
                        assert!(m.temperature <= p.cool, "returned warm: {ctx}");
                        let out = last_hot[m.member];
                        if let Some(t) = out {
                            assert!(now - t >= p.min_rest, "rest too short: {ctx}");
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

#[test]
fn while_held_no_member_leaves_hot_or_returns_but_the_sick_still_leave() {
    let mut e = engine(4);
    temps(&mut e, &[0.1, 0.1, 0.9, 0.1]);
    assert_eq!(e.tick(10 * S).len(), 1);
    e.hold_until = 40 * S;
    // Member 2 rested and cooled; member 0 hot: neither moves while held.
    temps(&mut e, &[0.9, 0.1, 0.0, 0.1]);
    assert!(e.tick(30 * S).is_empty());
    assert_eq!(e.inner(), vec![0, 1, 3]);
    // The sick leave at once, held or not.
    e.members[1].unhealthy = Some("refused".into());
    let m = e.tick(31 * S);
    assert_eq!((m[0].member, m[0].to), (1, Place::Outer));
    // Once the hold is over the rested one returns, and then (the ring
    // above its floor again) the hot one leaves.
    let m = e.tick(40 * S);
    assert_eq!((m[0].member, m[0].to), (2, Place::Inner));
    let m = e.tick(40 * S + ms(100));
    assert_eq!((m[0].member, m[0].to), (0, Place::Outer));
}

#[test]
fn following_a_lost_leaders_ring_places_members_as_it_had_them() {
    let mut e = engine(4);
    let m = e.follow(&[0, 1, 3], 10 * S);
    assert_eq!(m.len(), 1);
    assert_eq!(
        (m[0].member, m[0].to, &m[0].reason),
        (2, Place::Outer, &Reason::Followed)
    );
    assert_eq!(e.inner(), vec![0, 1, 3]);
    // It rests at least min_rest before it may return, cool as it is.
    assert!(e.tick(11 * S).is_empty());
    let m = e.tick(10 * S + e.params.min_rest);
    assert_eq!((m[0].member, &m[0].reason), (2, &Reason::Cooled));
    // Following the same ring again moves nothing; a member drained here
    // stays out, and a ring of none this balancer takes changes nothing.
    assert!(e.follow(&[0, 1, 2, 3], 30 * S).is_empty());
    e.set_drained(1, true, 31 * S);
    let m = e.follow(&[0, 1, 2, 3], 32 * S);
    assert!(m.is_empty(), "{m:?}");
    assert_eq!(e.inner(), vec![0, 2, 3]);
    e.members[0].unhealthy = Some("refused".into());
    assert!(e.follow(&[0, 1], 33 * S).is_empty());
    assert_eq!(e.inner(), vec![0, 2, 3]);
}
