//! Tries to leave its folder: reads /etc/passwd and the run's config via
//! `../../`, lists `../../`, writes `../../escape.txt` and `/escape.txt`.
//! Writes each outcome to /logs/attempts.txt ("ESCAPED" if one worked) and
//! returns an error listing them.
use hearth_guest::{export_tracker, Entries, Start, Tracker};

fn attempt(what: &str, result: std::io::Result<String>) -> String {
    match result {
        Ok(got) => format!(
            "ESCAPED: {what}: {}",
            got.chars().take(40).collect::<String>()
        ),
        Err(e) => format!("denied: {what}: {e}"),
    }
}

extern "C" {
    /// wasi-libc's symlink(2) (std's wrapper is unstable on WASI).
    fn symlink(target: *const std::ffi::c_char, link: *const std::ffi::c_char) -> std::ffi::c_int;
}

#[derive(Default)]
struct Snoop;

impl Tracker for Snoop {
    fn start(&mut self, _start: Start) -> Result<(), String> {
        let list = |p: &str| {
            std::fs::read_dir(p).map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| format!("{:?} ", e.file_name()))
                    .collect()
            })
        };
        let outcomes = [
            attempt("read /etc/passwd", std::fs::read_to_string("/etc/passwd")),
            attempt(
                "read /logs/../../config.toml",
                std::fs::read_to_string("/logs/../../config.toml"),
            ),
            attempt(
                "read ../../config.toml",
                std::fs::read_to_string("../../config.toml"),
            ),
            attempt("list /logs/../..", list("/logs/../..")),
            attempt("list /", list("/")),
            attempt(
                "write /logs/../../escape.txt",
                std::fs::write("/logs/../../escape.txt", "x").map(|_| String::new()),
            ),
            attempt(
                "write /escape.txt",
                std::fs::write("/escape.txt", "x").map(|_| String::new()),
            ),
            attempt(
                "env HOME",
                std::env::var("HOME").map_err(std::io::Error::other),
            ),
        ];
        // Allowed inside its folder, but a trap for host tools that follow
        // links: the host removes links when the tracker finishes.
        // SAFETY: wasi-libc's symlink(2), with NUL-terminated paths.
        unsafe { symlink(c"../../config.toml".as_ptr(), c"/logs/leak".as_ptr()) };
        let text = outcomes.join("\n");
        std::fs::write("/logs/attempts.txt", &text).map_err(|e| e.to_string())?;
        Err(text.replace('\n', "; "))
    }
    fn log(&mut self, _step: u64, _values: Entries) -> Result<(), String> {
        Ok(())
    }
}

export_tracker!(Snoop);
