//! The gate every `wasi:http` request of a plugin passes: grants and
//! limits checked before any name lookup, then [`connect`](super::connect)
//! for the way out, and the request's and response's bodies cut at their
//! byte and time limits.

use super::connect::{self, Reach, Unreached};
use super::HostRule;
use crate::Limits;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody, WasiHttpHooks};

/// A plugin's network limits, from its [`Limits`].
#[derive(Debug, Clone, Copy)]
struct NetLimits {
    request_bytes: u64,
    response_bytes: u64,
    per_minute: usize,
    concurrent_requests: u64,
    timeout: Duration,
}

impl From<&Limits> for NetLimits {
    fn from(l: &Limits) -> Self {
        Self {
            request_bytes: l.request_bytes,
            response_bytes: l.response_bytes,
            per_minute: l.requests_per_minute as usize,
            concurrent_requests: l.concurrent_requests,
            timeout: Duration::from_millis(l.request_timeout_ms),
        }
    }
}

/// What the gate has let through and refused, over every instance of one
/// plugin (a restarted instance shares it).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct NetworkCounts {
    /// Requests sent.
    pub sent: u64,
    /// Requests refused before any connection (not granted, over a limit).
    pub refused: u64,
    /// Requests or responses cut at a limit (bytes, time).
    pub cut: u64,
}

/// State shared by every instance of one plugin.
struct Shared {
    plugin: Arc<str>,
    rules: Vec<HostRule>,
    /// Granted names may resolve to private addresses too.
    private_addresses: bool,
    limits: NetLimits,
    /// Permits for requests in flight; one is held until the response's
    /// body is read or dropped.
    in_flight: Arc<Semaphore>,
    /// When the requests of the last minute started.
    recent: Mutex<VecDeque<Instant>>,
    /// Refusals already logged (one line per kind and host).
    logged: Mutex<HashSet<String>>,
    counts: Arc<Mutex<NetworkCounts>>,
}

/// The `wasi:http` hooks of one plugin: every outgoing request is checked
/// here first. Clones share limits and counts.
#[derive(Clone)]
pub struct HttpGate {
    shared: Arc<Shared>,
}

impl HttpGate {
    /// A gate for plugin `plugin` that lets requests to `rules` through
    /// within `limits` (none at all with no rules); with
    /// `private_addresses`, granted names may resolve to private addresses.
    pub fn new(
        plugin: Arc<str>,
        rules: Vec<HostRule>,
        private_addresses: bool,
        limits: &Limits,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                plugin,
                rules,
                private_addresses,
                limits: limits.into(),
                in_flight: Arc::new(Semaphore::new(limits.concurrent_requests as usize)),
                recent: Mutex::new(VecDeque::new()),
                logged: Mutex::new(HashSet::new()),
                counts: Arc::default(),
            }),
        }
    }

    /// What this gate has let through, refused and cut so far.
    pub fn counts(&self) -> NetworkCounts {
        *self.shared.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, f: impl FnOnce(&mut NetworkCounts)) {
        f(&mut self.shared.counts.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Logs `why` once per distinct message.
    fn log_once(&self, why: String) {
        let mut logged = self.shared.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.insert(why.clone()) {
            tracing::warn!(plugin = %self.shared.plugin, "plugin {}: {why}", self.shared.plugin);
        }
    }

    /// Lets a request through (with a permit for its time in flight) or
    /// says why not.
    fn admit(&self, request: &http::Request<WasiBody>) -> Result<OwnedSemaphorePermit, String> {
        let uri = request.uri();
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            other => return Err(format!("refused a request with scheme {other:?}")),
        };
        let Some(host) = uri.host().filter(|h| !h.is_empty()) else {
            return Err("refused a request with no host".into());
        };
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let scheme = if https { "https" } else { "http" };
        if !self
            .shared
            .rules
            .iter()
            .any(|r| r.allows(https, host, port))
        {
            let granted: Vec<String> = self.shared.rules.iter().map(|r| r.to_string()).collect();
            return Err(format!(
                "refused {scheme}://{host}:{port}: not granted (granted: {}; a user grants hosts in \
                 the run config's [plugin-permissions.{}] network)",
                if granted.is_empty() { "nothing".into() } else { granted.join(", ") },
                self.shared.plugin
            ));
        }
        let limits = self.shared.limits;
        {
            let mut recent = self.shared.recent.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            while recent
                .front()
                .is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(60))
            {
                recent.pop_front();
            }
            if recent.len() >= limits.per_minute {
                return Err(format!(
                    "refused requests past {} a minute (requests-per-minute; raise it in the run \
                     config's [plugin-limits.{}])",
                    limits.per_minute, self.shared.plugin
                ));
            }
            // Only a request let through counts toward the minute's.
            let permit = self
                .shared
                .in_flight
                .clone()
                .try_acquire_owned()
                .map_err(|_| {
                    format!(
                    "refused a request past {} in flight at once (concurrent-requests; raise it in \
                     the run config's [plugin-limits.{}])",
                    limits.concurrent_requests, self.shared.plugin
                )
                })?;
            recent.push_back(now);
            Ok(permit)
        }
    }
}

type SendResult = Result<
    (
        http::Response<WasiBody>,
        Box<dyn Future<Output = Result<(), HttpError>> + Send>,
    ),
    HttpError,
>;

impl WasiHttpHooks for HttpGate {
    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        fut: Box<dyn Future<Output = Result<(), HttpError>> + Send>,
    ) -> Box<dyn Future<Output = SendResult> + Send> {
        drop(fut);
        let permit = match self.admit(&request) {
            Ok(permit) => permit,
            Err(why) => {
                self.count(|c| c.refused += 1);
                self.log_once(why);
                return Box::new(async { Err(HttpError::HttpRequestDenied) });
            }
        };
        self.count(|c| c.sent += 1);
        // admit() checked the scheme, the host and the port.
        let uri = request.uri();
        let https = uri.scheme_str() == Some("https");
        let host = uri.host().unwrap_or_default().to_string();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let reach = Reach::of(&host, self.shared.private_addresses);
        let gate = self.clone();
        let limits = self.shared.limits;
        let deadline = Instant::now() + limits.timeout;
        let shorter =
            |asked: Option<Duration>| Some(asked.map_or(limits.timeout, |a| a.min(limits.timeout)));
        let options = options.unwrap_or_default();
        let options = RequestOptions {
            connect_timeout: shorter(options.connect_timeout),
            first_byte_timeout: shorter(options.first_byte_timeout),
            between_bytes_timeout: shorter(options.between_bytes_timeout),
        };
        let request = request.map(|body| {
            let cut = Cut::new(
                gate.clone(),
                limits.request_bytes,
                deadline,
                Side::Request,
                None,
            );
            WasiBody::new(Limited { body, cut })
        });
        Box::new(async move {
            let exchange = async {
                let addrs = match connect::resolve(&host, port, reach).await {
                    Ok(addrs) => addrs,
                    Err(Unreached::Refused(why)) => {
                        // Counted as sent when admitted: refused after all.
                        gate.count(|c| {
                            c.sent -= 1;
                            c.refused += 1;
                        });
                        gate.log_once(why);
                        return Err(HttpError::DestinationIpProhibited);
                    }
                    Err(Unreached::Lookup(e)) => {
                        return Err(HttpError::DnsError {
                            rcode: Some(e.to_string()),
                            info_code: None,
                        })
                    }
                };
                if https {
                    if let Err(why) = connect::tls() {
                        gate.log_once(why);
                        return Err(HttpError::TlsCertificateError);
                    }
                }
                connect::send(request, &addrs, &host, https, options).await
            };
            let sent = tokio::time::timeout_at(deadline.into(), exchange).await;
            let no_answer = || {
                gate.count(|c| c.cut += 1);
                gate.log_once(format!(
                    "a request got no answer within {} ms (request-timeout-ms)",
                    limits.timeout.as_millis()
                ));
            };
            let (response, io) = match sent {
                Ok(Ok(sent)) => sent,
                Ok(Err(
                    e @ (HttpError::ConnectionTimeout
                    | HttpError::ConnectionReadTimeout
                    | HttpError::ConnectionWriteTimeout
                    | HttpError::HttpResponseTimeout),
                )) => {
                    no_answer();
                    return Err(e);
                }
                Ok(Err(HttpError::Tls(e))) => {
                    gate.log_once(format!(
                        "TLS with {host}:{port} failed: {e} (a certificate hearth does not trust? \
                         SSL_CERT_FILE adds a PEM file of certificate authorities)"
                    ));
                    return Err(HttpError::Tls(e));
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    no_answer();
                    return Err(HttpError::HttpResponseTimeout);
                }
            };
            let response = response.map(|body| {
                let cut = Cut::new(
                    gate,
                    limits.response_bytes,
                    deadline,
                    Side::Response,
                    Some(permit),
                );
                WasiBody::new(Limited { body, cut })
            });
            Ok((response, Box::new(io) as Box<dyn Future<Output = _> + Send>))
        })
    }
}

#[derive(Clone, Copy)]
enum Side {
    Request,
    Response,
}

/// What a body may still carry, and until when.
struct Cut {
    gate: HttpGate,
    left: u64,
    limit: u64,
    deadline: Instant,
    side: Side,
    /// Wakes a body that stalls at the deadline (made on the first wait).
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The request's place among those in flight, given back with the body.
    _permit: Option<OwnedSemaphorePermit>,
}

impl Cut {
    fn new(
        gate: HttpGate,
        limit: u64,
        deadline: Instant,
        side: Side,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Self {
        Self {
            gate,
            left: limit,
            limit,
            deadline,
            side,
            timer: None,
            _permit: permit,
        }
    }

    fn fail(&self, why: String) -> HttpError {
        self.gate.count(|c| c.cut += 1);
        self.gate.log_once(why);
        match self.side {
            Side::Request => HttpError::HttpRequestBodySize(Some(self.limit)),
            Side::Response => HttpError::HttpResponseBodySize(Some(self.limit)),
        }
    }
}

/// A body cut at a byte count and a deadline.
struct Limited {
    body: WasiBody,
    cut: Cut,
}

impl Body for Limited {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        let this = &mut *self;
        let (what, key) = match this.cut.side {
            Side::Request => ("request", "request-bytes"),
            Side::Response => ("response", "response-bytes"),
        };
        let late = |cut: &Cut| {
            let ms = cut.gate.shared.limits.timeout.as_millis();
            cut.fail(format!(
                "cut a {what} body still moving after {ms} ms (request-timeout-ms)"
            ))
        };
        if Instant::now() > this.cut.deadline {
            return Poll::Ready(Some(Err(late(&this.cut))));
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                if len > this.cut.left {
                    let limit = this.cut.limit;
                    return Poll::Ready(Some(Err(this.cut.fail(format!(
                        "cut a {what} body past {limit} bytes ({key}; raise it in the run config's \
                         [plugin-limits.{}])",
                        this.cut.gate.shared.plugin
                    )))));
                }
                this.cut.left -= len;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => {
                // A body that stalls is woken at the deadline and cut.
                let deadline = this.cut.deadline;
                let timer = (this.cut.timer)
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.into())));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(late(&this.cut)))),
                    Poll::Pending => Poll::Pending,
                }
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
