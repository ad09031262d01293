//! One metric's chart, drawn with plotters on any backend (inline SVG for
//! the HTML, PNG beside it): each run's curve, the loss also smoothed as
//! TensorBoard smooths it, and the steps where checkpoints were written.

use super::runs::RunData;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

/// Width and height of every chart, in pixels.
pub const CHART_SIZE: (u32, u32) = (960, 440);

/// TensorBoard's default smoothing weight.
pub const SMOOTHING: f64 = 0.6;

/// The font text is drawn in, embedded so that no system font is needed
/// (DejaVu Sans; its licence is `host/cli/assets/DejaVuSans.LICENSE`).
static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Registers the embedded font as `sans-serif` (once).
pub fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .unwrap_or_else(|_| panic!("the embedded font is a valid TrueType font"));
    });
}

/// Run colours, one per run in order (Tableau's palette).
const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// The colour of run `i`.
pub fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

/// TensorBoard's smoothing: an exponential moving average, debiased so the
/// first points are not pulled towards zero.
pub fn smooth(points: &[(u64, f64)], weight: f64) -> Vec<(u64, f64)> {
    let (mut last, mut n) = (0.0, 0i32);
    points
        .iter()
        .map(|&(step, v)| {
            n += 1;
            last = last * weight + (1.0 - weight) * v;
            (step, last / (1.0 - weight.powi(n)))
        })
        .collect()
}

/// The title a metric is shown under.
pub fn title(metric: &str) -> String {
    match metric {
        "loss" => "training loss".into(),
        "lr" => "learning rate".into(),
        "tokens_per_sec" => "throughput (tokens/s)".into(),
        "grad_norm" => "gradient norm (before clipping)".into(),
        "loss_scale" => "loss scale (fp16)".into(),
        other => other.replace('/', ": ").replace('_', " "),
    }
}

/// Draws `metric` of every run that logged it onto `area`.
pub fn draw<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    metric: &str,
    runs: &[RunData],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    register_font();
    area.fill(&WHITE)?;
    type Curve<'r> = (usize, &'r RunData, &'r Vec<(u64, f64)>);
    let curves: Vec<Curve> = runs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.series.get(metric).map(|p| (i, r, p)))
        .collect();
    let all = curves.iter().flat_map(|(_, _, p)| p.iter());
    let (mut x0, mut x1) = (u64::MAX, 0u64);
    let (mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY);
    for &(s, v) in all {
        (x0, x1) = (x0.min(s), x1.max(s));
        if v.is_finite() {
            (y0, y1) = (y0.min(v), y1.max(v));
        }
    }
    if x0 > x1 {
        (x0, x1) = (0, 1);
    }
    if x0 == x1 {
        (x0, x1) = (x0.saturating_sub(1), x1 + 1);
    }
    if y0.partial_cmp(&y1) != Some(std::cmp::Ordering::Less) {
        let pad = if y0.is_finite() {
            y0.abs().max(1e-9) * 0.1
        } else {
            1.0
        };
        (y0, y1) = if y0.is_finite() {
            (y0 - pad, y0 + pad)
        } else {
            (0.0, 1.0)
        };
    }
    let margin = (y1 - y0) * 0.05;
    let mut chart = ChartBuilder::on(area)
        .caption(title(metric), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(72)
        .build_cartesian_2d(x0..x1, (y0 - margin)..(y1 + margin))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .light_line_style(RGBColor(235, 235, 235))
        .label_style(("sans-serif", 13))
        .y_label_formatter(&|v| format_value(*v, y0 - margin, y1 + margin))
        .draw()?;
    // The steps where checkpoints were written.
    let mut marks: Vec<u64> = curves
        .iter()
        .flat_map(|(_, r, _)| r.checkpoints.iter().copied())
        .collect();
    marks.sort_unstable();
    marks.dedup();
    for (k, step) in marks.iter().enumerate() {
        let series = chart.draw_series(DashedLineSeries::new(
            [(*step, y0 - margin), (*step, y1 + margin)],
            6,
            4,
            RGBColor(110, 110, 110).stroke_width(1),
        ))?;
        if k == 0 {
            series
                .label("checkpoint")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RGBColor(110, 110, 110)));
        }
    }
    let several = curves.len() > 1;
    for (i, run, points) in &curves {
        let c = colour(*i);
        let name = if several {
            run.label.clone()
        } else {
            metric.to_string()
        };
        if metric == "loss" && points.len() > 2 {
            chart.draw_series(LineSeries::new(
                points.iter().copied(),
                c.mix(0.3).stroke_width(1),
            ))?;
            chart
                .draw_series(LineSeries::new(
                    smooth(points, SMOOTHING),
                    c.stroke_width(2),
                ))?
                .label(format!("{name} (smoothed {SMOOTHING})"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
        } else {
            chart
                .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))?
                .label(name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
            if points.len() <= 30 {
                chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
            }
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    area.present()
}

/// A value as an axis label on an axis from `lo` to `hi`: as many decimals
/// as the axis needs to tell its labels apart, in scientific notation when
/// the values are tiny or huge.
fn format_value(v: f64, lo: f64, hi: f64) -> String {
    let magnitude = lo.abs().max(hi.abs());
    let step = ((hi - lo) / 5.0).abs().max(f64::MIN_POSITIVE);
    if magnitude != 0.0 && !(1e-3..1e5).contains(&magnitude) {
        let digits = (magnitude.log10().floor() - step.log10().floor()).clamp(1.0, 6.0) as usize;
        return format!("{v:.digits$e}");
    }
    let decimals = (-step.log10().floor()).clamp(0.0, 8.0) as usize;
    format!("{v:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_tensorboards_debiased_average() {
        let points = [(1, 1.0), (2, 0.0), (3, 0.0)];
        let s = smooth(&points, 0.6);
        // The first point is itself, then the debiased EMA.
        assert!((s[0].1 - 1.0).abs() < 1e-12);
        assert!((s[1].1 - 0.24 / 0.64).abs() < 1e-12);
        assert!((s[2].1 - 0.144 / 0.784).abs() < 1e-12);
    }

    #[test]
    fn axis_labels_tell_close_values_apart() {
        assert_eq!(format_value(0.0021, 0.0018, 0.0022), "0.00210");
        assert_eq!(format_value(1.2, 1.0, 2.0), "1.2");
        assert_eq!(format_value(0.0003, 0.0002, 0.0004), "3.0e-4");
        assert_eq!(format_value(18234.0, 10000.0, 20000.0), "18234");
        assert_eq!(format_value(0.5, 0.0, 1.0), "0.5");
        assert_eq!(format_value(250000.0, 0.0, 400000.0), "2.5e5");
    }
}
