//! A small blocking HTTP client over `wasi:http`, for a plugin whose
//! `plugin.toml` asks for hosts (`[permissions] network`) and whose user
//! granted them (`[plugin-permissions.<name>] network` in the run config).
//! hearth checks every request before it connects: a host, port or scheme
//! not granted, or a request past the plugin's limits, comes back as an
//! error here, and nothing is sent. Redirects are not followed.
//!
//! ```no_run
//! let reply = hearth_guest::http::post(
//!     "http://127.0.0.1:8080/metrics",
//!     &[("content-type", "application/json")],
//!     br#"{"step": 1, "loss": 0.5}"#,
//! )?;
//! assert!(reply.status < 300);
//! # Ok::<(), String>(())
//! ```

use wasip2::http::outgoing_handler;
use wasip2::http::types::{Fields, IncomingBody, Method, OutgoingBody, OutgoingRequest, Scheme};
use wasip2::io::streams::StreamError;

/// A response: its status and its whole body.
#[derive(Debug, Clone)]
pub struct Response {
    /// The HTTP status code.
    pub status: u16,
    /// The body's bytes.
    pub body: Vec<u8>,
}

/// POSTs `body` to `url` with `headers`.
pub fn post(url: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<Response, String> {
    request("POST", url, headers, body)
}

/// GETs `url` with `headers`.
pub fn get(url: &str, headers: &[(&str, &str)]) -> Result<Response, String> {
    request("GET", url, headers, &[])
}

/// The scheme, authority (`host[:port]`) and path (with its query) of an
/// `http://` or `https://` URL.
fn split(url: &str) -> Result<(Scheme, &str, &str), String> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("https://") {
        (Scheme::Https, rest)
    } else if let Some(rest) = url.strip_prefix("http://") {
        (Scheme::Http, rest)
    } else {
        return Err(format!(
            "{url:?}: the URL must start with http:// or https://"
        ));
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    if authority.is_empty() {
        return Err(format!("{url:?}: no host"));
    }
    Ok((scheme, authority, path))
}

/// Sends a request with `method` (`GET`, `POST`, `PUT`...) and reads the
/// whole response.
pub fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Response, String> {
    let (scheme, authority, path) = split(url)?;
    let fields = Fields::new();
    // A length, not a chunked body: what simple servers read.
    if !body.is_empty() || method != "GET" {
        fields
            .append("content-length", body.len().to_string().as_bytes())
            .map_err(|e| format!("header content-length: {e:?}"))?;
    }
    for (name, value) in headers {
        fields
            .append(name, value.as_bytes())
            .map_err(|e| format!("header {name}: {e:?}"))?;
    }
    let request = OutgoingRequest::new(fields);
    let method = match method {
        "GET" => Method::Get,
        "POST" => Method::Post,
        "PUT" => Method::Put,
        "DELETE" => Method::Delete,
        "PATCH" => Method::Patch,
        "HEAD" => Method::Head,
        other => Method::Other(other.to_string()),
    };
    let refused = |what: &str| format!("{url}: {what} refused");
    request
        .set_method(&method)
        .map_err(|()| refused("method"))?;
    request
        .set_scheme(Some(&scheme))
        .map_err(|()| refused("scheme"))?;
    request
        .set_authority(Some(authority))
        .map_err(|()| refused("host"))?;
    request
        .set_path_with_query(Some(path))
        .map_err(|()| refused("path"))?;
    let outgoing = request.body().map_err(|()| refused("body"))?;
    let pending = outgoing_handler::handle(request, None).map_err(|e| format!("{url}: {e:?}"))?;
    {
        let stream = outgoing.write().map_err(|()| refused("body stream"))?;
        // blocking-write-and-flush takes at most 4096 bytes a call.
        for chunk in body.chunks(4096) {
            stream
                .blocking_write_and_flush(chunk)
                .map_err(|e| format!("{url}: sending the body: {e:?}"))?;
        }
    }
    OutgoingBody::finish(outgoing, None).map_err(|e| format!("{url}: {e:?}"))?;
    let response = loop {
        match pending.get() {
            Some(Ok(Ok(response))) => break response,
            Some(Ok(Err(e))) => return Err(format!("{url}: {e:?}")),
            Some(Err(())) => return Err(format!("{url}: the response was taken already")),
            None => pending.subscribe().block(),
        }
    };
    let status = response.status();
    let incoming = response.consume().map_err(|()| refused("response body"))?;
    let mut body = Vec::new();
    {
        let stream = incoming.stream().map_err(|()| refused("response stream"))?;
        loop {
            match stream.blocking_read(64 * 1024) {
                Ok(bytes) => body.extend_from_slice(&bytes),
                Err(StreamError::Closed) => break,
                Err(StreamError::LastOperationFailed(e)) => {
                    return Err(format!(
                        "{url}: reading the response: {}",
                        e.to_debug_string()
                    ))
                }
            }
        }
    }
    drop(IncomingBody::finish(incoming));
    Ok(Response { status, body })
}

/// `text` as one URL path segment or query value: every byte but
/// RFC 3986's unreserved characters percent-encoded.
pub fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(percent_encoded("my proj/x&y"), "my%20proj%2Fx%26y");
        assert_eq!(percent_encoded("a-b_c.d~e"), "a-b_c.d~e");
    }

    #[test]
    fn urls_split_into_scheme_authority_and_path() {
        let (s, a, p) = split("https://api.example.com:8443/v1/log?x=1").unwrap();
        assert!(matches!(s, Scheme::Https));
        assert_eq!((a, p), ("api.example.com:8443", "/v1/log?x=1"));
        let (s, a, p) = split("http://127.0.0.1:5000").unwrap();
        assert!(matches!(s, Scheme::Http));
        assert_eq!((a, p), ("127.0.0.1:5000", "/"));
        assert!(split("ftp://x/").is_err());
        assert!(split("http:///x").is_err());
    }
}
