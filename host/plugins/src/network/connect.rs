//! hearth's own way out for a request the gate let through. The name is
//! looked up here, once; every address it gives is checked, and the
//! connection goes to a checked address, so a name cannot be checked at
//! one address and reached at another (DNS rebinding). Then TLS (rustls,
//! the webpki roots, the URL's host as the server name) where the URL says
//! https, and one HTTP/1.1 exchange (hyper).
//!
//! Which addresses a granted host reaches:
//! - an IP literal: that address, as granted;
//! - `localhost` (and `*.localhost`): loopback addresses only;
//! - any other name: public addresses only, unless the user sets
//!   `private-addresses = true` for the plugin. A name that resolves to a
//!   loopback, private, link-local or otherwise special address (a cloud's
//!   metadata service at 169.254.169.254, a service inside the user's
//!   network) is refused, naming the address.

use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody};

/// Which addresses a granted host may be reached at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// An IP literal: itself.
    Literal(IpAddr),
    /// `localhost`: loopback addresses.
    Loopback,
    /// A name: public addresses.
    Public,
    /// A name, with `private-addresses = true`: any unicast address.
    Anywhere,
}

impl Reach {
    /// What `host` (a granted one) may reach.
    pub fn of(host: &str, private_addresses: bool) -> Self {
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Reach::Literal(ip);
        }
        let host = host.to_ascii_lowercase();
        if host == "localhost" || host.ends_with(".localhost") {
            Reach::Loopback
        } else if private_addresses {
            Reach::Anywhere
        } else {
            Reach::Public
        }
    }

    fn allows(self, ip: IpAddr) -> bool {
        match self {
            Reach::Literal(granted) => ip == granted,
            Reach::Loopback => ip.is_loopback(),
            Reach::Public => is_public(ip),
            Reach::Anywhere => !ip.is_unspecified() && !ip.is_multicast(),
        }
    }
}

/// Whether `ip` is an address of the public internet: not loopback,
/// private (RFC 1918, unique local), link-local, shared (RFC 6598),
/// unspecified, multicast, broadcast, documentation, benchmarking or
/// reserved; an IPv4-mapped IPv6 address is judged by its IPv4 address.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_public_v4(v4),
            None => is_public_v6(v6),
        },
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    !(ip.is_private()
        || ip.is_loopback()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // shared, RFC 6598
        || (a == 198 && (18..20).contains(&b)) // benchmarking, RFC 2544
        || (a == 192 && b == 0 && ip.octets()[2] == 0) // IETF protocol assignments
        || a >= 240) // reserved
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let first = s[0];
    let embedded =
        |hi: u16, lo: u16| Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8);
    // Addresses that carry an IPv4 address are judged by it: NAT64
    // (64:ff9b::/96 and the local-use 64:ff9b:1::/48), 6to4 (2002::/16),
    // IPv4-compatible (::/96).
    if (s[0], s[1]) == (0x64, 0xff9b) {
        return is_public_v4(embedded(s[6], s[7]));
    }
    if first == 0x2002 {
        return is_public_v4(embedded(s[1], s[2]));
    }
    if s[..6] == [0; 6] && !ip.is_loopback() && !ip.is_unspecified() {
        return is_public_v4(embedded(s[6], s[7]));
    }
    !(ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local, fc00::/7
        || (first & 0xffc0) == 0xfe80 // link-local, fe80::/10
        || (first & 0xffc0) == 0xfec0 // site-local (deprecated), fec0::/10
        || (first == 0x2001 && ip.segments()[1] == 0x0db8)) // documentation
}

/// Why a request went no further than the name lookup.
pub enum Unreached {
    /// The name resolves only to addresses its grant does not reach.
    Refused(String),
    /// The lookup failed.
    Lookup(std::io::Error),
}

/// The addresses of `host:port` that `reach` allows, looked up once.
pub async fn resolve(host: &str, port: u16, reach: Reach) -> Result<Vec<SocketAddr>, Unreached> {
    if let Reach::Literal(ip) = reach {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let found: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(Unreached::Lookup)?
        .collect();
    let allowed: Vec<SocketAddr> = found
        .iter()
        .copied()
        .filter(|a| reach.allows(a.ip()))
        .collect();
    if !allowed.is_empty() {
        return Ok(allowed);
    }
    let addresses: Vec<String> = found.iter().map(|a| a.ip().to_string()).collect();
    let rule = match reach {
        Reach::Loopback => "localhost reaches loopback addresses only",
        _ => "a granted name reaches public addresses only: grant the address itself, or set \
              private-addresses = true in the run config's [plugin-permissions] table for the plugin",
    };
    Err(Unreached::Refused(format!(
        "refused {host}:{port}: the name resolves to {} ({rule})",
        if addresses.is_empty() {
            "nothing".into()
        } else {
            addresses.join(", ")
        }
    )))
}

/// The TLS client setup every https request shares: the webpki roots, and
/// the certificates of the PEM file `SSL_CERT_FILE` names (a company's own
/// certificate authority), read once.
static TLS: LazyLock<Result<Arc<rustls::ClientConfig>, String>> = LazyLock::new(|| {
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.into(),
    };
    if let Some(file) = std::env::var_os("SSL_CERT_FILE").filter(|f| !f.is_empty()) {
        let shown = std::path::Path::new(&file).display().to_string();
        let bad = |e: &dyn std::fmt::Display| {
            format!("SSL_CERT_FILE {shown}: {e} (it must name a PEM file of certificates)")
        };
        let certs = CertificateDer::pem_file_iter(&file).map_err(|e| bad(&e))?;
        let mut added = 0;
        for cert in certs {
            roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
            added += 1;
        }
        if added == 0 {
            return Err(bad(&"no certificate in it"));
        }
        tracing::info!("https: trusting {added} certificate(s) from SSL_CERT_FILE {shown} beside the webpki roots");
    }
    Ok(Arc::new(
        rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    ))
});

/// The shared TLS setup, or why it cannot be made.
pub fn tls() -> Result<Arc<rustls::ClientConfig>, String> {
    TLS.clone()
}

/// A connection, plain or TLS.
trait Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Stream for T {}

/// Sends `request` to one of `addrs` (the first that answers), over TLS
/// with `host` as the server name when `https`. Returns the response, its
/// body still to come, and the future that drives the connection to its
/// end.
pub async fn send(
    mut request: http::Request<WasiBody>,
    addrs: &[SocketAddr],
    host: &str,
    https: bool,
    options: RequestOptions,
) -> Result<
    (
        http::Response<WasiBody>,
        impl Future<Output = Result<(), HttpError>> + Send + 'static,
    ),
    HttpError,
> {
    let connect_timeout = options.connect_timeout.unwrap_or(Duration::from_secs(600));
    let tcp = tokio::time::timeout(connect_timeout, TcpStream::connect(addrs))
        .await
        .map_err(|_| HttpError::ConnectionTimeout)?
        .map_err(HttpError::Connect)?;
    let stream: Box<dyn Stream> = if https {
        let name = match host.parse::<IpAddr>() {
            Ok(ip) => rustls::pki_types::ServerName::from(ip),
            Err(_) => rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|_| HttpError::HttpRequestUriInvalid)?,
        };
        let config = tls().map_err(|_| HttpError::TlsCertificateError)?;
        let tls = tokio_rustls::TlsConnector::from(config);
        Box::new(
            tokio::time::timeout(connect_timeout, tls.connect(name, tcp))
                .await
                .map_err(|_| HttpError::ConnectionTimeout)?
                .map_err(HttpError::Tls)?,
        )
    } else {
        Box::new(tcp)
    };
    let (mut sender, connection) = tokio::time::timeout(
        connect_timeout,
        hyper::client::conn::http1::handshake(TokioIo::new(stream)),
    )
    .await
    .map_err(|_| HttpError::ConnectionTimeout)??;
    // On the wire the request line carries the path only (the host is in
    // the Host header wasmtime set).
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    *request.uri_mut() = path.parse().map_err(|_| HttpError::HttpRequestUriInvalid)?;

    let mut connection = Box::pin(connection);
    let mut ended = None;
    let first_byte = options
        .first_byte_timeout
        .unwrap_or(Duration::from_secs(600));
    let answered = tokio::time::timeout(first_byte, async {
        let response = sender.send_request(request);
        tokio::pin!(response);
        // The connection is driven while the answer comes; if it ends
        // first, the answer is already there or never will be.
        tokio::select! {
            biased;
            response = &mut response => response,
            end = &mut connection => {
                ended = Some(end);
                response.await
            }
        }
    })
    .await
    .map_err(|_| HttpError::ConnectionReadTimeout)??;
    let io = async move {
        match ended {
            Some(end) => end,
            None => connection.await,
        }
        .map_err(HttpError::from)
    };
    let response = answered.map(|body| body.map_err(HttpError::from).boxed_unsync());
    Ok((response, io))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn public_addresses_are_told_from_special_ones() {
        for public in [
            "93.184.215.14",
            "8.8.8.8",
            "2606:4700::1111",
            "::ffff:1.1.1.1",
            "64:ff9b::808:808",
        ] {
            assert!(is_public(ip(public)), "{public}");
        }
        for special in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "192.0.2.1",
            "198.18.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "ff02::1",
            "2001:db8::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a00:5",
            "64:ff9b:1::a00:5",
            "2002:a00:5::1",
            "::a00:5",
            "fec0::1",
            "192.0.0.8",
        ] {
            assert!(!is_public(ip(special)), "{special}");
        }
    }

    #[test]
    fn each_grant_reaches_its_own_addresses() {
        assert_eq!(Reach::of("10.0.0.5", false), Reach::Literal(ip("10.0.0.5")));
        assert!(Reach::of("10.0.0.5", false).allows(ip("10.0.0.5")));
        assert!(!Reach::of("10.0.0.5", false).allows(ip("10.0.0.6")));
        assert!(Reach::of("LocalHost", false).allows(ip("::1")));
        assert!(!Reach::of("localhost", false).allows(ip("10.0.0.5")));
        assert!(!Reach::of("dash.example.com", false).allows(ip("169.254.169.254")));
        assert!(Reach::of("dash.example.com", false).allows(ip("93.184.215.14")));
        assert!(Reach::of("mlflow.corp", true).allows(ip("10.0.0.5")));
        assert!(!Reach::of("mlflow.corp", true).allows(ip("0.0.0.0")));
    }

    #[tokio::test]
    async fn a_name_that_resolves_to_loopback_is_refused_naming_the_address() {
        match resolve("localhost", 80, Reach::Public).await {
            Err(Unreached::Refused(why)) => {
                assert!(
                    why.contains("resolves to")
                        && (why.contains("127.0.0.1") || why.contains("::1")),
                    "{why}"
                );
                assert!(why.contains("private-addresses = true"), "{why}");
            }
            Ok(addrs) => panic!("reached {addrs:?}"),
            Err(Unreached::Lookup(e)) => panic!("lookup failed: {e}"),
        }
        let found = resolve("localhost", 80, Reach::Loopback)
            .await
            .ok()
            .unwrap();
        assert!(found.iter().all(|a| a.ip().is_loopback() && a.port() == 80));
    }
}
