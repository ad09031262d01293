//! A plugin's stdout and stderr: never the host's own streams, but log lines
//! prefixed with the plugin's name. A line longer than [`MAX_LINE`] bytes is
//! cut (the rest is counted, not kept), so a plugin that prints 100 MB costs
//! the host at most one buffer of [`MAX_LINE`] bytes.

use bytes::Bytes;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Longest line kept from a plugin's output.
pub const MAX_LINE: usize = 4096;

/// Cuts `text` to at most `max` bytes on a character boundary, saying so.
pub fn clip(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} … ({} more bytes cut)", &text[..end], text.len() - end).into()
}

/// How much of a plugin's stdout and stderr reaches the host's log: lines
/// and bytes per call, lines per run. Past a budget, lines are dropped and
/// counted; one line says how many when the call (or the run) ends.
pub struct OutputBudget {
    plugin: Arc<str>,
    lines_per_call: u64,
    bytes_per_call: u64,
    lines_per_run: u64,
    used: Mutex<Used>,
}

#[derive(Default)]
struct Used {
    call_lines: u64,
    call_bytes: u64,
    run_lines: u64,
    dropped_lines: u64,
    dropped_bytes: u64,
    /// The run's budget is spent and was reported: what is dropped from
    /// now on is reported once, at the end.
    run_spent: bool,
}

impl OutputBudget {
    /// The budget of plugin `plugin` under `limits`.
    pub fn new(plugin: Arc<str>, limits: &super::Limits) -> Arc<Self> {
        Arc::new(Self {
            plugin,
            lines_per_call: limits.log_lines_per_call,
            bytes_per_call: limits.log_bytes_per_call,
            lines_per_run: limits.log_lines_per_run,
            used: Mutex::new(Used::default()),
        })
    }

    /// A call starts: says what the last one dropped, and resets the
    /// per-call counts.
    pub fn start_call(&self) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        if !used.run_spent {
            self.report(&mut used);
            used.run_spent = used.run_lines >= self.lines_per_run;
        }
        used.call_lines = 0;
        used.call_bytes = 0;
    }

    fn report(&self, used: &mut Used) {
        if used.dropped_lines == 0 {
            return;
        }
        tracing::warn!(
            "[plugin {}] dropped {} line(s) ({} bytes) of its output past its budget ({} lines and \
             {} bytes per call, {} lines per run; raise them in the run config's [plugin-limits.{}])",
            self.plugin,
            used.dropped_lines,
            used.dropped_bytes,
            self.lines_per_call,
            self.bytes_per_call,
            self.lines_per_run,
            self.plugin
        );
        used.dropped_lines = 0;
        used.dropped_bytes = 0;
    }

    /// Whether a line of `bytes` bytes may be logged (counted either way).
    fn admit(&self, bytes: usize) -> bool {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = bytes as u64 + 1;
        let fits = used.call_lines < self.lines_per_call
            && used.call_bytes + bytes <= self.bytes_per_call
            && used.run_lines < self.lines_per_run;
        if fits {
            used.call_lines += 1;
            used.call_bytes += bytes;
            used.run_lines += 1;
        } else {
            used.dropped_lines += 1;
            used.dropped_bytes += bytes;
        }
        fits
    }
}

impl Drop for OutputBudget {
    fn drop(&mut self) {
        let mut used = std::mem::take(&mut *self.used.lock().unwrap_or_else(|p| p.into_inner()));
        self.report(&mut used);
    }
}

struct LineBuffer {
    plugin: Arc<str>,
    stream: &'static str,
    line: Vec<u8>,
    cut: usize,
    budget: Option<Arc<OutputBudget>>,
}

impl LineBuffer {
    fn push(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let (chunk, rest, newline) = match bytes.iter().position(|&b| b == b'\n') {
                Some(i) => (&bytes[..i], &bytes[i + 1..], true),
                None => (bytes, &[][..], false),
            };
            let room = MAX_LINE.saturating_sub(self.line.len()).min(chunk.len());
            self.line.extend_from_slice(&chunk[..room]);
            self.cut += chunk.len() - room;
            if newline {
                self.emit();
            }
            bytes = rest;
        }
    }

    fn emit(&mut self) {
        let admitted = self
            .budget
            .as_ref()
            .is_none_or(|b| b.admit(self.line.len()));
        if !admitted {
            self.line.clear();
            self.cut = 0;
            return;
        }
        let text = String::from_utf8_lossy(&self.line);
        let text = text.trim_end_matches('\r');
        if self.cut > 0 {
            tracing::info!(
                "[plugin {} {}] {text} … ({} more bytes cut)",
                self.plugin,
                self.stream,
                self.cut
            );
        } else {
            tracing::info!("[plugin {} {}] {text}", self.plugin, self.stream);
        }
        self.line.clear();
        self.cut = 0;
    }
}

impl Drop for LineBuffer {
    fn drop(&mut self) {
        if !self.line.is_empty() || self.cut > 0 {
            self.emit();
        }
    }
}

/// stdout or stderr of one plugin instance.
#[derive(Clone)]
pub struct LogStream(Arc<Mutex<LineBuffer>>);

impl LogStream {
    /// A stream whose lines are logged as `[plugin NAME STREAM] line`.
    pub fn new(plugin: Arc<str>, stream: &'static str) -> Self {
        Self(Arc::new(Mutex::new(LineBuffer {
            plugin,
            stream,
            line: Vec::new(),
            cut: 0,
            budget: None,
        })))
    }

    /// [`new`](Self::new), its lines counted against `budget`.
    pub fn budgeted(plugin: Arc<str>, stream: &'static str, budget: Arc<OutputBudget>) -> Self {
        let this = Self::new(plugin, stream);
        this.0.lock().unwrap_or_else(|e| e.into_inner()).budget = Some(budget);
        this
    }

    fn push(&self, bytes: &[u8]) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(bytes)
    }
}

impl IsTerminal for LogStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for LogStream {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

impl tokio::io::AsyncWrite for LogStream {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl OutputStream for LogStream {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }
    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(1 << 20)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for LogStream {
    async fn ready(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lines_are_cut_and_counted() {
        let stream = LogStream::new("p".into(), "stdout");
        stream.push(&vec![b'x'; MAX_LINE + 10]);
        stream.push(b"\nshort");
        let buf = stream.0.lock().unwrap();
        assert_eq!(
            buf.line, b"short",
            "the long line was emitted and the buffer reset"
        );
        assert_eq!(buf.cut, 0);
    }

    #[test]
    fn a_huge_write_keeps_at_most_one_line_in_memory() {
        let stream = LogStream::new("p".into(), "stdout");
        stream.push(&vec![b'y'; 10 * 1024 * 1024]);
        let buf = stream.0.lock().unwrap();
        assert_eq!(buf.line.len(), MAX_LINE);
        assert_eq!(buf.cut, 10 * 1024 * 1024 - MAX_LINE);
    }

    #[test]
    fn clip_respects_char_boundaries() {
        assert_eq!(clip("héllo", 2), "h … (5 more bytes cut)");
        assert_eq!(clip("ok", 10), "ok");
    }
}
