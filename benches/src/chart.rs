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
            if let Some(d) = &l.read_direct_gbps {
                limits.push(("disk, O_DIRECT".to_owned(), d.median));
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
            bars.push((
                "warm read: one read() loop".into(),
                r.warm_single_read_gbps.median,
                Kind::Peer,
            ));
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
        let max = bars
            .iter()
            .map(|b| b.1)
            .chain(limits.iter().map(|l| l.1))
            .filter(|v| v.is_finite())
            .fold(1.0f64, f64::max);
        let (label_w, plot_w, row_h, top) = (330.0, 520.0, 20.0, 40.0 + 14.0 * limits.len() as f64);
        let height = top + row_h * bars.len() as f64 + 40.0;
        let x = |v: f64| label_w + v / max * plot_w;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="12">"#,
            w = label_w + plot_w + 80.0
        );
        let _ = writeln!(
            s,
            r#"<text x="10" y="18" font-size="14" font-weight="bold">gpufeed bench: GB/s per path (blue: gpufeed, orange: peers and baselines, dashed: this machine's limits)</text>"#
        );
        for (i, (name, v)) in limits.iter().enumerate() {
            let lx = x(*v);
            let _ = writeln!(
                s,
                r##"<line x1="{lx:.1}" y1="{y0:.1}" x2="{lx:.1}" y2="{y1:.1}" stroke="#555" stroke-dasharray="4,3"/><text x="{tx:.1}" y="{ty:.1}" fill="#555">{} {v:.1}</text>"##,
                esc(name),
                y0 = 30.0 + 14.0 * i as f64,
                y1 = height - 30.0,
                tx = lx + 3.0,
                ty = 40.0 + 14.0 * i as f64
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
                r#"<text x="{lx:.1}" y="{ty:.1}" text-anchor="end">{}</text><rect x="{label_w}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{color}"/><text x="{vx:.1}" y="{ty:.1}">{v:.2}</text>"#,
                esc(name),
                lx = label_w - 6.0,
                ty = y + row_h * 0.7,
                h = row_h * 0.75,
                vx = label_w + w + 4.0
            );
        }
        let _ = writeln!(s, "</svg>");
        s
    }
}
