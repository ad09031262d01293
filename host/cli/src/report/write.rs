//! Writing `report.html` and its charts from runs' metrics, once or while they train.

use super::plot::CHART_SIZE;
use super::runs::{load_run, RunData};
use super::{html, plot, runs};
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The page a report writes.
pub const REPORT_NAME: &str = "report.html";

/// Why a report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A folder that is not a run folder.
    #[error("{dir}: not a run folder: {why}")]
    NotARun {
        /// The folder.
        dir: PathBuf,
        /// Why, and what to give instead.
        why: String,
    },
    /// Reading a run or writing the report failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// Drawing a chart failed.
    #[error("drawing the {metric} chart: {message}")]
    Draw {
        /// The metric.
        metric: String,
        /// What plotters said.
        message: String,
    },
}

/// What a report wrote.
#[derive(Debug, Clone)]
pub struct Written {
    /// `report.html`.
    pub html: PathBuf,
    /// One PNG per metric, in the page's order.
    pub pngs: Vec<PathBuf>,
    /// Whether every run had finished.
    pub finished: bool,
}

/// The metrics the runs logged, in the order the page shows them: loss,
/// evaluation, learning rate, throughput, gradient norm, loss scale, the
/// rest by name.
pub(super) fn metrics(runs: &[RunData]) -> Vec<String> {
    let mut names: Vec<&String> = runs.iter().flat_map(|r| r.series.keys()).collect();
    names.sort();
    names.dedup();
    let rank = |m: &str| match m {
        "loss" => 0,
        m if m.starts_with("eval/") => 1,
        "lr" => 2,
        "tokens_per_sec" => 3,
        "grad_norm" => 4,
        "loss_scale" => 5,
        _ => 6,
    };
    let mut names: Vec<String> = names.into_iter().cloned().collect();
    names.sort_by_key(|m| rank(m));
    names
}

/// The PNG file of a metric (`eval/accuracy` → `eval_accuracy.png`).
pub fn png_name(metric: &str) -> String {
    let safe: String = metric
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{safe}.png")
}

pub(super) fn draw_error(metric: &str) -> impl Fn(String) -> ReportError + '_ {
    move |message| ReportError::Draw {
        metric: metric.into(),
        message,
    }
}

/// Writes the report of the run folders `dirs` into `out`: `report.html`
/// and a PNG per metric. `waiting` accepts runs that have logged nothing
/// yet, and makes the page reload itself every `waiting` seconds.
pub fn write_report(
    dirs: &[PathBuf],
    out: &Path,
    waiting: Option<u64>,
) -> Result<Written, ReportError> {
    let mut runs = dirs
        .iter()
        .map(|d| load_run(d, waiting.is_some()))
        .collect::<Result<Vec<_>, _>>()?;
    runs::distinct_labels(&mut runs);
    std::fs::create_dir_all(out).map_err(|source| ReportError::Io {
        path: out.into(),
        source,
    })?;
    let mut charts = Vec::new();
    let mut pngs = Vec::new();
    for metric in metrics(&runs) {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, CHART_SIZE).into_drawing_area();
            plot::draw(&root, &metric, &runs).map_err(|e| draw_error(&metric)(e.to_string()))?;
        }
        let png = out.join(png_name(&metric));
        let tmp = out.join(format!(".{}.tmp.png", png_name(&metric)));
        {
            let root = BitMapBackend::new(&tmp, CHART_SIZE).into_drawing_area();
            plot::draw(&root, &metric, &runs).map_err(|e| draw_error(&metric)(e.to_string()))?;
        }
        std::fs::rename(&tmp, &png).map_err(|source| ReportError::Io {
            path: png.clone(),
            source,
        })?;
        pngs.push(png);
        // Inline SVG needs no namespace, and the page names no address.
        charts.push((
            metric,
            svg.replacen(" xmlns=\"http://www.w3.org/2000/svg\"", "", 1),
        ));
    }
    let finished = runs.iter().all(RunData::finished);
    let page = html::page(&runs, &charts, waiting.filter(|_| !finished));
    let html = out.join(REPORT_NAME);
    // Written beside and renamed, so a browser reloading it never sees half.
    hearth_ops::durable::write_atomically(&html, |f| std::io::Write::write_all(f, page.as_bytes()))
        .map_err(|source| ReportError::Io {
            path: html.clone(),
            source,
        })?;
    Ok(Written {
        html,
        pngs,
        finished,
    })
}

/// `--watch`: rewrites the report every `every` until every run has
/// finished (then once more, without the reload).
pub fn watch(dirs: &[PathBuf], out: &Path, every: Duration) -> Result<Written, ReportError> {
    let seconds = every.as_secs().max(1);
    loop {
        let written = write_report(dirs, out, Some(seconds))?;
        if written.finished {
            return Ok(written);
        }
        std::thread::sleep(every);
    }
}
