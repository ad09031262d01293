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
//! The gate ([`HttpGate`], `gate.rs`) refuses, before any name lookup or
//! connection, a request whose scheme, host or port no grant covers, and
//! one past the plugin's limits (requests per minute, concurrent
//! requests); it bounds each request's time and the bytes each way.
//! hearth's own sender (`connect.rs`) then looks the name up once, keeps
//! the addresses the grant reaches (a name: public ones, unless the user
//! allows private ones) and connects to one of those. Redirects are the
//! guest's to follow, each a new request through the gate. Raw sockets
//! stay refused (the sandbox builds every plugin's WASI context without
//! them).

mod connect;
mod gate;

pub use gate::{HttpGate, NetworkCounts};

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
