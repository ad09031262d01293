//! `hearth report RUN_DIR...`: the curves of one or more runs as
//! `report.html` and PNGs (see [`crate::report`]).

use super::Failure;
use crate::report::{self, ReportError};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `hearth report`.
#[derive(Debug, Args)]
pub(super) struct ReportArgs {
    /// Run folders written by `hearth run` (OUTPUT_DIR/NAME); several
    /// are overlaid, each in its own colour.
    #[arg(required = true, value_name = "RUN_DIR")]
    runs: Vec<PathBuf>,
    /// Where to write report.html and a PNG per metric [default: RUN_DIR/report
    /// for one run, ./report for several].
    #[arg(short = 'o', long = "out", value_name = "DIR")]
    out: Option<PathBuf>,
    /// Rewrite the report every few seconds until every run has finished;
    /// the page reloads itself in the browser meanwhile.
    #[arg(long)]
    watch: bool,
    /// Seconds between rewrites under --watch.
    #[arg(long, default_value_t = 5, value_name = "SECONDS", requires = "watch", value_parser = clap::value_parser!(u64).range(1..))]
    interval: u64,
}

pub(super) fn execute(args: ReportArgs) -> Result<(), Failure> {
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| match args.runs.as_slice() {
            [one] => one.join("report"),
            _ => PathBuf::from("report"),
        });
    let written = if args.watch {
        eprintln!(
            "writing {} every {} s until the runs finish (open it in a browser: it reloads itself)",
            out.join(report::REPORT_NAME).display(),
            args.interval
        );
        report::watch(&args.runs, &out, Duration::from_secs(args.interval))
    } else {
        report::write_report(&args.runs, &out, None)
    }
    .map_err(|e| match e {
        ReportError::NotARun { .. } => Failure::bad_input(e),
        _ => Failure::failed(e),
    })?;
    println!(
        "wrote {} and {} chart{} in {}",
        written.html.display(),
        written.pngs.len(),
        if written.pngs.len() == 1 { "" } else { "s" },
        out.display()
    );
    Ok(())
}
