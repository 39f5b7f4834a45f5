//! The end-of-run picture: loss, learning rate, gradient norm and tokens/s against the step.

use crate::event::{Event, EventKind};
use crate::metrics::StepMetrics;
use crate::sink::MetricSink;
use crate::{MonitorError, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The family name the embedded font is registered under.
pub(crate) const FONT: &str = "sans-serif";

pub(crate) fn register_font() -> std::result::Result<(), String> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::HACK_REGULAR)
            .map_err(|_| "the embedded Hack font could not be parsed".to_string())
    })
    .clone()
}

/// One plotted metric: the points of the final trajectory, and the points a rollback replaced.
#[derive(Debug, Clone, Default)]
struct Series {
    kept: Vec<(f64, f64)>,
    dropped: Vec<(f64, f64)>,
}

impl Series {
    fn push(&mut self, step: u64, v: Option<f64>) {
        let x = step as f64;
        // a replayed step (after a rollback) replaces what the old timeline had from there on
        if self.kept.last().is_some_and(|&(lx, _)| lx >= x) {
            let cut = self.kept.partition_point(|&(px, _)| px < x);
            self.dropped.extend(self.kept.drain(cut..));
        }
        if let Some(v) = v.filter(|v| v.is_finite()) {
            self.kept.push((x, v));
        }
    }

    fn bounds(&self) -> Option<(f64, f64, f64, f64)> {
        let mut it = self.kept.iter().chain(&self.dropped);
        let &(x, y) = it.next()?;
        let (mut x0, mut x1, mut y0, mut y1) = (x, x, y, y);
        for &(x, y) in it {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        Some((x0, x1, y0, y1))
    }
}

/// Keeps loss, learning rate, gradient norm and tokens/s of every record and draws them into
/// a PNG of four panels when closed; a noisy series (loss, gradient norm, tokens/s) of 200
/// points or more is drawn faint with a moving average (over 1% of the points) on top. Steps replayed after a rollback replace the old ones;
/// the replaced points are drawn in grey, and rollbacks, skipped batches and halts as red
/// vertical lines on the loss panel.
///
/// Text uses an embedded font (Hack), so no system font library is needed.
#[derive(Debug)]
pub struct PlotSink {
    path: PathBuf,
    size: (u32, u32),
    loss: Series,
    lr: Series,
    grad_norm: Series,
    tokens_per_s: Series,
    marks: Vec<(u64, EventKind)>,
    closed: bool,
}

impl PlotSink {
    /// A 1600 x 1000 plot written to `path` at close.
    pub fn new(path: impl AsRef<Path>) -> Self {
        Self::with_size(path, 1600, 1000)
    }

    /// A plot of the given size in pixels.
    pub fn with_size(path: impl AsRef<Path>, width: u32, height: u32) -> Self {
        PlotSink {
            path: path.as_ref().to_path_buf(),
            size: (width.max(200), height.max(150)),
            loss: Series::default(),
            lr: Series::default(),
            grad_norm: Series::default(),
            tokens_per_s: Series::default(),
            marks: Vec::new(),
            closed: false,
        }
    }

    /// The PNG written at close.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Width and height in pixels.
    pub fn size(&self) -> (u32, u32) {
        self.size
    }

    /// Number of records kept for the loss panel.
    pub fn len(&self) -> usize {
        self.loss.kept.len()
    }

    /// True before any record with a loss.
    pub fn is_empty(&self) -> bool {
        self.loss.kept.is_empty()
    }

    /// Draws into an RGB buffer of `width * height * 3` bytes (what [`PlotSink::close`] encodes
    /// as PNG).
    pub fn render_rgb(&self, buf: &mut [u8]) -> Result<()> {
        let (w, h) = self.size;
        if buf.len() != (w * h * 3) as usize {
            return Err(MonitorError::Plot {
                path: self.path.clone(),
                message: format!("buffer holds {} bytes, expected {}", buf.len(), w * h * 3),
            });
        }
        let root = BitMapBackend::with_buffer(buf, self.size).into_drawing_area();
        self.draw(&root)
    }

    fn plot_err(&self, e: impl std::fmt::Display) -> MonitorError {
        MonitorError::Plot {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        register_font().map_err(|e| self.plot_err(e))?;
        root.fill(&WHITE).map_err(|e| self.plot_err(e))?;
        let panels = root.split_evenly((2, 2));
        // (title, series, colour, event marks, moving average)
        let spec: [(&str, &Series, RGBColor, bool, bool); 4] = [
            ("loss", &self.loss, RGBColor(31, 119, 180), true, true),
            (
                "learning rate",
                &self.lr,
                RGBColor(44, 160, 44),
                false,
                false,
            ),
            (
                "gradient norm",
                &self.grad_norm,
                RGBColor(255, 127, 14),
                false,
                true,
            ),
            (
                "tokens/s",
                &self.tokens_per_s,
                RGBColor(148, 103, 189),
                false,
                true,
            ),
        ];
        for (area, (title, series, color, marks, smooth)) in panels.iter().zip(spec) {
            self.panel(area, title, series, color, marks, smooth)?;
        }
        root.present().map_err(|e| self.plot_err(e))
    }

    fn panel<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        title: &str,
        series: &Series,
        color: RGBColor,
        with_marks: bool,
        smooth: bool,
    ) -> Result<()> {
        let err = |e: &dyn std::fmt::Display| self.plot_err(format!("{title} panel: {e}"));
        let Some((x0, mut x1, mut y0, mut y1)) = series.bounds() else {
            area.titled(&format!("{title}: no data"), (FONT, 22))
                .map_err(|e| err(&e))?;
            return Ok(());
        };
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        let pad = if y1 > y0 {
            0.05 * (y1 - y0)
        } else {
            0.05 * y0.abs().max(1e-12)
        };
        y0 -= pad;
        y1 += pad;
        let mut chart = ChartBuilder::on(area)
            .caption(title, (FONT, 22))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(80)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .y_label_formatter(&|v| format_tick(*v))
            .x_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(|e| err(&e))?;
        if with_marks {
            for &(s, kind) in &self.marks {
                if matches!(
                    kind,
                    EventKind::Rollback | EventKind::SkipBatch | EventKind::Halt
                ) {
                    let x = s as f64;
                    chart
                        .draw_series(LineSeries::new([(x, y0), (x, y1)], RED.mix(0.6)))
                        .map_err(|e| err(&e))?;
                }
            }
        }
        if !series.dropped.is_empty() {
            chart
                .draw_series(
                    series
                        .dropped
                        .iter()
                        .map(|&p| Circle::new(p, 2, RGBColor(150, 150, 150).filled())),
                )
                .map_err(|e| err(&e))?;
        }
        // width 1: plotters 0.3.7 fills wider lines as polygons, which grow long spurs past
        // the panel on the steep zigzags of a noisy series (tokens/s)
        let smooth = smooth && series.kept.len() >= SMOOTH_FROM;
        let raw_style = if smooth {
            color.mix(0.35).stroke_width(1)
        } else {
            color.stroke_width(1)
        };
        chart
            .draw_series(LineSeries::new(series.kept.iter().copied(), raw_style))
            .map_err(|e| err(&e))?;
        if smooth {
            let w = (series.kept.len() / 100).max(5);
            chart
                .draw_series(LineSeries::new(
                    moving_average(&series.kept, w),
                    color.stroke_width(1),
                ))
                .map_err(|e| err(&e))?;
        }
        Ok(())
    }
}

/// Series of at least this many points also get a moving average over the raw line.
const SMOOTH_FROM: usize = 200;

/// Trailing moving average over `w` points (fewer at the start).
fn moving_average(points: &[(f64, f64)], w: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(points.len());
    let mut sum = 0.0;
    for (i, &(x, y)) in points.iter().enumerate() {
        sum += y;
        if i >= w {
            sum -= points[i - w].1;
        }
        out.push((x, sum / (i + 1).min(w) as f64));
    }
    out
}

/// Three significant digits: `0.00125` stays distinct from `0.0015` (a learning-rate axis).
fn format_tick(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-2..1e5).contains(&a) {
        format!("{v:.2e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else {
        let decimals = (2 - a.log10().floor() as i32).max(0) as usize;
        let s = format!("{v:.decimals$}");
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    }
}

impl MetricSink for PlotSink {
    fn record(&mut self, m: &StepMetrics) -> Result<()> {
        if self.closed {
            return Err(MonitorError::Closed { sink: "plot" });
        }
        self.loss.push(m.step, m.loss);
        self.lr.push(m.step, m.lr);
        self.grad_norm.push(m.step, m.grad_norm);
        self.tokens_per_s.push(m.step, m.tokens_per_s);
        Ok(())
    }

    fn event(&mut self, e: &Event) -> Result<()> {
        if self.closed {
            return Err(MonitorError::Closed { sink: "plot" });
        }
        self.marks.push((e.step, e.kind));
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    /// Draws the PNG (creating its parent directories).
    fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(MonitorError::file("create directory", dir))?;
        }
        let root = BitMapBackend::new(&self.path, self.size).into_drawing_area();
        self.draw(&root)
    }
}

#[cfg(test)]
mod tick_tests {
    use super::format_tick;

    #[test]
    fn ticks_keep_three_significant_digits() {
        assert_eq!(format_tick(0.00125), "1.25e-3");
        assert_eq!(format_tick(0.0015), "1.50e-3");
        assert_eq!(format_tick(6.5), "6.5");
        assert_eq!(format_tick(6.523), "6.52");
        assert_eq!(format_tick(0.125), "0.125");
        assert_eq!(format_tick(1500.0), "1500");
        assert_eq!(format_tick(0.0), "0");
    }
}
