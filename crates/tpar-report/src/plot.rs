//! `--plot FILE.svg`: latency against message size, one line per algorithm, log scales, as
//! SVG written where [`crate::output`] writes a target (`-` is stdout).

use plotters::prelude::*;
use tpar::memory::human_bytes;
use tpar_harness::cpu_bench::CpuRow;
use tpar_harness::cuda_bench::CudaRow;

use crate::{ReportError, Result};

/// One line of the plot: a name and (bytes, microseconds) points; sizes of 0 are left out
/// (a log axis has no place for them).
pub struct Series {
    pub name: String,
    pub points: Vec<(u64, f64)>,
}

/// A timed row that can be drawn: its algorithm, message size and p50 latency.
pub trait LatencyPoint {
    fn point(&self) -> (&str, u64, f64);
}

impl LatencyPoint for CpuRow {
    fn point(&self) -> (&str, u64, f64) {
        (&self.algo, self.bytes, self.p50_us)
    }
}

impl LatencyPoint for CudaRow {
    fn point(&self) -> (&str, u64, f64) {
        (&self.algo, self.bytes, self.p50_us)
    }
}

/// Draws `rows` to `path` where `--plot` gave one (a line per algorithm, titled `title()`),
/// and says so (on stderr; `-` puts the SVG on stdout).
pub fn plot_latency<'a, R: LatencyPoint + 'a>(
    path: Option<&str>,
    title: impl FnOnce() -> String,
    rows: impl Iterator<Item = &'a R>,
) -> Result<()> {
    let Some(path) = path else {
        return Ok(());
    };
    let svg = latency_svg(&title(), &series(rows.map(R::point))).map_err(|e| match e {
        ReportError::Plot(reason) => ReportError::Target {
            target: format!("--plot {path}"),
            reason,
        },
        other => other,
    })?;
    crate::output::write_target("plot", path, svg.as_bytes())?;
    if path != crate::output::STDOUT {
        crate::output::print_err(&format!("wrote {path}"));
    }
    Ok(())
}

/// The SVG text of `series` under `title`.
pub fn latency_svg(title: &str, series: &[Series]) -> Result<String> {
    let mut svg = String::new();
    draw(&mut svg, title, series).map_err(|e| match e {
        DrawError::Refused(message) | DrawError::Plotters(message) => ReportError::Plot(message),
    })?;
    Ok(svg)
}

/// A drawing that stopped: refused before it began, or failed in the plotting library.
enum DrawError {
    Refused(String),
    Plotters(String),
}

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for DrawError {
    fn from(e: DrawingAreaErrorKind<E>) -> DrawError {
        DrawError::Plotters(e.to_string())
    }
}

fn draw(svg: &mut String, title: &str, series: &[Series]) -> std::result::Result<(), DrawError> {
    let points = || {
        series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|(b, us)| *b > 0 && *us > 0.0)
    };
    let (Some(x_min), Some(x_max)) = (points().map(|p| p.0).min(), points().map(|p| p.0).max())
    else {
        return Err(DrawError::Refused(
            "no measured sizes above 0 bytes to draw".into(),
        ));
    };
    let y_min = points().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y_max = points().map(|p| p.1).fold(0.0, f64::max);
    {
        let root = SVGBackend::with_string(svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            // x is log2(bytes) on a linear axis, so ticks fall on powers of two.
            .build_cartesian_2d(
                (x_min as f64).log2() - 0.5..(x_max as f64).log2() + 0.5,
                (y_min / 1.5..y_max * 1.5).log_scale(),
            )?;
        let powers = ((x_max as f64).log2() - (x_min as f64).log2()).ceil() as usize + 2;
        chart
            .configure_mesh()
            .x_desc("message size")
            .y_desc("p50 latency per allreduce (us)")
            .x_labels(powers.min(24))
            .x_label_formatter(&|v| human_bytes(2f64.powf(*v).round() as u64))
            .draw()?;
        for (i, s) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let line: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|(b, us)| *b > 0 && *us > 0.0)
                .map(|(b, us)| ((*b as f64).log2(), *us))
                .collect();
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                .label(s.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart.draw_series(line.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(())
}

/// Groups (algorithm, bytes, us) rows into one plot series per algorithm, in first-seen order.
pub fn series<'a>(rows: impl Iterator<Item = (&'a str, u64, f64)>) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for (name, bytes, us) in rows {
        match out.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((bytes, us)),
            None => out.push(Series {
                name: name.to_owned(),
                points: vec![(bytes, us)],
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_an_svg_with_every_series() {
        let series = vec![
            Series {
                name: "one-shot".into(),
                points: vec![(0, 1.0), (4096, 4.0), (65536, 5.0)],
            },
            Series {
                name: "nccl".into(),
                points: vec![(4096, 20.0), (65536, 22.0)],
            },
        ];
        let svg = latency_svg("test", &series).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("one-shot") && svg.contains("nccl"));
        assert!(latency_svg("empty", &[]).is_err());
    }
}
