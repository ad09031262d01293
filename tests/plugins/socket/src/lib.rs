//! Tries the network: TCP to 127.0.0.1:47613 (the test listens there), a UDP
//! send, and a name lookup. Records outcomes in /logs/attempts.txt and
//! returns an error listing them.
use hearth_guest::{export_tracker, Entries, Start, Tracker};
use std::net::{TcpStream, ToSocketAddrs, UdpSocket};

fn attempt<T>(what: &str, result: std::io::Result<T>) -> String {
    match result {
        Ok(_) => format!("ESCAPED: {what}"),
        Err(e) => format!("denied: {what}: {e}"),
    }
}

#[derive(Default)]
struct Socket;

impl Tracker for Socket {
    fn start(&mut self, _start: Start) -> Result<(), String> {
        let outcomes = [
            attempt("tcp 127.0.0.1:47613", TcpStream::connect("127.0.0.1:47613")),
            attempt(
                "udp send",
                UdpSocket::bind("0.0.0.0:0").and_then(|s| s.send_to(b"hi", "127.0.0.1:47613")),
            ),
            attempt(
                "resolve localhost",
                "localhost:80".to_socket_addrs().map(|a| a.count()),
            ),
        ];
        let text = outcomes.join("\n");
        std::fs::write("/logs/attempts.txt", &text).map_err(|e| e.to_string())?;
        Err(text.replace('\n', "; "))
    }
    fn log(&mut self, _step: u64, _values: Entries) -> Result<(), String> {
        Ok(())
    }
}

export_tracker!(Socket);
