//! `huddle top`: a live view of the huddle over the control socket. Per
//! service the rings, each backend's temperature with a sparkline of the
//! last minute and the terms of it, p50/p99, requests and new flows a
//! second, active flows and health; the rotations as they happen. Keys:
//! up/down select a backend, d/u drain/undrain it, tab switches services,
//! q quits. Redraws every tick; says "reconnecting" while the daemon is
//! away (a restart) and carries on when it is back. Fits 80x24.

use crate::{
    status::control::{call, Request},
    status::{BackendStatus, ServiceStatus, Status},
};
use anyhow::Result;
use ratatui::{
    crossterm::event::{self, Event, KeyCode, KeyEventKind},
    layout::{Constraint, Layout},
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::{Block, Cell, Paragraph, Row, Table},
    Frame,
};
use std::{
    collections::{HashMap, VecDeque},
    path::Path,
    time::{Duration, Instant},
};

/// Sparkline of the last minute: a sample every 6 s fits 10 columns (the
/// whole table must fit 80).
const SPARK: usize = 10;
const SPARK_EVERY: Duration = Duration::from_secs(6);
const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// What the view knows between redraws.
#[derive(Default)]
pub struct Model {
    pub status: Option<Status>,
    /// Set while the control socket does not answer.
    pub error: Option<String>,
    pub service: usize,
    pub selected: usize,
    /// Per (service, backend): temperatures of the last minute.
    history: HashMap<(String, String), VecDeque<f64>>,
    last_spark: Option<Instant>,
    /// Per (service, backend): (answered, flows_new) at the previous
    /// status, and when, for rates.
    previous: HashMap<(String, String), (u64, u64, f64)>,
    rates: HashMap<(String, String), (f64, f64)>,
    /// A drain or undrain's answer, shown until the next key.
    pub message: Option<String>,
}

impl Model {
    /// Takes a fresh status in: temperature history and rates.
    pub fn update(&mut self, st: Status) {
        let spark = self.last_spark.is_none_or(|t| t.elapsed() >= SPARK_EVERY);
        if spark {
            self.last_spark = Some(Instant::now());
        }
        for s in &st.services {
            for b in &s.backends {
                let key = (s.name.clone(), b.addr.clone());
                if spark {
                    let h = self.history.entry(key.clone()).or_default();
                    h.push_back(b.temperature);
                    while h.len() > SPARK {
                        h.pop_front();
                    }
                }
                let answered = b.counters.get("answered").copied().unwrap_or(0);
                let flows = b.counters.get("flows_new").copied().unwrap_or(0);
                if let Some((a0, f0, t0)) = self.previous.get(&key) {
                    let dt = st.uptime_s - t0;
                    if dt > 0.0 {
                        self.rates.insert(
                            key.clone(),
                            (
                                answered.saturating_sub(*a0) as f64 / dt,
                                flows.saturating_sub(*f0) as f64 / dt,
                            ),
                        );
                    }
                }
                self.previous.insert(key, (answered, flows, st.uptime_s));
            }
        }
        self.service = self.service.min(st.services.len().saturating_sub(1));
        let n = st
            .services
            .get(self.service)
            .map_or(0, |s| s.backends.len());
        self.selected = self.selected.min(n.saturating_sub(1));
        self.status = Some(st);
        self.error = None;
    }

    fn selected_backend(&self) -> Option<(&str, &BackendStatus)> {
        let s = self.status.as_ref()?.services.get(self.service)?;
        Some((s.name.as_str(), s.backends.get(self.selected)?))
    }
}

fn sparkline(h: Option<&VecDeque<f64>>) -> String {
    let Some(h) = h else {
        return String::new();
    };
    h.iter()
        .map(|t| BARS[((t.clamp(0.0, 1.0) * 7.0).round() as usize).min(7)])
        .collect()
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1}"))
}

/// Draws the view: the header, the service's backends, the selected
/// backend's detail, recent rotations and the keys.
pub fn draw(f: &mut Frame, m: &Model) {
    let [head, table, detail, events, keys] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(4),
        Constraint::Length(1),
        Constraint::Length(6),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let Some(st) = &m.status else {
        f.render_widget(
            Paragraph::new(m.error.clone().unwrap_or_else(|| "connecting...".into())),
            head,
        );
        return;
    };
    let Some(svc) = st.services.get(m.service) else {
        f.render_widget(Paragraph::new("no services"), head);
        return;
    };
    f.render_widget(header(m, st, svc), head);
    f.render_widget(backends(m, svc), table);
    if let Some(b) = svc.backends.get(m.selected) {
        f.render_widget(Paragraph::new(detail_line(b)), detail);
    }
    f.render_widget(
        Paragraph::new(rotations(svc)).block(Block::bordered().title("rotations")),
        events,
    );
    let help = m
        .message
        .clone()
        .unwrap_or_else(|| "up/down select  d drain  u undrain  tab service  q quit".into());
    f.render_widget(Paragraph::new(help), keys);
}

/// The balancer, its connection and the service shown.
fn header<'a>(m: &Model, st: &Status, svc: &ServiceStatus) -> Paragraph<'a> {
    let state = match &m.error {
        Some(e) => Span::styled(
            format!(" reconnecting: {e}"),
            Style::default().fg(Color::Yellow),
        ),
        None => Span::raw(""),
    };
    Paragraph::new(vec![
        Line::from(vec![
            Span::styled(
                format!("huddle on {} ({}) ", st.interface, st.xdp_mode),
                Style::default().add_modifier(Modifier::BOLD),
            ),
            Span::raw(format!("up {:.0}s  tick {} ms", st.uptime_s, st.tick_ms)),
            state,
        ]),
        Line::from(format!(
            "service {}/{} {}  ring gen {}  inner {}{}",
            m.service + 1,
            st.services.len(),
            svc.name,
            svc.ring_generation,
            svc.ring.len(),
            if svc.panic { "  PANIC" } else { "" }
        )),
    ])
}

/// A temperature term in two columns: ".3", "1.".
fn term(v: f64) -> String {
    let tenths = (v.clamp(0.0, 1.0) * 10.0).round() as u32;
    if tenths >= 10 {
        "1.".to_string()
    } else {
        format!(".{tenths}")
    }
}

/// The service's backends, one row each, the selected one reversed.
fn backends<'a>(m: &Model, svc: &ServiceStatus) -> Table<'a> {
    let rows: Vec<Row> = svc
        .backends
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let row = backend_row(m, &svc.name, b);
            if i == m.selected {
                row.style(Style::default().add_modifier(Modifier::REVERSED))
            } else {
                row
            }
        })
        .collect();
    let header = Row::new(vec![
        "backend",
        "ring",
        "temp",
        "1 minute",
        "an cp me er ld",
        "p50/p99ms",
        "req/s",
        "new/s",
        "act",
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    Table::new(
        rows,
        [
            Constraint::Length(16),
            Constraint::Length(5),
            Constraint::Length(4),
            Constraint::Length(SPARK as u16),
            Constraint::Length(14),
            Constraint::Length(9),
            Constraint::Length(5),
            Constraint::Length(5),
            Constraint::Length(4),
        ],
    )
    .header(header)
    .column_spacing(1)
}

/// One backend's row: place, temperature and its history, the terms,
/// latency, rates and flows.
fn backend_row<'a>(m: &Model, service: &str, b: &BackendStatus) -> Row<'a> {
    let key = (service.to_string(), b.addr.clone());
    let (rps, nfs) = m.rates.get(&key).copied().unwrap_or((0.0, 0.0));
    let c = &b.components;
    let ring_style = match (b.place.as_str(), b.unhealthy.is_some()) {
        (_, true) => Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
        ("inner", _) => Style::default().fg(Color::Green),
        ("outer", _) => Style::default().fg(Color::Yellow),
        _ => Style::default().fg(Color::DarkGray),
    };
    Row::new(vec![
        Cell::from(b.addr.clone()),
        Cell::from(b.place.clone()).style(ring_style),
        Cell::from(format!("{:.2}", b.temperature)),
        Cell::from(sparkline(m.history.get(&key))),
        Cell::from(format!(
            "{:>2} {:>2} {:>2} {:>2} {:>2}",
            term(c.anomaly),
            term(c.cpu),
            term(c.memory),
            term(c.errors),
            term(c.load)
        )),
        Cell::from(format!("{}/{}", ms(b.p50_ms), ms(b.p99_ms))),
        Cell::from(format!("{rps:.0}")),
        Cell::from(format!("{nfs:.0}")),
        Cell::from(b.active_flows.to_string()),
    ])
}

/// The selected backend's health, last move and probe, in full.
fn detail_line(b: &BackendStatus) -> String {
    let health = match (&b.unhealthy, &b.last_reason) {
        (Some(u), _) => format!("UNHEALTHY: {u}"),
        (None, Some(r)) => format!("{r}, {:.0}s ago", b.last_move_s_ago.unwrap_or(0.0)),
        (None, None) => "healthy, never moved".into(),
    };
    let rest = match b.rest_left_s {
        Some(r) if r > 0.0 => format!("; rests {r:.0}s more"),
        Some(_) => "; may return once cool".into(),
        None => String::new(),
    };
    format!(
        "{}: {health}{rest}; probe {} ms{}",
        b.addr,
        ms(b.probe_ms),
        if b.drained { "; drained" } else { "" }
    )
}

/// The service's last five rotations, newest first.
fn rotations<'a>(svc: &ServiceStatus) -> Vec<Line<'a>> {
    svc.recent
        .iter()
        .rev()
        .take(5)
        .map(|e| {
            Line::from(format!(
                "{:>7.1}s {} -> {} ({}), {:.2}",
                e.at_s,
                e.backend,
                e.to.as_str(),
                e.reason,
                e.temperature
            ))
        })
        .collect()
}

/// Runs the view until `q` (or Ctrl-C) on the terminal.
pub fn run(socket: &Path) -> Result<()> {
    let mut term = ratatui::init();
    let result = (|| -> Result<()> {
        let mut m = Model::default();
        let mut every = Duration::from_millis(250);
        loop {
            match call(socket, &Request::Status) {
                Ok(r) if r.ok => {
                    if let Some(st) = r.status {
                        every = Duration::from_secs_f64((st.tick_ms / 1e3).clamp(0.1, 2.0));
                        m.update(st);
                    }
                }
                Ok(r) => m.error = Some(r.error.unwrap_or_default()),
                Err(e) => m.error = Some(format!("{e:#}")),
            }
            term.draw(|f| draw(f, &m))?;
            let until = Instant::now() + every;
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                if !event::poll(left)? {
                    break;
                }
                let Event::Key(k) = event::read()? else {
                    continue;
                };
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                m.message = None;
                let services = m.status.as_ref().map_or(0, |s| s.services.len());
                let backends = m
                    .status
                    .as_ref()
                    .and_then(|s| s.services.get(m.service))
                    .map_or(0, |s| s.backends.len());
                match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Char('c') if k.modifiers.contains(event::KeyModifiers::CONTROL) => {
                        return Ok(());
                    }
                    KeyCode::Up => m.selected = m.selected.saturating_sub(1),
                    KeyCode::Down => {
                        m.selected = (m.selected + 1).min(backends.saturating_sub(1));
                    }
                    KeyCode::Tab => {
                        m.service = (m.service + 1) % services.max(1);
                        m.selected = 0;
                    }
                    KeyCode::Char(c @ ('d' | 'u')) => {
                        if let Some((vip, b)) = m.selected_backend() {
                            let (backend, vip) = (b.addr.clone(), Some(vip.to_string()));
                            let req = if c == 'd' {
                                Request::Drain { backend, vip }
                            } else {
                                Request::Undrain { backend, vip }
                            };
                            m.message = Some(match call(socket, &req) {
                                Ok(r) if r.ok => r.message.unwrap_or_default(),
                                Ok(r) => r.error.unwrap_or_default(),
                                Err(e) => format!("{e:#}"),
                            });
                        }
                    }
                    _ => {}
                }
                term.draw(|f| draw(f, &m))?;
            }
        }
    })();
    ratatui::restore();
    result
}
