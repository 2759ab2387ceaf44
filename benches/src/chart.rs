//! report.svg: a bar chart of GB/s per path, the machine's limits as lines, peers and
//! baselines in another colour.

use std::fmt::Write as _;

use crate::report::Report;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Gpufeed,
    Peer,
}

/// A bar (label, GB/s, whose) and a limit line (label, GB/s).
type Bar = (String, f64, Kind);
type Limit = (String, f64);

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl Report {
    fn bars(&self) -> (Vec<Bar>, Vec<Limit>) {
        let (mut bars, mut limits) = (Vec::new(), Vec::new());
        if let Some(l) = &self.limits {
            limits.push(("memcpy, 1 thread".to_owned(), l.memcpy_1_thread_gbps.median));
            if let Some(d) = l.disk_limit() {
                limits.push(("the disk".to_owned(), d.gbps.median));
            }
        }
        if let Some(h) = &self.handoff {
            for row in h {
                let kind = if row.mode.contains("gpufeed") {
                    Kind::Gpufeed
                } else {
                    Kind::Peer
                };
                bars.push((format!("handoff: {}", row.mode), row.gbps.median, kind));
            }
        }
        if let Some(r) = &self.reads {
            if let Some(row) = r.direct.iter().find(|d| d.queue_depth == 8) {
                bars.push((
                    "O_DIRECT read qd 8: gpufeed-uring".into(),
                    row.uring_gbps.median,
                    Kind::Gpufeed,
                ));
                if let Some(f) = &row.fio_gbps {
                    bars.push(("O_DIRECT read qd 8: fio".into(), f.median, Kind::Peer));
                }
            }
            bars.push((
                "warm read: gpufeed-uring io_uring".into(),
                r.warm_uring_gbps.median,
                Kind::Gpufeed,
            ));
            bars.push((
                "warm read: gpufeed-uring threads".into(),
                r.warm_threads_gbps.median,
                Kind::Gpufeed,
            ));
            if let Some(l) = &self.limits {
                bars.push((
                    "warm read: one read() loop".into(),
                    l.read_warm_gbps.median,
                    Kind::Peer,
                ));
            }
        }
        if let Some(i) = &self.ipc {
            bars.push((
                "1 MiB batches: gpufeed-ipc BatchRing".into(),
                i.ring_gbps.median,
                Kind::Gpufeed,
            ));
            bars.push((
                "1 MiB batches: Unix socket".into(),
                i.socket_gbps.median,
                Kind::Peer,
            ));
        }
        if let Some(b) = &self.batch_loader {
            bars.push((
                "host batches: BatchLoader".into(),
                b.host_gbps.median,
                Kind::Gpufeed,
            ));
        }
        if let Some(g) = &self.gpu {
            limits.push(("PCIe, pinned 16 MiB".to_owned(), g.pinned_limit_gbps.median));
            bars.push((
                "GPU: scheduler from pinned".into(),
                g.sched_pinned_gbps.median,
                Kind::Gpufeed,
            ));
            bars.push((
                "GPU: scheduler from pageable (staged)".into(),
                g.sched_pageable_gbps.median,
                Kind::Gpufeed,
            ));
            bars.push((
                "GPU: naive cuMemcpyHtoD from pageable".into(),
                g.naive_pageable_gbps.median,
                Kind::Peer,
            ));
            let f = &g.facade;
            bars.push((
                "GPU: load_file warm, default".into(),
                f.warm_default_gbps.median,
                Kind::Gpufeed,
            ));
            bars.push((
                "GPU: load_file warm, one IO thread".into(),
                f.warm_one_thread_gbps.median,
                Kind::Gpufeed,
            ));
            bars.push((
                "GPU: safetensors::load warm".into(),
                f.safetensors_gbps.median,
                Kind::Gpufeed,
            ));
            bars.push((
                "GPU: batch loader".into(),
                f.batch_loader_gbps.median,
                Kind::Gpufeed,
            ));
            bars.push((
                "GPU: load_file cold".into(),
                f.cold_default_gbps.median,
                Kind::Gpufeed,
            ));
            if let Some(peers) = g.peers.as_ref().and_then(|p| p.as_object()) {
                for (name, v) in peers {
                    if let Some(runs) = v.as_array() {
                        let vals: Vec<f64> = runs.iter().filter_map(|x| x.as_f64()).collect();
                        let median = crate::util::Samples::new(vals).median;
                        if median.is_finite() {
                            bars.push((format!("GPU peer: {name}"), median, Kind::Peer));
                        }
                    }
                }
            }
        }
        (bars, limits)
    }

    /// The chart as an SVG document.
    pub fn svg(&self) -> String {
        let (bars, limits) = self.bars();
        chart(&bars, &limits)
    }
}

/// Title and legend of the chart.
const TITLE: &str = "gpufeed bench: GB/s per path";
const LEGEND: &str =
    "blue: gpufeed; orange: peers and baselines; dashed lines: this machine's limits (same run)";

/// The width in pixels of `text` in a sans-serif font of `px` pixels, from above: each
/// character's advance in DejaVu Sans (what librsvg and browsers pick for `sans-serif` on
/// Linux), rounded up by class. The chart sizes its columns and canvas with it, and the
/// rendering test checks that nothing was cut.
fn text_width(text: &str, px: f64) -> f64 {
    let em: f64 = text
        .chars()
        .map(|c| match c {
            ' ' | '.' | ',' | ':' | ';' | '\'' | '|' | '!' | 'i' | 'l' | 'j' => 0.36,
            '(' | ')' | '[' | ']' | 'f' | 't' | 'r' | 'I' | '-' | '/' => 0.45,
            'm' | 'W' | '%' | '@' => 1.0,
            'w' | 'M' | '+' | '=' | '<' | '>' | '~' => 0.9,
            c if c.is_ascii_uppercase() => 0.8,
            c if c.is_ascii() => 0.64,
            _ => 1.0,
        })
        .sum();
    em * px
}

/// A horizontal bar chart: one bar per path (label left of it, value right of it) and the
/// limits as dashed vertical lines, each labelled at the top. Every column is as wide as its
/// widest text, so no label runs past the canvas.
fn chart(bars: &[Bar], limits: &[Limit]) -> String {
    const FONT: f64 = 12.0;
    let max = bars
        .iter()
        .map(|b| b.1)
        .chain(limits.iter().map(|l| l.1))
        .filter(|v| v.is_finite())
        .fold(1.0f64, f64::max);
    let value = |v: f64| format!("{v:.2}");
    let label_w = bars
        .iter()
        .map(|b| text_width(&b.0, FONT))
        .fold(120.0f64, f64::max)
        + 16.0;
    let plot_w = 520.0;
    let value_w = bars
        .iter()
        .map(|b| text_width(&value(b.1), FONT))
        .fold(0.0f64, f64::max)
        + 12.0;
    let (row_h, top) = (20.0, 56.0 + 14.0 * limits.len() as f64);
    let height = top + row_h * bars.len() as f64 + 20.0;
    let x = |v: f64| label_w + v / max * plot_w;
    // A limit's label goes right of its line, or left of it where it would leave the plot.
    let limit_text = |(name, v): &Limit| format!("{} {v:.1}", name);
    let right_edge = label_w + plot_w + value_w;
    let width = [
        right_edge,
        10.0 + text_width(TITLE, 14.0) * 1.1, // bold
        10.0 + text_width(LEGEND, FONT),
    ]
    .into_iter()
    .fold(0.0f64, f64::max)
    .ceil()
        + 10.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="{FONT}">"#,
    );
    let _ = writeln!(
        s,
        r##"<text x="10" y="18" font-size="14" font-weight="bold">{}</text><text x="10" y="36" fill="#333">{}</text>"##,
        esc(TITLE),
        esc(LEGEND)
    );
    for (i, limit) in limits.iter().enumerate() {
        let lx = x(limit.1);
        let text = limit_text(limit);
        let (tx, anchor) = if lx + 3.0 + text_width(&text, FONT) <= width - 4.0 {
            (lx + 3.0, "start")
        } else {
            (lx - 3.0, "end")
        };
        let _ = writeln!(
            s,
            r##"<line x1="{lx:.1}" y1="{y0:.1}" x2="{lx:.1}" y2="{y1:.1}" stroke="#555" stroke-dasharray="4,3"/><text x="{tx:.1}" y="{ty:.1}" text-anchor="{anchor}" fill="#555">{}</text>"##,
            esc(&text),
            y0 = 46.0 + 14.0 * i as f64,
            y1 = height - 10.0,
            ty = 56.0 + 14.0 * i as f64
        );
    }
    for (i, (name, v, kind)) in bars.iter().enumerate() {
        let y = top + row_h * i as f64;
        let color = if *kind == Kind::Gpufeed {
            "#2b6cb0"
        } else {
            "#dd6b20"
        };
        let w = if v.is_finite() { x(*v) - label_w } else { 0.0 };
        let _ = writeln!(
            s,
            r#"<text x="{lx:.1}" y="{ty:.1}" text-anchor="end">{}</text><rect x="{label_w:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{color}"/><text x="{vx:.1}" y="{ty:.1}">{}</text>"#,
            esc(name),
            value(*v),
            lx = label_w - 6.0,
            ty = y + row_h * 0.7,
            h = row_h * 0.75,
            vx = label_w + w + 4.0
        );
    }
    let _ = writeln!(s, "</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bars and limits as wide as a GPU run makes them: the longest labels, a bar at the top
    /// of the scale, limits at both ends (the rightmost label must turn left).
    fn widest() -> (Vec<Bar>, Vec<Limit>) {
        let bars = [
            "handoff: traditional file IO (write + read)",
            "handoff: shared memory (gpufeed-os ShmSegment)",
            "O_DIRECT read qd 8: gpufeed-uring",
            "warm read: gpufeed-uring threads",
            "1 MiB batches: gpufeed-ipc BatchRing",
            "GPU: scheduler from pageable (staged)",
            "GPU: naive cuMemcpyHtoD from pageable",
            "GPU: load_file warm, one IO thread",
            "GPU peer: fastsafetensors (16 threads, GDS off)",
            "GPU peer: torch DataLoader (8 workers, pinned)",
            "WWWWWWWWWWWWWWWWWWWWWWWWWWWWWW",
        ]
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let kind = if i % 2 == 0 {
                Kind::Gpufeed
            } else {
                Kind::Peer
            };
            (l.to_string(), [55.43, 0.31, 12.0][i % 3], kind)
        })
        .collect();
        let limits = vec![
            ("memcpy, 1 thread".to_owned(), 27.5),
            ("disk, O_DIRECT".to_owned(), 0.8),
            ("PCIe, pinned 16 MiB".to_owned(), 55.43),
        ];
        (bars, limits)
    }

    /// The chart rendered by librsvg (`rsvg-convert`) inside a margin of white: any ink in the
    /// margin is text or a shape that runs past the canvas. Skipped with the reason where
    /// rsvg-convert is not installed, unless `GPUFEED_REQUIRE_RSVG=1` (CI installs it).
    #[test]
    fn every_label_fits_the_canvas() {
        let (bars, limits) = widest();
        let svg = chart(&bars, &limits);
        match ink_outside(&svg) {
            Ok(None) => {}
            Ok(Some(at)) => panic!("ink outside the canvas at {at:?}:\n{svg}"),
            Err(why) => skip_without_rsvg("every_label_fits_the_canvas", &why),
        }
    }

    /// The chart the docs show (docs/bench-h200.svg, a GPU run's report.svg).
    #[test]
    fn the_docs_chart_fits_its_canvas() {
        let svg = include_str!("../../docs/bench-h200.svg");
        match ink_outside(svg) {
            Ok(None) => {}
            Ok(Some(at)) => panic!("docs/bench-h200.svg: ink outside the canvas at {at:?}"),
            Err(why) => skip_without_rsvg("the_docs_chart_fits_its_canvas", &why),
        }
    }

    #[test]
    fn a_label_past_the_canvas_is_caught() {
        let svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"100\" height=\"40\" font-family=\"sans-serif\" font-size=\"12\">\n<text x=\"10\" y=\"20\">a label far too long for this canvas</text>\n</svg>\n";
        match ink_outside(svg) {
            Ok(found) => assert!(found.is_some(), "a 100 px canvas cannot hold the label"),
            Err(why) => skip_without_rsvg("a_label_past_the_canvas_is_caught", &why),
        }
    }

    /// Skips `test` with `why` printed past libtest's capture, or fails it where CI asks for
    /// the rendering (`GPUFEED_REQUIRE_RSVG=1`).
    fn skip_without_rsvg(test: &str, why: &str) {
        assert!(
            !std::env::var("GPUFEED_REQUIRE_RSVG").is_ok_and(|v| v == "1"),
            "{test}: GPUFEED_REQUIRE_RSVG=1 but the chart could not be rendered: {why}"
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP {test}: {why} (apt-get install librsvg2-bin)"
        );
    }

    /// Renders `svg` (whose first line is its root element, last `</svg>`) shifted into a
    /// white margin of `M` pixels and returns the first non-white pixel in the margin, if any.
    /// Errs where it cannot render, or where the canvas shows no ink at all (no fonts: a test
    /// of nothing).
    fn ink_outside(svg: &str) -> Result<Option<(i64, i64)>, String> {
        const M: f64 = 200.0;
        let attr = |name: &str| -> Result<f64, String> {
            let key = format!(" {name}=\"");
            let at = svg.find(&key).ok_or(format!("no {name}"))? + key.len();
            svg[at..]
                .split('"')
                .next()
                .and_then(|v| v.parse().ok())
                .ok_or(format!("bad {name}"))
        };
        let (w, h) = (attr("width")?, attr("height")?);
        let mut lines: Vec<&str> = svg.lines().collect();
        let root = lines.remove(0);
        lines.pop();
        let font = root
            .split_once(" font-family")
            .map_or("", |(_, rest)| rest.trim_end_matches('>'));
        let wrapped = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family{font}><g transform=\"translate({M},{M})\">{}</g></svg>",
            w + 2.0 * M,
            h + 2.0 * M,
            lines.join("\n")
        );
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let (src, png) = (dir.path().join("c.svg"), dir.path().join("c.png"));
        std::fs::write(&src, wrapped).map_err(|e| e.to_string())?;
        let out = std::process::Command::new("rsvg-convert")
            .args(["-b", "white", "-o"])
            .arg(&png)
            .arg(&src)
            .output()
            .map_err(|e| format!("rsvg-convert: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "rsvg-convert failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let decoder = png::Decoder::new(std::io::BufReader::new(
            std::fs::File::open(&png).map_err(|e| e.to_string())?,
        ));
        let mut reader = decoder.read_info().map_err(|e| e.to_string())?;
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).map_err(|e| e.to_string())?;
        let channels = info.color_type.samples();
        let (iw, ih) = (info.width, info.height);
        let inked = |x: u32, y: u32| {
            let at = (y as usize * iw as usize + x as usize) * channels;
            buf[at..at + 3.min(channels)].iter().any(|&c| c < 200)
        };
        let inside = |x: u32, y: u32| {
            (x as f64) >= M && (x as f64) < M + w && (y as f64) >= M && (y as f64) < M + h
        };
        let mut ink_in = 0usize;
        for y in 0..ih {
            for x in 0..iw {
                if inked(x, y) {
                    if !inside(x, y) {
                        return Ok(Some((i64::from(x) - M as i64, i64::from(y) - M as i64)));
                    }
                    ink_in += 1;
                }
            }
        }
        if ink_in < 100 {
            return Err(format!(
                "the chart rendered with {ink_in} dark pixels: no fonts?"
            ));
        }
        Ok(None)
    }
}
