//! The SVG chart: stacked panels of time series (one point per second), so
//! a stall or a latency tail is visible at a glance. Plain SVG text: no
//! plotting dependency to build.

use std::fmt::Write;

/// One line of a panel.
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub points: Vec<(f64, f64)>,
}

/// One panel: a title, a y-axis unit and its lines.
pub struct Panel {
    pub title: String,
    pub unit: String,
    pub series: Vec<Series>,
}

const WIDTH: f64 = 900.0;
const PANEL_HEIGHT: f64 = 230.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 35.0;

fn nice_max(max: f64) -> f64 {
    if max <= 0.0 {
        return 1.0;
    }
    let magnitude = 10_f64.powf(max.log10().floor());
    for step in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if step * magnitude >= max {
            return step * magnitude;
        }
    }
    10.0 * magnitude
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

pub fn render(title: &str, panels: &[Panel]) -> String {
    let height = 40.0 + PANEL_HEIGHT * panels.len() as f64;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    for (i, panel) in panels.iter().enumerate() {
        let y0 = 40.0 + PANEL_HEIGHT * i as f64;
        let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, PANEL_HEIGHT - TOP - BOTTOM);
        let all = panel.series.iter().flat_map(|s| s.points.iter());
        let x_max = nice_max(all.clone().map(|p| p.0).fold(0.0, f64::max));
        let y_max = nice_max(all.map(|p| p.1).fold(0.0, f64::max));
        let (px, py) = (LEFT, y0 + TOP);
        let _ = writeln!(
            svg,
            r#"<text x="{LEFT}" y="{}" font-size="13">{}</text>"#,
            y0 + 18.0,
            escape(&panel.title)
        );
        let _ = writeln!(
            svg,
            r##"<rect x="{px}" y="{py}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>"##
        );
        for t in 0..=4 {
            let f = f64::from(t) / 4.0;
            let y = py + plot_h - f * plot_h;
            let x = px + f * plot_w;
            let _ = writeln!(
                svg,
                r##"<line x1="{px}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" text-anchor="end">{} {}</text>"##,
                px + plot_w,
                px - 4.0,
                y + 4.0,
                trim(f * y_max),
                escape(&panel.unit)
            );
            let _ = writeln!(
                svg,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{} s</text>"#,
                py + plot_h + 15.0,
                trim(f * x_max)
            );
        }
        for (k, series) in panel.series.iter().enumerate() {
            let points: Vec<String> = series
                .points
                .iter()
                .map(|(x, y)| {
                    format!(
                        "{:.1},{:.1}",
                        px + x / x_max * plot_w,
                        py + plot_h - y / y_max * plot_h
                    )
                })
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                series.color,
                points.join(" ")
            );
            let lx = px + plot_w - 230.0;
            let ly = py + 14.0 + 15.0 * k as f64;
            let _ = writeln!(
                svg,
                r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="3"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
                ly - 4.0,
                lx + 20.0,
                ly - 4.0,
                series.color,
                lx + 26.0,
                escape(&series.name)
            );
        }
    }
    svg.push_str("</svg>\n");
    svg
}

fn trim(value: f64) -> String {
    if value >= 100.0 || value == value.round() {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}
