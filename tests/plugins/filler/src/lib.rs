//! Tries to fill its folder: writes 1 MiB chunks into /logs/big.bin until a
//! write fails, appends one byte once more, then creates empty files until
//! that fails; prints what it managed and the errors it got (the host's
//! quota must give errors, not traps). Then logs normally.
use hearth_guest::{export_tracker, Entries, Start, Tracker};
use std::io::Write;

#[derive(Default)]
struct Filler;

fn error(e: std::io::Error) -> String {
    format!("{:?}/{}", e.kind(), e.raw_os_error().unwrap_or(-1))
}

impl Tracker for Filler {
    fn start(&mut self, _start: Start) -> Result<(), String> {
        let chunk = vec![b'x'; 1 << 20];
        let mut big = std::fs::File::create("/logs/big.bin").map_err(|e| e.to_string())?;
        let mut written = 0u64;
        let first = loop {
            match big.write(&chunk) {
                Ok(n) => written += n as u64,
                Err(e) => break error(e),
            }
            if written > 1 << 30 {
                break "none".into();
            }
        };
        drop(big);
        let append = std::fs::OpenOptions::new()
            .append(true)
            .open("/logs/big.bin")
            .and_then(|mut f| f.write_all(b"y"));
        let append = append.map_or_else(error, |()| "none".into());
        let mut files = 0;
        let file_error = loop {
            match std::fs::File::create(format!("/logs/f{files}")) {
                Ok(_) => files += 1,
                Err(e) => break error(e),
            }
            if files > 100_000 {
                break "none".into();
            }
        };
        println!("filler: bytes={written} write_error={first} append_error={append} files={files} file_error={file_error}");
        Ok(())
    }
    fn log(&mut self, _step: u64, _values: Entries) -> Result<(), String> {
        Ok(())
    }
}

export_tracker!(Filler);
