//! A Gantt chart: lanes of labelled, coloured spans against time, drawn into a PNG (a pipeline
//! schedule's timeline, one lane per rank).

use crate::plot::{register_font, FONT};
use crate::{MonitorError, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

/// One span of a lane: from `start` to `end`, filled with `color`, `label` written inside when
/// it fits.
#[derive(Debug, Clone, PartialEq)]
pub struct GanttSpan {
    /// Where it starts.
    pub start: f64,
    /// Where it ends.
    pub end: f64,
    /// The text inside it.
    pub label: String,
    /// Its fill (RGB).
    pub color: (u8, u8, u8),
}

/// A row of spans.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GanttLane {
    /// The name at the left of the row.
    pub name: String,
    /// Its spans.
    pub spans: Vec<GanttSpan>,
}

/// A Gantt chart: a title, lanes top to bottom, and a legend of colours.
///
/// ```
/// use kiln_monitor::{Gantt, GanttLane, GanttSpan};
/// let span = |start, end, label: &str| GanttSpan { start, end, label: label.into(), color: (31, 119, 180) };
/// let chart = Gantt {
///     title: "two lanes".into(),
///     x_label: "time".into(),
///     lanes: vec![
///         GanttLane { name: "a".into(), spans: vec![span(0.0, 1.0, "F0"), span(1.0, 3.0, "B0")] },
///         GanttLane { name: "b".into(), spans: vec![span(1.0, 2.0, "F0")] },
///     ],
///     legend: vec![("forward".into(), (31, 119, 180))],
/// };
/// let (w, h) = (400, 200);
/// let mut rgb = vec![0u8; (w * h * 3) as usize];
/// chart.render_rgb((w, h), &mut rgb)?;
/// // the span's colour is on the canvas
/// assert!(rgb.chunks(3).any(|p| p == [31, 119, 180]));
/// # Ok::<(), kiln_monitor::MonitorError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Gantt {
    /// The caption.
    pub title: String,
    /// The time axis' name.
    pub x_label: String,
    /// The rows, drawn top to bottom.
    pub lanes: Vec<GanttLane>,
    /// Names of the colours, drawn under the title.
    pub legend: Vec<(String, (u8, u8, u8))>,
}

impl Gantt {
    /// The end of the last span (at least a small positive width).
    fn extent(&self) -> f64 {
        let end = self
            .lanes
            .iter()
            .flat_map(|l| &l.spans)
            .map(|s| s.end)
            .filter(|e| e.is_finite())
            .fold(0.0, f64::max);
        if end > 0.0 {
            end
        } else {
            1.0
        }
    }

    /// Draws into an RGB buffer of `width * height * 3` bytes.
    pub fn render_rgb(&self, size: (u32, u32), buf: &mut [u8]) -> Result<()> {
        let want = size.0 as usize * size.1 as usize * 3;
        if buf.len() != want {
            return Err(err(
                Path::new(""),
                format!("buffer holds {} bytes, expected {want}", buf.len()),
            ));
        }
        let root = BitMapBackend::with_buffer(buf, size).into_drawing_area();
        self.draw(&root, Path::new(""))
    }

    /// Writes the chart as a PNG of `size` pixels (creating the parent directories).
    pub fn write_png(&self, path: impl AsRef<Path>, size: (u32, u32)) -> Result<()> {
        let path = path.as_ref();
        if size.0 < 100 || size.1 < 80 {
            return Err(err(
                path,
                format!(
                    "{} x {} pixels is too small (at least 100 x 80)",
                    size.0, size.1
                ),
            ));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(MonitorError::file("create directory", dir))?;
        }
        let root = BitMapBackend::new(path, size).into_drawing_area();
        self.draw(&root, path)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>, path: &Path) -> Result<()> {
        let e = |m: &dyn std::fmt::Display| err(path, m.to_string());
        register_font().map_err(|m| e(&m))?;
        root.fill(&WHITE).map_err(|m| e(&m))?;
        let lanes = self.lanes.len().max(1);
        let x1 = self.extent();
        let legend_h = if self.legend.is_empty() { 0 } else { 26 };
        let (legend_area, chart_area) = root.split_vertically(40 + legend_h);
        legend_area
            .draw(&Text::new(
                self.title.clone(),
                (12, 8),
                (FONT, 22).into_font().color(&BLACK),
            ))
            .map_err(|m| e(&m))?;
        let mut x = 12i32;
        for (name, (r, g, b)) in &self.legend {
            legend_area
                .draw(&Rectangle::new(
                    [(x, 42), (x + 16, 56)],
                    RGBColor(*r, *g, *b).filled(),
                ))
                .map_err(|m| e(&m))?;
            legend_area
                .draw(&Text::new(
                    name.clone(),
                    (x + 22, 42),
                    (FONT, 15).into_font(),
                ))
                .map_err(|m| e(&m))?;
            x += 40 + 9 * name.chars().count() as i32;
        }
        let mut chart = ChartBuilder::on(&chart_area)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x1, 0.0..lanes as f64)
            .map_err(|m| e(&m))?;
        let names: Vec<String> = self.lanes.iter().map(|l| l.name.clone()).collect();
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc(self.x_label.as_str())
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .y_labels(lanes * 2 + 1)
            .y_label_formatter(&|y| {
                // lane i is drawn between lanes - i - 1 and lanes - i; its name at the middle
                let k = lanes as f64 - y - 0.5;
                let i = k.round();
                if (k - i).abs() < 1e-6 && i >= 0.0 {
                    names.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(|m| e(&m))?;
        // pixels per unit of time, to know whether a label fits in its span
        let plot_w = chart.plotting_area().dim_in_pixel().0.max(1) as f64;
        let plot_h = chart.plotting_area().dim_in_pixel().1.max(1) as f64;
        let px_per_unit = plot_w / x1;
        let lane_px = plot_h / lanes as f64;
        let font_px = (lane_px * 0.45).clamp(8.0, 16.0);
        for (i, lane) in self.lanes.iter().enumerate() {
            let top = (lanes - i) as f64 - 0.1;
            let bottom = (lanes - i - 1) as f64 + 0.1;
            for s in lane.spans.iter().filter(|s| s.end > s.start) {
                let (r, g, b) = s.color;
                chart
                    .draw_series([Rectangle::new(
                        [(s.start, bottom), (s.end, top)],
                        RGBColor(r, g, b).filled(),
                    )])
                    .map_err(|m| e(&m))?;
                chart
                    .draw_series([Rectangle::new(
                        [(s.start, bottom), (s.end, top)],
                        WHITE.stroke_width(1),
                    )])
                    .map_err(|m| e(&m))?;
                let text_w = 0.62 * font_px * s.label.chars().count() as f64;
                if !s.label.is_empty() && (s.end - s.start) * px_per_unit >= text_w + 4.0 {
                    let ink =
                        if u32::from(r) * 299 + u32::from(g) * 587 + u32::from(b) * 114 > 140_000 {
                            BLACK
                        } else {
                            WHITE
                        };
                    let style = (FONT, font_px)
                        .into_font()
                        .color(&ink)
                        .pos(Pos::new(HPos::Center, VPos::Center));
                    chart
                        .draw_series([Text::new(
                            s.label.clone(),
                            ((s.start + s.end) / 2.0, (top + bottom) / 2.0),
                            style,
                        )])
                        .map_err(|m| e(&m))?;
                }
            }
        }
        root.present().map_err(|m| e(&m))
    }
}

fn err(path: &Path, message: String) -> MonitorError {
    MonitorError::Plot {
        path: PathBuf::from(path),
        message,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn count(rgb: &[u8], c: (u8, u8, u8)) -> usize {
        rgb.chunks(3).filter(|p| *p == [c.0, c.1, c.2]).count()
    }

    #[test]
    fn spans_cover_areas_in_proportion_to_their_length_and_lanes_stack() {
        let (red, blue, green) = ((200, 30, 30), (30, 30, 200), (30, 160, 30));
        let span = |start: f64, end: f64, color| GanttSpan {
            start,
            end,
            label: String::new(),
            color,
        };
        let chart = Gantt {
            title: "t".into(),
            x_label: "time".into(),
            lanes: vec![
                GanttLane {
                    name: "rank 0".into(),
                    spans: vec![span(0.0, 1.0, red), span(1.0, 4.0, blue)],
                },
                GanttLane {
                    name: "rank 1".into(),
                    spans: vec![span(2.0, 4.0, green), span(4.0, 4.0, red)],
                },
            ],
            legend: vec![],
        };
        let size = (900u32, 400u32);
        let mut rgb = vec![0u8; (size.0 * size.1 * 3) as usize];
        chart.render_rgb(size, &mut rgb).unwrap();
        let (r, b, g) = (count(&rgb, red), count(&rgb, blue), count(&rgb, green));
        assert!(r > 100, "{r}");
        // three units against one, two against one (one pixel of border each side)
        let ratio = |x: usize, y: usize| x as f64 / y as f64;
        assert!((ratio(b, r) - 3.0).abs() < 0.15, "{b} / {r}");
        assert!((ratio(g, r) - 2.0).abs() < 0.15, "{g} / {r}");
        // the first lane is above the second: red's rows before green's
        let row_of = |c: (u8, u8, u8)| {
            rgb.chunks(3)
                .position(|p| p == [c.0, c.1, c.2])
                .map(|i| i / size.0 as usize)
                .unwrap()
        };
        assert!(row_of(red) < row_of(green));
        // a wrong buffer is an error, not a panic
        let err = chart.render_rgb(size, &mut [0u8; 10]).unwrap_err();
        assert!(err.to_string().contains("expected"), "{err}");
    }
}
