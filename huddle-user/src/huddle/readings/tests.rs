//! Readings, windows, hung and pass-over limits, on made-up counters.

use super::*;
use crate::config::LatencyMode;
use crate::net::probe::ProbeResult;
use huddle_common::{BackendStats, Latency, Pulse, HUNG_EVIDENCE};

fn settings() -> Settings {
    Settings::default()
}

fn tracker() -> Tracker {
    let s = Service::plain(
        "1.1.1.1:1".parse().unwrap(),
        Proto::Tcp,
        vec!["2.2.2.2:2".parse().unwrap()],
    );
    Tracker::new(0, s.options[0].clone(), false, s.probe.clone())
}

fn stats(answered: u64, ttfb_ms: u64, turns: u64) -> BackendStats {
    BackendStats {
        answered,
        ttfb_ns: ttfb_ms * 1_000_000,
        turns,
        flows_new: turns,
        ..BackendStats::default()
    }
}

fn hist_of(samples_ms: &[u64]) -> Latency {
    let mut h = Latency::default();
    for ms in samples_ms {
        h.buckets[huddle_common::latency_bucket(ms * 1_000_000)] += 1;
    }
    h
}

#[test]
fn window_takes_newest_ticks_until_enough_samples() {
    let mut s = settings();
    s.min_samples = 3;
    let mut t = tracker();
    let p = Pulse::default();
    t.observe(
        &stats(0, 0, 0),
        &Latency::default(),
        &p,
        0,
        &s,
        s.hung_after,
    );
    // 5 samples of 10 ms.
    t.observe(
        &stats(5, 50, 5),
        &hist_of(&[10; 5]),
        &p,
        0,
        &s,
        s.hung_after,
    );
    assert_eq!(t.window.samples, 5);
    assert!((t.window.mean_ms.unwrap() - 10.0).abs() < 1e-9);
    // Then 3 of 50 ms: enough alone (min_samples 3), old ones ignored.
    let mut all = vec![10; 5];
    all.extend([50; 3]);
    t.observe(&stats(8, 200, 8), &hist_of(&all), &p, 0, &s, s.hung_after);
    assert_eq!(t.window.samples, 3);
    assert!((t.window.mean_ms.unwrap() - 50.0).abs() < 1e-9);
    let p50 = t.window.p50_ms.unwrap();
    assert!((40.0..=62.5).contains(&p50), "{p50}");
}

/// A tick in which `t` still owes what `owes` says, `opened` connections
/// opened so far, nothing answered, at `at_ms`: the fault it leaves.
fn owing(t: &mut Tracker, owes: &Pulse, opened: u64, at_ms: u64, s: &Settings) -> Option<String> {
    let (l, at) = (Latency::default(), at_ms * 1_000_000);
    t.observe(&stats(0, 0, opened), &l, owes, at, s, s.hung_after);
    t.kernel_fault.clone()
}

#[test]
fn a_backend_owing_answers_too_long_is_hung() {
    let s = settings();
    let mut t = tracker();
    let ms = 1_000_000u64;
    // Owing since 1 s, with `evidence` turns, the last written at `last`.
    let owes = |evidence: u64, last: u64| Pulse {
        turn_wait_ns: 1000 * ms,
        syn_wait_ns: 0,
        evidence,
        evidence_ns: last * ms,
    };
    assert_eq!(owing(&mut t, &owes(0, 0), 1, 1100, &s), None);
    // One turn, 250 ms: a slow request, not yet hung.
    assert_eq!(owing(&mut t, &owes(0, 0), 1, 1250, &s), None);
    // Held 3 s with nothing else coming (a long poll on a quiet
    // backend): still not hung, as nothing new went unanswered.
    assert_eq!(owing(&mut t, &owes(0, 0), 1, 4000, &s), None);
    // Fewer requests than `HUNG_EVIDENCE` sent to it and unanswered:
    // not yet, however long.
    let n = HUNG_EVIDENCE;
    assert_eq!(owing(&mut t, &owes(n - 1, 4000), 2, 4150, &s), None);
    // The last one, just sent: it may still be answered.
    assert_eq!(owing(&mut t, &owes(n, 4160), 3, 4170, &s), None);
    // Unanswered for half of `hung_after` (100 ms): suspected, and the
    // backend asked at once (a client can hold requests no server
    // answers), once.
    assert_eq!(owing(&mut t, &owes(n, 4160), 3, 4270, &s), None);
    let deadline = t.suspicion.take_ask().expect("a probe asked for");
    assert_eq!(deadline, s.hung_after.min(s.probe.timeout));
    assert_eq!(t.suspicion.take_ask(), None, "asked once");
    // Its probe fails too: hung.
    let failed = ProbeResult {
        latency_ms: 200.0,
        error: Some("timed out".into()),
        local: false,
    };
    assert_eq!(t.suspicion.answered(&failed), suspicion::Answer::Confirmed);
    let fault = owing(&mut t, &owes(n, 4160), 3, 4300, &s).unwrap();
    assert!(
        fault.starts_with("hung") && fault.contains("failed too"),
        "{fault}"
    );
    // An answer to a turn clears the pulse, and the fault.
    t.observe(
        &stats(1, 300, 3),
        &hist_of(&[300]),
        &Pulse::default(),
        4100 * ms,
        &s,
        s.hung_after,
    );
    assert_eq!(t.kernel_fault, None);
}

/// A backend no SYN-ACK ever comes from (its address is nobody's): it
/// completes no handshake, so only the SYNs sent to it can show that
/// more than one went unanswered.
#[test]
fn a_backend_whose_syns_go_unanswered_is_unreachable_after_syn_timeout() {
    let s = settings();
    let mut t = tracker();
    let ms = 1_000_000u64;
    let owes = Pulse {
        syn_wait_ns: 1000 * ms,
        ..Pulse::default()
    };
    let tick = |t: &mut Tracker, syns: u64, at_ms: u64| {
        let st = BackendStats {
            syns,
            ..BackendStats::default()
        };
        t.observe(
            &st,
            &Latency::default(),
            &owes,
            at_ms * ms,
            &s,
            s.hung_after,
        );
        t.kernel_fault.clone()
    };
    assert_eq!(tick(&mut t, 1, 1100), None);
    // One SYN unanswered past `syn_timeout` (300 ms): may be one lost.
    assert_eq!(tick(&mut t, 1, 1400), None);
    // Another attempt sent to it since, still nothing answered.
    let fault = tick(&mut t, 2, 1410).expect("unreachable");
    assert!(fault.starts_with("unreachable"), "{fault}");
    // A lone SYN waits five times as long.
    let mut lone = tracker();
    assert_eq!(tick(&mut lone, 1, 1100), None);
    assert_eq!(tick(&mut lone, 1, 2400), None);
    assert!(tick(&mut lone, 1, 2600).is_some());
}

#[test]
fn hung_after_and_pass_over_follow_the_rings_own_answer_times() {
    let s = settings();
    let mut h = ServiceHuddle {
        engine: Engine::new(s.rotation_params, &[1.0], Duration::ZERO),
        trackers: Vec::new(),
        rotation: true,
        answer_p99_ms: None,
        ring_p50_ms: None,
        probe_p50_ms: None,
        settled: false,
        rest_needs: Vec::new(),
        quiet_mark: None,
        dirty: true,
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // No figure yet: the configured bound.
    assert_eq!(h.hung_after(&s), s.hung_after);
    // A ring answering in 11 ms at p99: 5 x 11 = 55 ms; new flows pass
    // a backend over after 22 ms owed, or a SYN-ACK owed as long.
    h.answer_p99_ms = Some(11.0);
    assert!((ms(h.hung_after(&s)) - 55.0).abs() < 1e-6);
    // While the rings hold, the configured bound: a slow backend is not
    // called hung (it would leave during the hold).
    h.engine.hold_until = Duration::from_secs(5);
    assert_eq!(h.hung_after_at(&s, Duration::from_secs(4)), s.hung_after);
    assert!((ms(h.hung_after_at(&s, Duration::from_secs(5))) - 55.0).abs() < 1e-6);
    h.engine.hold_until = Duration::ZERO;
    let t = h.tuning(&s, false);
    assert_eq!((t.turn_skip_ns, t.syn_skip_ns), (22_000_000, 22_000_000));
    // A fast ring: the floors hold.
    h.answer_p99_ms = Some(0.5);
    assert_eq!(h.hung_after(&s), s.hung_after_min);
    let t = h.tuning(&s, false);
    assert_eq!((t.turn_skip_ns, t.syn_skip_ns), (10_000_000, 20_000_000));
    // A slow ring: the ceilings hold.
    h.answer_p99_ms = Some(900.0);
    assert_eq!(h.hung_after(&s), s.hung_after);
    let t = h.tuning(&s, false);
    assert_eq!(t.turn_skip_ns, s.hung_after.as_nanos() as u64);
    assert_eq!(
        t.syn_skip_ns,
        t.turn_skip_ns.min(s.syn_timeout.as_nanos() as u64)
    );
    // UDP backends need not answer: never passed over.
    assert_eq!(h.tuning(&s, true), huddle_common::Tuning::default());
}

/// `latency = "connect"`: the backend is judged on its SYN-ACK times, and
/// a request owes nothing (an opaque stream's turns say nothing), so new
/// connections whose requests go unanswered do not make it hung, nor does
/// the kernel pass it over for them; unanswered SYNs still count.
#[test]
fn with_latency_connect_requests_owe_nothing_and_connect_times_judge() {
    let s = settings();
    let mut svc = Service::plain(
        "1.1.1.1:1".parse().unwrap(),
        Proto::Tcp,
        vec!["2.2.2.2:2".parse().unwrap(), "2.2.2.3:2".parse().unwrap()],
    );
    svc.latency = LatencyMode::Connect;
    let mut h = ServiceHuddle::new(&svc, &[0, 1], &s, Duration::ZERO);
    h.answer_p99_ms = Some(11.0);
    let t = h.tuning(&s, false);
    assert_eq!(t.turn_skip_ns, 0, "requests never make it passed over");
    assert_eq!(t.syn_skip_ns, 22_000_000, "SYNs still do");
    let ms = 1_000_000u64;
    let owes = Pulse {
        turn_wait_ns: 1000 * ms,
        evidence: 2,
        ..Pulse::default()
    };
    let tr = &mut h.trackers[0];
    for (flows, at) in [(1, 1100), (5, 1500), (9, 3000)] {
        tr.observe(
            &stats(0, 0, flows),
            &Latency::default(),
            &owes,
            at * ms,
            &s,
            s.hung_after,
        );
        assert_eq!(tr.kernel_fault, None, "hung from an unanswered request");
    }
    // Its connect times are what it is judged on.
    let mut connects = stats(0, 0, 0);
    for (n, sample_ms) in [(0u64, 0u64), (12, 2), (24, 2)] {
        connects.syn_acks = n;
        connects.connect_ns = n * sample_ms * ms;
        tr.observe_connect_time(
            &connects,
            &hist_of(&vec![sample_ms; n as usize]),
            s.min_samples,
        );
    }
    let w = tr.judged_window().unwrap();
    assert!(
        w.samples >= s.min_samples && w.p50_ms.unwrap() < 3.0,
        "{w:?}"
    );
    // `off`: no window judges it.
    tr.latency = LatencyMode::Off;
    assert!(tr.judged_window().is_none());
}

/// One tick: `heavy_ms` samples from the backend's heavy source and
/// `rest_ms` from everyone else, on top of the cumulative `so_far`.
fn tick_of(t: &mut Tracker, so_far: &mut (Vec<u64>, Vec<u64>), heavy_ms: &[u64], rest_ms: &[u64]) {
    let s = settings();
    so_far.0.extend(heavy_ms);
    so_far.1.extend(rest_ms);
    let all: Vec<u64> = so_far.0.iter().chain(&so_far.1).copied().collect();
    let sum: u64 = all.iter().sum();
    t.observe_heavy(&hist_of(&so_far.0));
    t.observe(
        &stats(all.len() as u64, sum, all.len() as u64),
        &hist_of(&all),
        &Pulse::default(),
        0,
        &s,
        s.hung_after,
    );
}

#[test]
fn one_source_alone_cannot_make_a_backend_slow_but_a_sole_one_is_heard() {
    // 30 slow samples from the heavy source, 10 fast from the rest: the
    // median of all would be 30 ms; the rest's 5 ms is taken.
    let mut t = tracker();
    let mut so_far = (Vec::new(), Vec::new());
    tick_of(&mut t, &mut so_far, &[], &[]);
    tick_of(&mut t, &mut so_far, &[30; 30], &[5; 10]);
    let p50 = t.window.p50_ms.unwrap();
    assert!(p50 < 6.5, "outvoted: {p50}");
    assert_eq!((t.window.samples, t.window.heavy_samples), (40, 30));
    // A sole client (every sample its own) finds it slow: slow.
    let mut t = tracker();
    let mut so_far = (Vec::new(), Vec::new());
    tick_of(&mut t, &mut so_far, &[], &[]);
    tick_of(&mut t, &mut so_far, &[30; 30], &[]);
    assert!(t.window.p50_ms.unwrap() > 25.0);
    // Everyone finds it slow: slow, whoever is heavy.
    let mut t = tracker();
    let mut so_far = (Vec::new(), Vec::new());
    tick_of(&mut t, &mut so_far, &[], &[]);
    tick_of(&mut t, &mut so_far, &[30; 8], &[30; 12]);
    assert!(t.window.p50_ms.unwrap() > 25.0);
    // A few samples of the rest (under half of `min_samples`) do not
    // outvote the heavy source: too little to judge on.
    let mut t = tracker();
    let mut so_far = (Vec::new(), Vec::new());
    tick_of(&mut t, &mut so_far, &[], &[]);
    tick_of(&mut t, &mut so_far, &[30; 30], &[5; 2]);
    assert!(t.window.p50_ms.unwrap() > 25.0);
}

#[test]
fn one_slow_probe_moves_nothing_two_in_three_do() {
    use crate::net::probe::ProbeResult;
    let ok = |ms: f64| ProbeResult {
        latency_ms: ms,
        error: None,
        local: false,
    };
    let mut t = tracker();
    t.probed(ok(3.1));
    assert_eq!(t.probe_ms(true), None, "one probe says nothing");
    t.probed(ok(0.1));
    assert_eq!(t.probe_ms(true), Some(0.1), "the lesser of two");
    t.probed(ok(0.1));
    t.probed(ok(3.1));
    assert_eq!(t.probe_ms(true), Some(0.1), "one slow in three");
    assert_eq!(t.probe_ms(false), Some(3.1), "resting: the last");
    t.probed(ok(3.2));
    assert_eq!(t.probe_ms(true), Some(3.1), "two slow in three");
    t.probed(ProbeResult {
        latency_ms: 0.0,
        error: Some("refused".into()),
        local: false,
    });
    assert_eq!(t.probe_ms(true), None, "the last probe failed");
    assert_eq!(t.probe_ms(false), None);
}

/// A service of four backends, each probed three times at 10 ms.
fn four_probed_at_10ms(s: &Settings) -> ServiceHuddle {
    use crate::net::probe::ProbeResult;
    let svc = Service::plain(
        "1.1.1.1:1".parse().unwrap(),
        Proto::Tcp,
        (0..4)
            .map(|i| format!("2.2.2.{i}:2").parse().unwrap())
            .collect(),
    );
    let mut h = ServiceHuddle::new(&svc, &[0, 1, 2, 3], s, Duration::ZERO);
    for t in &mut h.trackers {
        for _ in 0..3 {
            t.probed(ProbeResult {
                latency_ms: 10.0,
                error: None,
                local: false,
            });
        }
    }
    h
}

/// A slow probe answer of an inner backend judged on its probes asks for
/// a second at once: one that would make it hot if the next agrees, not
/// one a little above the ring, nor one of a resting backend.
#[test]
fn a_probe_slow_enough_to_rest_a_backend_asks_for_a_second() {
    let s = settings();
    let mut h = four_probed_at_10ms(&s);
    assert!(!h.wants_confirming(1, 50.0, &s), "no ring median yet");
    let _ = h.step(&s, Duration::from_millis(100));
    assert_eq!(h.probe_p50_ms, Some(10.0));
    assert!(h.wants_confirming(1, 50.0, &s), "5x the ring");
    assert!(!h.wants_confirming(1, 12.0, &s), "a little above the ring");
    assert!(!h.wants_confirming(9, 50.0, &s), "no such backend");
    h.engine.members[1].temperature = 0.9;
    h.trackers[1].temperature = 0.9;
    assert_eq!(h.engine.tick(Duration::from_secs(10)).len(), 1);
    assert!(!h.wants_confirming(1, 50.0, &s), "resting");
}

/// A backend rested for its requests keeps its temperature until a probe
/// taken after the move: its last probe, from while it carried traffic
/// (probed once a second then), says nothing of why it left.
#[test]
fn a_rested_backend_keeps_its_temperature_until_a_probe_after_the_move() {
    use crate::net::probe::ProbeResult;
    let ok = |ms: f64| ProbeResult {
        latency_ms: ms,
        error: None,
        local: false,
    };
    let s = settings();
    let mut h = four_probed_at_10ms(&s);
    // Rested hot (as the request window would have found it).
    h.engine.members[2].temperature = 0.7;
    h.trackers[2].temperature = 0.7;
    let moves = h.engine.tick(Duration::from_secs(10));
    assert_eq!(moves.len(), 1);
    h.trackers[2].probes_at_move = h.trackers[2].probes_seen;
    let _ = h.step(&s, Duration::from_secs(10) + Duration::from_millis(100));
    assert!(
        (h.trackers[2].temperature - 0.7).abs() < 1e-9,
        "no probe since: {}",
        h.trackers[2].temperature
    );
    // A slow probe after the move keeps it hot; a fast one cools it.
    h.trackers[2].probed(ok(50.0));
    let _ = h.step(&s, Duration::from_secs(10) + Duration::from_millis(200));
    assert!(
        h.trackers[2].temperature >= 0.69,
        "{}",
        h.trackers[2].temperature
    );
    h.trackers[2].probed(ok(10.0));
    let _ = h.step(&s, Duration::from_secs(10) + Duration::from_millis(300));
    assert!(
        h.trackers[2].temperature < 0.5,
        "{}",
        h.trackers[2].temperature
    );
}

/// A service whose counters stand still comes to rest (a tick may pass it
/// by) within a few ticks, and new counters, an owed answer, a probe or a
/// drain take it out of rest.
#[test]
fn a_service_with_nothing_moving_rests_until_something_comes() {
    let mut s = settings();
    s.rotation_params.warmup = Duration::ZERO;
    let svc = Service::plain(
        "1.1.1.1:1".parse().unwrap(),
        Proto::Tcp,
        vec!["2.2.2.2:2".parse().unwrap(), "2.2.2.3:2".parse().unwrap()],
    );
    let mut h = ServiceHuddle::new(&svc, &[0, 1], &s, Duration::ZERO);
    let (still, hist) = (stats(5, 25, 5), hist_of(&[5, 5, 5, 5, 5]));
    let mut rested = None;
    for tick in 1..=100u64 {
        let now = Duration::from_millis(100 * tick);
        for t in &mut h.trackers {
            t.observe(
                &still,
                &hist,
                &Pulse::default(),
                tick * 100_000_000,
                &s,
                s.hung_after,
            );
        }
        assert!(h.step(&s, now).is_empty());
        h.dirty = false;
        if h.at_rest(now) {
            rested = Some(tick);
            break;
        }
    }
    assert!(rested.is_some_and(|t| t <= 3), "rested at tick {rested:?}");
    let now = Duration::from_secs(11);
    let t = &h.trackers[0];
    assert!(!t.wakes(&still, &Pulse::default()));
    assert!(t.wakes(&stats(6, 30, 6), &Pulse::default()), "new counters");
    let owed = Pulse {
        turn_wait_ns: 1,
        ..Pulse::default()
    };
    assert!(t.wakes(&still, &owed), "an owed answer");
    h.trackers[1].probed(crate::net::probe::ProbeResult {
        latency_ms: 0.2,
        error: None,
        local: false,
    });
    assert!(!h.at_rest(now), "a probe came");
    h.trackers[1].stirred = false;
    h.trackers[1].probe_fresh = false;
    assert!(h.at_rest(now));
    // Settled, it answers the prober from what it kept, until it is
    // stirred (dirty) or its tracker is judged again.
    h.trackers[0].active_flows = 3;
    h.settle(true, &s, Some(7));
    assert_eq!(h.quiet_mark, None, "a backend holds a flow: not quiet");
    assert_eq!(h.needs_probes(&s)[0], Need::Thin, "an idle long connection");
    let kept = h.needs_probes(&s)[1];
    assert_ne!(kept, Need::Now);
    h.trackers[1].unhealthy = Some("refused".into());
    assert_eq!(h.needs_probes(&s)[1], kept, "kept while settled");
    h.dirty = true;
    assert_eq!(h.needs_probes(&s)[1], Need::Now, "stirred: asked afresh");
    h.trackers[1].unhealthy = None;
    h.dirty = false;
    h.engine.set_drained(0, true, now);
    assert!(!h.at_rest(now), "drained");
}

/// Per-backend median and p99 (ms) of four equal NGINX backends at full
/// speed, one-second windows measured 7 December 2026 (`SHARED_SPREAD`);
/// their p75 was not recorded, so they are judged without the cap.
const BUSY_WINDOWS: [([f64; 4], [f64; 4]); 4] = [
    ([1.4, 5.8, 3.6, 3.7], [12.0, 12.2, 13.3, 12.5]),
    ([1.3, 2.0, 1.3, 4.1], [6.8, 7.8, 6.8, 18.4]),
    ([5.1, 0.3, 3.8, 1.1], [16.2, 4.9, 14.6, 15.7]),
    ([2.3, 1.0, 3.6, 4.5], [8.1, 16.0, 11.4, 12.5]),
];

#[test]
fn backends_slow_together_are_no_outliers_but_one_slow_alone_is() {
    let s = settings();
    let anomaly = |l: f64, against: Option<f64>| thermal::anomaly(l, against.unwrap(), &s.thermal);
    let (mut by_reference, mut by_median) = (0.0f64, 0.0f64);
    for (p50, p99) in BUSY_WINDOWS {
        let median = thermal::median(p50);
        let reference = shared_spread(median, thermal::median(p99), None);
        for l in p50 {
            by_reference = by_reference.max(anomaly(l, reference));
            by_median = by_median.max(anomaly(l, median));
        }
    }
    println!("largest anomaly: {by_median:.2} against the median, {by_reference:.2} against the reference");
    // The ring's median alone warms the busiest of each moment: 0.7 x
    // 0.75 is nearly `heat` (0.55), and such windows come in runs.
    assert!(by_median > 0.7, "{by_median}");
    assert!(by_reference < 0.1, "{by_reference}");
    // One backend 5x a calm ring (p99 near its median), or starved under
    // a busy one, is as hot as before.
    let heat = |l: f64, against: Option<f64>| {
        s.thermal.weights.latency * anomaly(l, against) >= s.rotation_params.heat
    };
    assert!(heat(
        50.0,
        shared_spread(Some(10.0), Some(13.0), Some(11.0))
    ));
    let busy = shared_spread(thermal::median(BUSY_WINDOWS[0].0), Some(12.4), None);
    assert!(heat(300.0, busy));
    assert_eq!(shared_spread(Some(2.0), None, None), Some(2.0));
    assert_eq!(shared_spread(None, Some(8.0), Some(3.0)), None);
}

/// The failing CI window of 7 December 2026: an endpoint every backend
/// has takes 200 ms (5% of requests), so two of four windows' p99 sat at
/// 197.6 ms; b3 turned 5x slow. Half the p99 (51 ms) hid it. The p75
/// was not recorded: set here a tenth above each median, where a 5% tail
/// leaves it. Capped by it the reference does not hide b3, and a ring whose
/// p75 is as wide as half its p99 is judged as before.
#[test]
fn a_shared_slow_endpoint_hides_no_slow_backend() {
    let s = settings();
    let p50 = [4.9, 4.9, 25.6, 4.8];
    let p99 = [197.6, 6.2, 197.6, 6.2];
    let p75 = [5.4, 5.4, 27.0, 5.3];
    let median = thermal::median(p50);
    let uncapped = shared_spread(median, thermal::median(p99), None).unwrap();
    let reference = shared_spread(median, thermal::median(p99), thermal::median(p75)).unwrap();
    assert!(uncapped > 50.0, "{uncapped}");
    assert!((reference - 5.4).abs() < 1e-9, "{reference}");
    assert_eq!(thermal::anomaly(25.6, reference, &s.thermal), 1.0);
    assert_eq!(thermal::anomaly(4.9, reference, &s.thermal), 0.0);
    let wide = shared_spread(Some(3.6), Some(12.4), Some(7.0)).unwrap();
    assert!((wide - 6.2).abs() < 1e-9, "{wide}");
}

#[path = "suspicion_tests.rs"]
mod suspicion_tests;
