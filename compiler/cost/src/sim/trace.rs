//! Timeline renderers: Chrome trace-event JSON (opens in Perfetto and `chrome://tracing`) and a
//! self-contained SVG with one row per device.
//!
//! Both return strings built deterministically from the spans (same report, same bytes); they
//! must not write files — the CLI does.

use std::fmt::Write as _;

use serde::Serialize;

use crate::sim::engine::{SimReport, Span};

#[derive(Serialize)]
struct TraceEvent<'a> {
    name: &'a str,
    cat: &'a str,
    ph: &'static str,
    /// Microseconds, as the format wants.
    ts: f64,
    dur: f64,
    pid: u32,
    tid: usize,
    args: TraceArgs<'a>,
}

#[derive(Serialize)]
struct TraceArgs<'a> {
    task: &'a str,
    iteration: u32,
}

#[derive(Serialize)]
struct ThreadName {
    name: &'static str,
    ph: &'static str,
    pid: u32,
    tid: usize,
    args: NameArg,
}

#[derive(Serialize)]
struct NameArg {
    name: String,
}

#[derive(Serialize)]
#[serde(untagged)]
enum AnyEvent<'a> {
    Span(TraceEvent<'a>),
    Meta(ThreadName),
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Trace<'a> {
    trace_events: Vec<AnyEvent<'a>>,
    display_time_unit: &'static str,
}

/// Sorted copy of the spans: by device, then start, then task — the order renderers use.
fn sorted_spans(timeline: &[Span]) -> Vec<&Span> {
    let mut spans: Vec<&Span> = timeline.iter().collect();
    spans.sort_by(|a, b| {
        a.device
            .cmp(&b.device)
            .then(a.start.total_cmp(&b.start))
            .then(a.task.cmp(&b.task))
    });
    spans
}

/// The timeline as Chrome trace-event JSON: one thread per device, one complete event ("X")
/// per span, named by its label and categorised by stage.
pub fn to_chrome_trace(report: &SimReport, devices: usize) -> String {
    spans_to_chrome_trace(&report.timeline, devices)
}

/// [`to_chrome_trace`] of any spans (a measured timeline too).
pub fn spans_to_chrome_trace(timeline: &[Span], devices: usize) -> String {
    let mut events: Vec<AnyEvent<'_>> = (0..devices)
        .map(|d| {
            AnyEvent::Meta(ThreadName {
                name: "thread_name",
                ph: "M",
                pid: 0,
                tid: d,
                args: NameArg {
                    name: format!("device {d}"),
                },
            })
        })
        .collect();
    for s in sorted_spans(timeline) {
        events.push(AnyEvent::Span(TraceEvent {
            name: &s.label,
            cat: &s.stage,
            ph: "X",
            ts: s.start * 1e6,
            dur: (s.end - s.start) * 1e6,
            pid: 0,
            tid: s.device,
            args: TraceArgs {
                task: &s.task,
                iteration: s.iteration,
            },
        }));
    }
    let trace = Trace {
        trace_events: events,
        display_time_unit: "ms",
    };
    // Serialising plain structs of strings and finite numbers cannot fail.
    serde_json::to_string(&trace).unwrap_or_default()
}

/// A colour per stage, from a fixed palette in order of first appearance.
fn palette(i: usize) -> &'static str {
    const COLOURS: [&str; 8] = [
        "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f",
    ];
    COLOURS[i % COLOURS.len()]
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The timeline as an SVG: a row per device, a rectangle per span coloured by stage (with its
/// label as a tooltip), a time axis in seconds and a legend.
pub fn to_svg(report: &SimReport, devices: usize) -> String {
    spans_to_svg(&report.timeline, devices, report.total_time)
}

/// [`to_svg`] of any spans over `total` seconds (a measured timeline too).
pub fn spans_to_svg(timeline: &[Span], devices: usize, total: f64) -> String {
    let width = 1200.0;
    let left = 80.0;
    let row = 18.0;
    let top = 30.0;
    let plot = width - left - 20.0;
    let total = total.max(1e-12);
    let mut stages: Vec<&str> = Vec::new();
    for s in timeline {
        if !stages.contains(&s.stage.as_str()) {
            stages.push(&s.stage);
        }
    }
    let height = top + row * devices as f64 + 60.0;
    let mut out = String::new();
    // `write!` into a String cannot fail.
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    for d in 0..devices {
        let y = top + row * d as f64;
        let _ = writeln!(
            out,
            r#"<text x="4" y="{:.1}">device {d}</text>"#,
            y + row * 0.7
        );
    }
    for s in sorted_spans(timeline) {
        let x = left + plot * s.start / total;
        let w = (plot * (s.end - s.start) / total).max(0.5);
        let y = top + row * s.device as f64 + 1.0;
        let colour = palette(stages.iter().position(|&n| n == s.stage).unwrap_or(0));
        let _ = writeln!(
            out,
            r#"<rect x="{x:.2}" y="{y:.1}" width="{w:.2}" height="{:.1}" fill="{colour}"><title>{} [{}] {:.4}s–{:.4}s</title></rect>"#,
            row - 2.0,
            escape(&s.label),
            escape(&s.task),
            s.start,
            s.end
        );
    }
    let axis_y = top + row * devices as f64 + 14.0;
    for k in 0..=10 {
        let t = total * k as f64 / 10.0;
        let x = left + plot * k as f64 / 10.0;
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{axis_y:.1}" text-anchor="middle">{t:.3}s</text>"#
        );
    }
    for (i, s) in stages.iter().enumerate() {
        let x = left + 120.0 * i as f64;
        let y = axis_y + 20.0;
        let _ = writeln!(
            out,
            r#"<rect x="{x:.1}" y="{:.1}" width="10" height="10" fill="{}"/><text x="{:.1}" y="{y:.1}">{}</text>"#,
            y - 9.0,
            palette(i),
            x + 14.0,
            escape(s)
        );
    }
    out.push_str("</svg>\n");
    out
}
