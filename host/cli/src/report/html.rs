//! `report.html`: one self-contained page (inline SVG, inline CSS, nothing
//! fetched) with every chart, each run's summary, and the config keys the
//! runs differ in.

use super::plot::colour;
use super::runs::{config_differences, RunData};
use std::fmt::Write;

/// Escapes text for HTML.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#222;max-width:1000px}\
h1{font-size:22px}h2{font-size:18px;margin-top:28px}\
table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}\
th{background:#f3f3f3}figure{margin:16px 0}figcaption{font-size:13px;color:#555}\
.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle}";

/// A summary value, if the run has it.
fn summary_value(run: &RunData, key: &str) -> String {
    let Some(v) = run.summary.as_ref().and_then(|s| s.pointer(key)) else {
        return "—".into();
    };
    match v {
        serde_json::Value::Number(n) if key.contains("tokens") => {
            format!("{:.0}", n.as_f64().unwrap_or(0.0))
        }
        serde_json::Value::Number(n) => match n.as_f64() {
            Some(f) if f.fract() != 0.0 => format!("{f:.4}"),
            _ => n.to_string(),
        },
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "—".into(),
        other => other.to_string(),
    }
}

/// The final evaluation of the summary, in words.
fn evaluation(run: &RunData) -> String {
    let eval = run.summary.as_ref().and_then(|s| s.get("eval"));
    let number = |k: &str| {
        eval.and_then(|e| e.get(k))
            .and_then(serde_json::Value::as_f64)
    };
    match (number("accuracy"), number("loss")) {
        (Some(a), _) => format!("exact-match accuracy {a:.4}"),
        (None, Some(l)) => format!("validation loss {l:.4}"),
        _ => "—".into(),
    }
}

/// A table of the trackers that faulted (the summary's `trackers`), if any:
/// faults, restarts, values they never received, and whether they were
/// disabled.
fn tracker_faults(html: &mut String, runs: &[RunData]) {
    let faulted: Vec<(&RunData, &serde_json::Value)> = runs
        .iter()
        .flat_map(|run| {
            let trackers = run.summary.as_ref().and_then(|s| s.get("trackers"));
            let list = trackers.and_then(serde_json::Value::as_array);
            list.into_iter().flatten().map(move |t| (run, t))
        })
        .filter(|(_, t)| t["faults"].as_array().is_some_and(|f| !f.is_empty()))
        .collect();
    if faulted.is_empty() {
        return;
    }
    html.push_str("<h2>Tracker faults</h2>\n<table>\n<tr><th>run</th><th>tracker</th><th>faults</th><th>restarts</th><th>values lost</th><th>state</th></tr>\n");
    for (run, t) in faulted {
        let faults: Vec<String> = t["faults"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| {
                let at = f["step"]
                    .as_u64()
                    .map(|s| format!(" at step {s}"))
                    .unwrap_or_default();
                format!(
                    "{} in {}{at}",
                    f["kind"].as_str().unwrap_or("?"),
                    f["call"].as_str().unwrap_or("?")
                )
            })
            .collect();
        let state = match t["disabled_at_step"].as_u64() {
            Some(step) => format!("disabled at step {step}"),
            None => "running to the end".into(),
        };
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&run.label),
            escape(t["name"].as_str().unwrap_or("?")),
            escape(&faults.join("; ")),
            t["restarts"],
            t["values_dropped"],
            escape(&state),
        );
    }
    html.push_str("</table>\n");
}

/// The whole page: `charts` holds `(metric, inline svg)` pairs; `refresh`
/// makes the browser reload it every so many seconds (`--watch`).
pub fn page(runs: &[RunData], charts: &[(String, String)], refresh: Option<u64>) -> String {
    let mut html = String::new();
    let title = match runs {
        [one] => format!("hearth report: {}", one.label),
        _ => format!("hearth report: {} runs", runs.len()),
    };
    let _ = write!(
        html,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
    );
    if let Some(seconds) = refresh {
        let _ = writeln!(html, "<meta http-equiv=\"refresh\" content=\"{seconds}\">");
    }
    let _ = write!(
        html,
        "<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>{}</h1>\n",
        escape(&title),
        escape(&title)
    );
    html.push_str("<h2>Runs</h2>\n<table>\n<tr><th>run</th><th>folder</th><th>status</th><th>steps</th><th>final loss</th><th>evaluation</th><th>tokens/s</th><th>device</th><th>parameters</th></tr>\n");
    for (i, run) in runs.iter().enumerate() {
        let c = colour(i);
        let status = if run.finished() {
            "finished"
        } else {
            "running"
        };
        let _ = writeln!(
            html,
            "<tr><td><span class=\"swatch\" style=\"background:rgb({},{},{})\"></span>{}</td><td>{}</td><td>{status}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            c.0,
            c.1,
            c.2,
            escape(&run.label),
            escape(&run.dir.display().to_string()),
            run.series.values().filter_map(|p| p.last()).map(|(s, _)| *s).max().unwrap_or(0),
            summary_value(run, "/final_loss"),
            escape(&evaluation(run)),
            summary_value(run, "/tokens_per_sec"),
            escape(&summary_value(run, "/device")),
            summary_value(run, "/num_parameters"),
        );
    }
    html.push_str("</table>\n");
    tracker_faults(&mut html, runs);
    if runs.len() > 1 {
        let differences = config_differences(runs);
        html.push_str("<h2>Config differences</h2>\n");
        if differences.is_empty() {
            html.push_str("<p>The runs' configs are the same.</p>\n");
        } else {
            html.push_str("<table class=\"differences\">\n<tr><th>key</th>");
            for run in runs {
                let _ = write!(html, "<th>{}</th>", escape(&run.label));
            }
            html.push_str("</tr>\n");
            for (key, values) in differences {
                let _ = write!(html, "<tr><td>{}</td>", escape(&key));
                for v in values {
                    let _ = write!(
                        html,
                        "<td>{}</td>",
                        escape(v.as_deref().unwrap_or("(not set)"))
                    );
                }
                html.push_str("</tr>\n");
            }
            html.push_str("</table>\n");
        }
    }
    html.push_str("<h2>Charts</h2>\n");
    if charts.is_empty() {
        html.push_str("<p>Nothing logged yet.</p>\n");
    }
    for (metric, svg) in charts {
        let _ = write!(
            html,
            "<figure class=\"plot\" data-metric=\"{}\">\n{svg}\n<figcaption>{}</figcaption>\n</figure>\n",
            escape(metric),
            escape(&caption(metric))
        );
    }
    html.push_str("</body>\n</html>\n");
    html
}

fn caption(metric: &str) -> String {
    match metric {
        "loss" => "Mean training loss of each logging window (faint), smoothed with TensorBoard's weight 0.6; dashed lines mark checkpoints.".into(),
        "lr" => "Learning rate of the optimizer step.".into(),
        "tokens_per_sec" => "Training throughput over each logging window, all processes together.".into(),
        "grad_norm" => "Total gradient norm at the logging step, before clipping.".into(),
        "loss_scale" => "fp16 loss scale.".into(),
        m if m.starts_with("eval/") => format!("Held-out evaluation ({}).", &m[5..]),
        m => format!("Logged value `{m}`."),
    }
}
