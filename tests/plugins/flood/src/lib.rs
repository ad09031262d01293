//! Opens 10,000 requests to its `url` option at once, without waiting for
//! any, then waits for them all and writes `answered N refused M` to
//! /logs/flood.txt. The host must contain it: its concurrent-requests limit
//! refuses all but a few, and the sandbox's cap on live resources traps it
//! long before the 10,000th handle; the run goes on.
use hearth_guest::{export_tracker, Entries, Start, Tracker, Value};
use wasip2::http::outgoing_handler::{self, FutureIncomingResponse};
use wasip2::http::types::{Fields, Method, OutgoingRequest, Scheme};

const REQUESTS: usize = 10_000;

fn open(authority: &str) -> Option<FutureIncomingResponse> {
    let request = OutgoingRequest::new(Fields::new());
    request.set_method(&Method::Get).ok()?;
    request.set_scheme(Some(&Scheme::Http)).ok()?;
    request.set_authority(Some(authority)).ok()?;
    request.set_path_with_query(Some("/flood")).ok()?;
    outgoing_handler::handle(request, None).ok()
}

#[derive(Default)]
struct Flood;

impl Tracker for Flood {
    fn start(&mut self, start: Start) -> Result<(), String> {
        let Some(Value::Text(url)) = start.option("url") else {
            return Err("set url".into());
        };
        let authority = url.trim_start_matches("http://").trim_end_matches('/');
        let opened: Vec<Option<FutureIncomingResponse>> =
            (0..REQUESTS).map(|_| open(authority)).collect();
        let (mut answered, mut refused) = (0, 0);
        for future in opened {
            let Some(future) = future else {
                refused += 1;
                continue;
            };
            let outcome = loop {
                match future.get() {
                    Some(outcome) => break outcome,
                    None => future.subscribe().block(),
                }
            };
            match outcome {
                Ok(Ok(_response)) => answered += 1,
                _ => refused += 1,
            }
        }
        let text = format!("answered {answered} refused {refused}");
        std::fs::write("/logs/flood.txt", &text).map_err(|e| e.to_string())
    }
    fn log(&mut self, _step: u64, _values: Entries) -> Result<(), String> {
        Ok(())
    }
}

export_tracker!(Flood);
