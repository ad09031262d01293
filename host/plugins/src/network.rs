//! The network permission: which hosts a plugin may reach over
//! `wasi:http`, and the gate that checks every request before a connection.
//!
//! A plugin's `plugin.toml` asks (`[permissions] network = [...]`), the
//! run config grants (`[plugin-permissions.<name>] network = [...]`), and
//! the plugin gets the hosts in both. Each entry is `HOST:PORT` (https),
//! `http://HOST:PORT` (plain http allowed too), or either with a `*.`
//! prefix for any subdomain; a manifest may also ask `"*"`: whatever its
//! user grants (a generic tracker such as `http-json`). Names compare
//! without case; an IP literal is a host like any other, reached only
//! when granted as written.
//!
//! The gate ([`HttpGate`]) refuses, before any name lookup or connection,
//! a request whose scheme, host or port no grant covers, and one past the
//! plugin's limits (requests per minute, concurrent requests); it bounds
//! each request's time and the bytes each way. Redirects are the guest's
//! to follow, each a new request through the gate. Raw sockets stay
//! refused (the sandbox builds every plugin's WASI context without them).

use super::Limits;
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

/// One host a plugin may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRule {
    /// Plain `http://` allowed as well as https.
    pub http: bool,
    /// The host name (lower case) or IP literal; with `subdomains`, the
    /// domain whose subdomains are meant.
    pub host: String,
    /// `*.` prefix: any name ending in `.host` (not `host` itself).
    pub subdomains: bool,
    /// The port.
    pub port: u16,
}

impl HostRule {
    /// Parses `[http://][*.]HOST:PORT`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("{text:?}: {why} (write HOST:PORT, http://HOST:PORT or *.DOMAIN:PORT)")
        };
        if text == ANY_GRANTED {
            return Err(bad("a user grants hosts by name, not \"*\""));
        }
        let (http, rest) = match text.split_once("://") {
            Some(("http", rest)) => (true, rest),
            Some(("https", rest)) => (false, rest),
            Some(_) => return Err(bad("the scheme must be http or https")),
            None => (false, text),
        };
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad("the port must be 1..=65535"))?;
        let (subdomains, host) = match host.strip_prefix("*.") {
            Some(domain) => (true, domain),
            None => (false, host),
        };
        let valid = !host.is_empty()
            && host.len() <= 253
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
            && !host.starts_with('.')
            && !host.ends_with('.');
        if !valid {
            return Err(bad(
                "the host must be a DNS name or an IPv4 address (letters, digits, '-' and '.'; \
                 no '*' but a leading \"*.\", no path)",
            ));
        }
        Ok(Self {
            http,
            host: host.to_ascii_lowercase(),
            subdomains,
            port,
        })
    }

    /// Whether this rule lets a request to `host:port` over `https` (or
    /// plain http) through.
    pub fn allows(&self, https: bool, host: &str, port: u16) -> bool {
        if port != self.port || !(https || self.http) {
            return false;
        }
        let host = host.to_ascii_lowercase();
        if self.subdomains {
            host.len() > self.host.len() + 1
                && host.ends_with(&self.host)
                && host.as_bytes()[host.len() - self.host.len() - 1] == b'.'
        } else {
            host == self.host
        }
    }

    /// Whether this rule (an ask) covers all that `grant` allows.
    fn covers(&self, grant: &HostRule) -> bool {
        if grant.port != self.port || (grant.http && !self.http) {
            return false;
        }
        match (self.subdomains, grant.subdomains) {
            (false, false) => grant.host == self.host,
            (true, _) => {
                grant.host.len() > self.host.len()
                    && grant.host.ends_with(&format!(".{}", self.host))
            }
            (false, true) => false,
        }
    }
}

impl std::fmt::Display for HostRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.http { "http://" } else { "" };
        let star = if self.subdomains { "*." } else { "" };
        write!(f, "{scheme}{star}{}:{}", self.host, self.port)
    }
}

/// What a manifest may ask: hosts, or `"*"` for whatever its user grants.
pub const ANY_GRANTED: &str = "*";

/// Checks a manifest's `network` entries.
pub fn check_asks(asks: &[String]) -> Result<(), String> {
    for ask in asks.iter().filter(|a| *a != ANY_GRANTED) {
        HostRule::parse(ask)?;
    }
    Ok(())
}

/// The hosts a plugin gets: each granted entry that one of its asks
/// covers. Errors name a grant that does not parse (`"*"` among them: a
/// user grants hosts by name).
pub fn intersect(asks: &[String], grants: &[String]) -> Result<Vec<HostRule>, String> {
    let any = asks.iter().any(|a| a == ANY_GRANTED);
    let asked: Vec<HostRule> = asks
        .iter()
        .filter(|a| *a != ANY_GRANTED)
        .filter_map(|a| HostRule::parse(a).ok())
        .collect();
    let mut out = Vec::new();
    for grant in grants {
        let rule = HostRule::parse(grant)?;
        if any || asked.iter().any(|a| a.covers(&rule)) {
            out.push(rule);
        }
    }
    Ok(out)
}

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
    /// within `limits` (none at all with no rules).
    pub fn new(plugin: Arc<str>, rules: Vec<HostRule>, limits: &Limits) -> Self {
        Self {
            shared: Arc::new(Shared {
                plugin,
                rules,
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
            let sent = tokio::time::timeout_at(
                deadline.into(),
                wasmtime_wasi_http::default_send_request(request, Some(options)),
            )
            .await;
            let no_answer = || {
                gate.count(|c| c.cut += 1);
                gate.log_once(format!(
                    "a request got no answer within {} ms (request-timeout-ms)",
                    limits.timeout.as_millis()
                ));
            };
            let (response, io) = match sent {
                Ok(Ok(sent)) => sent,
                // wasmtime's own timeouts are the same deadline, and may
                // fire first.
                Ok(Err(
                    e @ (HttpError::ConnectionTimeout
                    | HttpError::ConnectionReadTimeout
                    | HttpError::ConnectionWriteTimeout
                    | HttpError::HttpResponseTimeout),
                )) => {
                    no_answer();
                    return Err(e);
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
                WasiBody::new(Limited {
                    body: http_body_util::BodyExt::boxed_unsync(body),
                    cut,
                })
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
        if Instant::now() > this.cut.deadline {
            let ms = this.cut.gate.shared.limits.timeout.as_millis();
            return Poll::Ready(Some(Err(this.cut.fail(format!(
                "cut a {what} body still moving after {ms} ms (request-timeout-ms)"
            )))));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_match_by_scheme_host_and_port() {
        let r = HostRule::parse("API.example.com:443").unwrap();
        assert!(r.allows(true, "api.example.com", 443));
        assert!(
            r.allows(true, "Api.Example.Com", 443),
            "names compare without case"
        );
        assert!(!r.allows(false, "api.example.com", 443), "https only");
        assert!(!r.allows(true, "api.example.com", 444));
        assert!(!r.allows(true, "x.api.example.com", 443));
        let http = HostRule::parse("http://127.0.0.1:8080").unwrap();
        assert!(http.allows(false, "127.0.0.1", 8080) && http.allows(true, "127.0.0.1", 8080));
        assert!(
            !http.allows(false, "localhost", 8080),
            "an IP literal is not its name"
        );
        let sub = HostRule::parse("*.wandb.ai:443").unwrap();
        assert!(sub.allows(true, "api.wandb.ai", 443));
        assert!(!sub.allows(true, "wandb.ai", 443), "subdomains only");
        assert!(!sub.allows(true, "evilwandb.ai", 443));
        for bad in [
            "example.com",
            "ftp://a:1",
            "a:0",
            "a:99999",
            "*:443",
            "a/b:1",
            "a.*.b:1",
            ":80",
            "[::1]:80",
        ] {
            assert!(HostRule::parse(bad).is_err(), "{bad} must not parse");
        }
        assert_eq!(sub.to_string(), "*.wandb.ai:443");
        assert_eq!(http.to_string(), "http://127.0.0.1:8080");
    }

    #[test]
    fn a_plugin_gets_what_it_asked_and_was_granted() {
        let asks = ["api.example.com:443".to_string(), "*.wandb.ai:443".into()];
        let got = intersect(
            &asks,
            &[
                "api.example.com:443".into(),
                "http://api.example.com:443".into(),
                "api.wandb.ai:443".into(),
                "other.com:443".into(),
            ],
        )
        .unwrap();
        let got: Vec<String> = got.iter().map(|r| r.to_string()).collect();
        assert_eq!(got, ["api.example.com:443", "api.wandb.ai:443"]);
        assert!(
            intersect(&asks, &[]).unwrap().is_empty(),
            "nothing without a grant"
        );
        let any = intersect(&["*".into()], &["http://localhost:5000".into()]).unwrap();
        assert_eq!(any.len(), 1, "\"*\" asks for whatever the user grants");
        assert!(
            intersect(&["*".into()], &["*".into()]).is_err(),
            "a user grants hosts by name"
        );
    }
}
