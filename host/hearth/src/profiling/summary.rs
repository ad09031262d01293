//! A recorded trace, and its events averaged by name (torch.profiler's
//! `key_averages()` and `table()`).

use hearth_ops::profiler::{KinetoEvent, KinetoResult};
use std::collections::HashMap;
use std::path::Path;

/// What one recording cycle of a [`super::Profiler`] captured.
#[derive(Debug)]
pub struct ProfileTrace {
    result: KinetoResult,
    step_num: u64,
}

/// The events of one name, added up (a row of torch's `key_averages()`).
#[derive(Debug, Clone, PartialEq)]
pub struct OpAverage {
    /// Operator or span name.
    pub name: String,
    /// Times it was recorded.
    pub count: u64,
    /// Host time inside it, children included, in nanoseconds.
    pub cpu_total_ns: u64,
    /// Host time inside it less its children's, in nanoseconds.
    pub self_cpu_ns: u64,
    /// Device time, in nanoseconds (kernels run on a GPU).
    pub device_total_ns: u64,
    /// FLOPs estimated (`with_flops`).
    pub flops: u64,
}

impl ProfileTrace {
    pub(super) fn new(result: KinetoResult, step_num: u64) -> Self {
        Self { result, step_num }
    }

    /// The profiler step at which this trace was stopped.
    pub fn step_num(&self) -> u64 {
        self.step_num
    }

    /// Writes the trace as Chrome trace JSON, which chrome://tracing,
    /// Perfetto and TensorBoard's profiler open (torch.profiler's
    /// `export_chrome_trace`).
    pub fn export_chrome_trace(&self, path: &Path) -> Result<(), super::ProfileError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| super::ProfileError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        Ok(self.result.save(path)?)
    }

    /// Every recorded event.
    pub fn events(&self) -> Result<Vec<KinetoEvent>, super::ProfileError> {
        Ok(self.result.events()?)
    }

    /// The events added up by name, most host time first; memory events
    /// (`[memory]`) are left out.
    pub fn key_averages(&self) -> Result<Vec<OpAverage>, super::ProfileError> {
        Ok(key_averages(&self.events()?))
    }

    /// The first `limit` rows of [`key_averages`](Self::key_averages) as a
    /// text table (torch's `key_averages().table(row_limit=..)`).
    pub fn table(&self, limit: usize) -> Result<String, super::ProfileError> {
        Ok(table(&self.key_averages()?, limit))
    }
}

/// Adds up `events` by name. An event's self time is its duration less
/// that of the events nested directly in it on the same thread.
pub fn key_averages(events: &[KinetoEvent]) -> Vec<OpAverage> {
    let mut host: Vec<&KinetoEvent> = events
        .iter()
        .filter(|e| e.on_cpu && e.name != "[memory]")
        .collect();
    host.sort_by_key(|e| (e.thread, e.start_ns, std::cmp::Reverse(e.duration_ns)));
    let mut children_ns = vec![0u64; host.len()];
    // Indices of the events enclosing the current one, innermost last.
    let mut open: Vec<usize> = Vec::new();
    for (i, e) in host.iter().enumerate() {
        while let Some(&top) = open.last() {
            let t = host[top];
            let encloses = t.thread == e.thread && t.start_ns + t.duration_ns > e.start_ns;
            if encloses {
                break;
            }
            open.pop();
        }
        if let Some(&parent) = open.last() {
            children_ns[parent] += e.duration_ns;
        }
        open.push(i);
    }
    let mut rows: HashMap<String, OpAverage> = HashMap::new();
    let mut add = |e: &KinetoEvent, self_ns: u64, on_cpu: bool| {
        let row = rows.entry(e.name.clone()).or_insert_with(|| OpAverage {
            name: e.name.clone(),
            count: 0,
            cpu_total_ns: 0,
            self_cpu_ns: 0,
            device_total_ns: 0,
            flops: 0,
        });
        row.count += 1;
        row.flops += e.flops;
        if on_cpu {
            row.cpu_total_ns += e.duration_ns;
            row.self_cpu_ns += self_ns;
        } else {
            row.device_total_ns += e.duration_ns;
        }
    };
    for (i, e) in host.iter().enumerate() {
        add(e, e.duration_ns.saturating_sub(children_ns[i]), true);
    }
    for e in events.iter().filter(|e| !e.on_cpu) {
        add(e, 0, false);
    }
    let mut rows: Vec<OpAverage> = rows.into_values().collect();
    rows.sort_by(|a, b| {
        (b.self_cpu_ns + b.device_total_ns)
            .cmp(&(a.self_cpu_ns + a.device_total_ns))
            .then_with(|| a.name.cmp(&b.name))
    });
    rows
}

/// `rows[..limit]` as a text table, with each row's share of all self
/// time (and device time, when anything ran on a device).
pub fn table(rows: &[OpAverage], limit: usize) -> String {
    let total: u64 = rows.iter().map(|r| r.self_cpu_ns).sum::<u64>().max(1);
    let device = rows.iter().any(|r| r.device_total_ns > 0);
    let ms = |ns: u64| format!("{:.3}", ns as f64 / 1e6);
    let mut out = format!(
        "{:<44} {:>8} {:>13} {:>8} {:>15}",
        "Name", "Calls", "Self CPU (ms)", "Self %", "CPU total (ms)"
    );
    out += if device { "  Device (ms)\n" } else { "\n" };
    for r in rows.iter().take(limit) {
        let mut name = r.name.clone();
        if name.chars().count() > 44 {
            name = name.chars().take(41).collect::<String>() + "...";
        }
        out += &format!(
            "{:<44} {:>8} {:>13} {:>7.1}% {:>15}",
            name,
            r.count,
            ms(r.self_cpu_ns),
            100.0 * r.self_cpu_ns as f64 / total as f64,
            ms(r.cpu_total_ns),
        );
        if device {
            out += &format!(" {:>12}", ms(r.device_total_ns));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: &str, thread: u64, start_ns: u64, duration_ns: u64) -> KinetoEvent {
        KinetoEvent {
            name: name.into(),
            start_ns,
            duration_ns,
            thread,
            activity: 0,
            on_cpu: true,
            flops: 0,
            bytes: 0,
        }
    }

    #[test]
    fn self_time_leaves_out_directly_nested_events_on_the_same_thread() {
        let events = [
            event("aten::linear", 1, 0, 100),
            event("aten::t", 1, 5, 10),
            event("aten::addmm", 1, 20, 70),
            event("aten::copy_", 1, 30, 20), // inside addmm
            event("aten::addmm", 2, 10, 50), // another thread
        ];
        let rows = key_averages(&events);
        let get = |n: &str| rows.iter().find(|r| r.name == n).unwrap().clone();
        assert_eq!(get("aten::linear").self_cpu_ns, 20);
        assert_eq!(get("aten::linear").cpu_total_ns, 100);
        assert_eq!(get("aten::addmm").count, 2);
        assert_eq!(get("aten::addmm").self_cpu_ns, 50 + 50);
        assert_eq!(get("aten::copy_").self_cpu_ns, 20);
        assert_eq!(rows[0].name, "aten::addmm");
        assert!(table(&rows, 2).lines().count() == 3);
    }
}
