//! `plugin.toml`: what a plugin is, what it may touch, and its limits.
//!
//! ```toml
//! name = "jsonl"
//! version = "0.1.0"
//! kind = "tracker"
//! world = "hearth:plugin/tracker-plugin@0.3.0"
//! component = "jsonl.wasm"
//! description = "One JSON object per logged step."
//! [permissions]
//! logging-dir = true        # trackers: read-write access to their own logging folder
//! [limits]
//! memory-mb = 64            # default 64, at most 1024
//! call-timeout-ms = 5000    # default 5000, at most 60000
//! [options.every]           # options it takes: type, default, description
//! type = "int"
//! default = 1
//! [presets]                 # options every user gets and none may set
//! ```

use super::PluginError;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a plugin customises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PluginKind {
    /// An experiment tracker (world `tracker-plugin`).
    Tracker,
    /// A learning-rate schedule (world `scheduler-plugin`).
    Scheduler,
    /// Hooks around save/load state (world `checkpoint-plugin`).
    CheckpointHook,
    /// A sharding wrap policy (world `wrap-policy-plugin`).
    WrapPolicy,
}

impl PluginKind {
    /// The WIT world a plugin of this kind targets.
    pub fn world(self) -> &'static str {
        match self {
            Self::Tracker => "tracker-plugin",
            Self::Scheduler => "scheduler-plugin",
            Self::CheckpointHook => "checkpoint-plugin",
            Self::WrapPolicy => "wrap-policy-plugin",
        }
    }

    /// The interface a component of this kind exports.
    pub fn interface(self) -> &'static str {
        match self {
            Self::Tracker => "tracker",
            Self::Scheduler => "scheduler",
            Self::CheckpointHook => "checkpoint-hook",
            Self::WrapPolicy => "wrap-policy",
        }
    }

    /// The kind whose exported interface is `interface`.
    pub fn from_interface(interface: &str) -> Option<Self> {
        [
            Self::Tracker,
            Self::Scheduler,
            Self::CheckpointHook,
            Self::WrapPolicy,
        ]
        .into_iter()
        .find(|k| k.interface() == interface)
    }
}

impl PluginKind {
    /// The kind as manifests spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tracker => "tracker",
            Self::Scheduler => "scheduler",
            Self::CheckpointHook => "checkpoint-hook",
            Self::WrapPolicy => "wrap-policy",
        }
    }
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Capabilities a plugin asks for; the host grants each only if the kind allows it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Permissions {
    /// Trackers: read-write access to their own logging folder, at `/logs` (default true).
    #[serde(default = "yes")]
    pub logging_dir: bool,
    /// Hosts it asks to reach over `wasi:http` (`HOST:PORT`,
    /// `http://HOST:PORT`, `*.DOMAIN:PORT`, or `"*"`: whatever its user
    /// grants); it reaches those a run config grants too
    /// ([`super::network`]).
    #[serde(default)]
    pub network: Vec<String>,
    /// Environment variables it asks for (an API key); it gets those a run
    /// config grants too, and no others.
    #[serde(default)]
    pub env: Vec<String>,
}

impl Default for Permissions {
    fn default() -> Self {
        Self {
            logging_dir: true,
            network: Vec::new(),
            env: Vec::new(),
        }
    }
}

/// A run config's `[plugin-permissions.<name>]`: what a user grants a
/// plugin of what its manifest asks.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PermissionGrant {
    /// Hosts it may reach: `HOST:PORT` (https), `http://HOST:PORT`, or
    /// `*.DOMAIN:PORT`; it gets those its manifest asks for too.
    #[serde(default)]
    pub network: Vec<String>,
    /// Environment variables handed to it, by name (their values are
    /// never logged).
    #[serde(default)]
    pub env: Vec<String>,
    /// Granted names may resolve to loopback, private and link-local
    /// addresses too (a tracking server inside your network); without it
    /// a granted name reaches public addresses only, and such an address
    /// is reached only when granted as an IP literal.
    #[serde(default)]
    pub private_addresses: bool,
}

/// What a plugin was granted: the part of its asks its user granted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Granted {
    /// Hosts it may reach.
    pub network: Vec<super::network::HostRule>,
    /// Environment variables it gets (names; the values are read when an
    /// instance starts).
    pub env: Vec<String>,
    /// Granted names may resolve to private addresses too.
    pub private_addresses: bool,
}

/// Whether `name` can be an environment variable's name.
fn is_env_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn yes() -> bool {
    true
}

/// Resource limits of one instance, within the host's maxima.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Limits {
    /// Linear memory cap in MiB (default 64, at most [`Limits::MAX_MEMORY_MB`]).
    #[serde(default = "default_memory_mb")]
    pub memory_mb: u64,
    /// Deadline of each call in milliseconds (default 5000, at most [`Limits::MAX_CALL_TIMEOUT_MS`]).
    #[serde(default = "default_timeout_ms")]
    pub call_timeout_ms: u64,
    /// What the plugin may store in its folder (a tracker's logging folder,
    /// what a checkpoint hook adds to a checkpoint), in MiB (default and
    /// most a manifest may ask: 1024; a run config may raise it). A write
    /// past it fails inside the plugin with "no space left on device".
    #[serde(default = "default_disk_mb")]
    pub disk_mb: u64,
    /// Files and folders the plugin may have there (default and most a
    /// manifest may ask: 10 000).
    #[serde(default = "default_files")]
    pub files: u64,
    /// Lines of stdout and stderr kept per call (default 1 000); the rest
    /// is dropped, with one line saying how much.
    #[serde(default = "default_log_lines_per_call")]
    pub log_lines_per_call: u64,
    /// Bytes of stdout and stderr kept per call (default 256 KiB).
    #[serde(default = "default_log_bytes_per_call")]
    pub log_bytes_per_call: u64,
    /// Lines of stdout and stderr kept over the whole run (default 20 000).
    #[serde(default = "default_log_lines_per_run")]
    pub log_lines_per_run: u64,
    /// Network: bytes of one request's body (default 1 MiB).
    #[serde(default = "default_request_bytes")]
    pub request_bytes: u64,
    /// Network: bytes of one response's body (default 1 MiB).
    #[serde(default = "default_response_bytes")]
    pub response_bytes: u64,
    /// Network: requests started in any minute (default 600).
    #[serde(default = "default_requests_per_minute")]
    pub requests_per_minute: u64,
    /// Network: one request's time from start to the end of its response
    /// (default 3000 ms, under the default call deadline).
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Network: requests in flight at once (default 4).
    #[serde(default = "default_concurrent_requests")]
    pub concurrent_requests: u64,
}

impl Limits {
    /// Host maximum for `memory-mb`.
    pub const MAX_MEMORY_MB: u64 = 1024;
    /// Host maximum for `call-timeout-ms`.
    pub const MAX_CALL_TIMEOUT_MS: u64 = 60_000;

    /// Raises (or lowers) these limits as a run config asks for a plugin
    /// its user trusts; the manifest cannot go past the defaults.
    pub fn overridden(mut self, o: &LimitOverrides) -> Self {
        let set = |v: &mut u64, o: Option<u64>| *v = o.unwrap_or(*v);
        set(&mut self.disk_mb, o.disk_mb);
        set(&mut self.files, o.files);
        set(&mut self.log_lines_per_call, o.log_lines_per_call);
        set(&mut self.log_bytes_per_call, o.log_bytes_per_call);
        set(&mut self.log_lines_per_run, o.log_lines_per_run);
        set(&mut self.request_bytes, o.request_bytes);
        set(&mut self.response_bytes, o.response_bytes);
        set(&mut self.requests_per_minute, o.requests_per_minute);
        set(&mut self.request_timeout_ms, o.request_timeout_ms);
        set(&mut self.concurrent_requests, o.concurrent_requests);
        self
    }

    /// The memory cap in bytes.
    pub fn memory_bytes(&self) -> usize {
        (self.memory_mb * 1024 * 1024) as usize
    }

    /// The per-call deadline.
    pub fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.call_timeout_ms)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_mb: default_memory_mb(),
            call_timeout_ms: default_timeout_ms(),
            disk_mb: default_disk_mb(),
            files: default_files(),
            log_lines_per_call: default_log_lines_per_call(),
            log_bytes_per_call: default_log_bytes_per_call(),
            log_lines_per_run: default_log_lines_per_run(),
            request_bytes: default_request_bytes(),
            response_bytes: default_response_bytes(),
            requests_per_minute: default_requests_per_minute(),
            request_timeout_ms: default_request_timeout_ms(),
            concurrent_requests: default_concurrent_requests(),
        }
    }
}

/// A run config's `[plugin-limits.<name>]`: the limits a user raises for a
/// plugin they trust (the keys of [`Limits`] that a manifest may not raise).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct LimitOverrides {
    /// See [`Limits::disk_mb`].
    pub disk_mb: Option<u64>,
    /// See [`Limits::files`].
    pub files: Option<u64>,
    /// See [`Limits::log_lines_per_call`].
    pub log_lines_per_call: Option<u64>,
    /// See [`Limits::log_bytes_per_call`].
    pub log_bytes_per_call: Option<u64>,
    /// See [`Limits::log_lines_per_run`].
    pub log_lines_per_run: Option<u64>,
    /// See [`Limits::request_bytes`].
    pub request_bytes: Option<u64>,
    /// See [`Limits::response_bytes`].
    pub response_bytes: Option<u64>,
    /// See [`Limits::requests_per_minute`].
    pub requests_per_minute: Option<u64>,
    /// See [`Limits::request_timeout_ms`].
    pub request_timeout_ms: Option<u64>,
    /// See [`Limits::concurrent_requests`].
    pub concurrent_requests: Option<u64>,
}

impl LimitOverrides {
    /// Each key and the value it sets, for checks that go over them all.
    pub fn keys(&self) -> [(&'static str, Option<u64>); 10] {
        [
            ("disk-mb", self.disk_mb),
            ("files", self.files),
            ("log-lines-per-call", self.log_lines_per_call),
            ("log-bytes-per-call", self.log_bytes_per_call),
            ("log-lines-per-run", self.log_lines_per_run),
            ("request-bytes", self.request_bytes),
            ("response-bytes", self.response_bytes),
            ("requests-per-minute", self.requests_per_minute),
            ("request-timeout-ms", self.request_timeout_ms),
            ("concurrent-requests", self.concurrent_requests),
        ]
    }
}

fn default_disk_mb() -> u64 {
    1024
}
fn default_files() -> u64 {
    10_000
}
fn default_log_lines_per_call() -> u64 {
    1_000
}
fn default_log_bytes_per_call() -> u64 {
    256 * 1024
}
fn default_log_lines_per_run() -> u64 {
    20_000
}

fn default_request_bytes() -> u64 {
    1 << 20
}
fn default_response_bytes() -> u64 {
    1 << 20
}
fn default_requests_per_minute() -> u64 {
    600
}
fn default_request_timeout_ms() -> u64 {
    3000
}
fn default_concurrent_requests() -> u64 {
    4
}

fn default_memory_mb() -> u64 {
    64
}
fn default_timeout_ms() -> u64 {
    5000
}

/// A parsed `plugin.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Manifest {
    /// Unique name, used in configs (`[[trackers]] name = "…"`).
    pub name: String,
    /// The plugin's own version.
    pub version: String,
    /// What it customises.
    pub kind: PluginKind,
    /// The world it targets, `hearth:plugin/<world>@<version>`.
    pub world: String,
    /// The component file, relative to the manifest's folder.
    pub component: PathBuf,
    /// One line on what it does.
    #[serde(default)]
    pub description: String,
    /// Capabilities asked for.
    #[serde(default)]
    pub permissions: Permissions,
    /// Resource limits.
    #[serde(default)]
    pub limits: Limits,
    /// The options it takes (`[options.<key>]`: type, default,
    /// description); see [`Manifest::checked_options`].
    #[serde(skip)]
    pub options: std::collections::BTreeMap<String, super::OptionSpec>,
    /// `[options]` as written, parsed into `options`.
    #[serde(default, rename = "options")]
    raw_options: toml::Table,
    /// Preset options, added to the user's, who may not set them. One
    /// component can so be installed under several names, each meaning
    /// one preset (the `cosine` schedule).
    #[serde(default)]
    pub presets: toml::Table,
    /// The folder holding the manifest; for a built-in embedded in the
    /// library, `<built-in>/<name>`, which is no folder.
    #[serde(skip)]
    pub dir: PathBuf,
    /// The component's bytes, for a built-in embedded in the library.
    #[serde(skip)]
    pub(crate) embedded: Option<&'static [u8]>,
    /// What its user granted of its asks ([`Manifest::with_grant`]);
    /// nothing until then.
    #[serde(skip)]
    pub granted: Granted,
    /// The sha256 its user pinned ([`Manifest::with_pin`]): a component
    /// that hashes otherwise is refused before it is compiled.
    #[serde(skip)]
    pub pin: Option<String>,
}

impl Manifest {
    /// This manifest pinned to the component whose sha256 is `pin`, when
    /// one is given.
    pub fn with_pin(&self, pin: Option<&str>) -> Manifest {
        let mut manifest = self.clone();
        if let Some(pin) = pin {
            manifest.pin = Some(pin.to_ascii_lowercase());
        }
        manifest
    }

    /// The sha256 of its component (what a pin names).
    pub fn component_sha256(&self) -> Result<String, PluginError> {
        Ok(super::pin::sha256_hex(&self.component_bytes()?))
    }

    /// This manifest with its limits raised (or lowered) as a run config's
    /// `[plugin-limits.<name>]` asks, when it does.
    pub fn with_limits(&self, raised: Option<&LimitOverrides>) -> Manifest {
        let mut manifest = self.clone();
        if let Some(o) = raised {
            manifest.limits = manifest.limits.overridden(o);
        }
        manifest
    }

    /// Checks a run config's `env` grant: names only.
    pub fn check_env_grant(names: &[String]) -> Result<(), String> {
        match names.iter().find(|n| !is_env_name(n)) {
            Some(name) => Err(format!("{name:?} is not an environment variable's name")),
            None => Ok(()),
        }
    }

    /// This manifest with what a run config's `[plugin-permissions.<name>]`
    /// grants of its asks; an error names a grant that does not parse.
    pub fn with_grant(&self, grant: Option<&PermissionGrant>) -> Result<Manifest, String> {
        let mut manifest = self.clone();
        let grant = grant.cloned().unwrap_or_default();
        Self::check_env_grant(&grant.env)?;
        manifest.granted = Granted {
            network: super::network::intersect(&self.permissions.network, &grant.network)?,
            env: (grant.env.iter())
                .filter(|n| self.permissions.env.contains(n))
                .cloned()
                .collect(),
            private_addresses: grant.private_addresses,
        };
        Ok(manifest)
    }

    /// Reads and checks `dir/plugin.toml`.
    pub fn read(dir: &Path) -> Result<Self, PluginError> {
        let path = dir.join("plugin.toml");
        let text = std::fs::read_to_string(&path).map_err(|source| PluginError::Io {
            path: path.clone(),
            source,
        })?;
        Self::parse(&text, dir)
    }

    /// Parses manifest text found in `dir`.
    pub fn parse(text: &str, dir: &Path) -> Result<Self, PluginError> {
        let path = dir.join("plugin.toml");
        let bad = |message: String| PluginError::Manifest {
            path: path.clone(),
            message,
        };
        let mut m: Self = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        m.dir = dir.to_path_buf();
        m.options = super::options::declarations(&m.raw_options).map_err(bad)?;
        if m.name.is_empty()
            || !m
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(bad(format!(
                "key `name` ({:?}) must be non-empty ASCII letters, digits, '-' or '_'",
                m.name
            )));
        }
        let expected = format!("{}/{}@", super::WIT_PACKAGE, m.kind.world());
        if !m.world.starts_with(&expected) {
            return Err(bad(format!(
                "key `world` is {:?} but kind = \"{}\" targets {expected}<version>",
                m.world, m.kind
            )));
        }
        if m.limits.memory_mb == 0 || m.limits.memory_mb > Limits::MAX_MEMORY_MB {
            return Err(bad(format!(
                "key `limits.memory-mb` must be 1..={}",
                Limits::MAX_MEMORY_MB
            )));
        }
        if m.limits.call_timeout_ms == 0 || m.limits.call_timeout_ms > Limits::MAX_CALL_TIMEOUT_MS {
            return Err(bad(format!(
                "key `limits.call-timeout-ms` must be 1..={}",
                Limits::MAX_CALL_TIMEOUT_MS
            )));
        }
        let defaults = Limits::default();
        for (key, value, most) in [
            ("disk-mb", m.limits.disk_mb, defaults.disk_mb),
            ("files", m.limits.files, defaults.files),
            (
                "log-lines-per-call",
                m.limits.log_lines_per_call,
                defaults.log_lines_per_call,
            ),
            (
                "log-bytes-per-call",
                m.limits.log_bytes_per_call,
                defaults.log_bytes_per_call,
            ),
            (
                "log-lines-per-run",
                m.limits.log_lines_per_run,
                defaults.log_lines_per_run,
            ),
            (
                "request-bytes",
                m.limits.request_bytes,
                defaults.request_bytes,
            ),
            (
                "response-bytes",
                m.limits.response_bytes,
                defaults.response_bytes,
            ),
            (
                "requests-per-minute",
                m.limits.requests_per_minute,
                defaults.requests_per_minute,
            ),
            (
                "request-timeout-ms",
                m.limits.request_timeout_ms,
                defaults.request_timeout_ms,
            ),
            (
                "concurrent-requests",
                m.limits.concurrent_requests,
                defaults.concurrent_requests,
            ),
        ] {
            if value > most {
                return Err(bad(format!(
                    "key `limits.{key}` is {value}, more than a manifest may ask ({most}); a user who \
                     trusts the plugin raises it in the run config's [plugin-limits.{}]",
                    m.name
                )));
            }
        }
        super::network::check_asks(&m.permissions.network)
            .map_err(|e| bad(format!("key `permissions.network`: {e}")))?;
        if let Some(name) = m.permissions.env.iter().find(|n| !is_env_name(n)) {
            return Err(bad(format!(
                "key `permissions.env`: {name:?} is not an environment variable's name"
            )));
        }
        if m.component.is_absolute()
            || m.component
                .components()
                .any(|c| c == std::path::Component::ParentDir)
        {
            return Err(bad(
                "key `component` must be a file inside the plugin's folder".into(),
            ));
        }
        Ok(m)
    }

    /// The component file.
    pub fn component_path(&self) -> PathBuf {
        self.dir.join(&self.component)
    }

    /// True for a built-in embedded in the library (no files on disk).
    pub fn is_embedded(&self) -> bool {
        self.embedded.is_some()
    }

    /// The component's bytes: the embedded ones, else its file's.
    pub fn component_bytes(&self) -> Result<std::borrow::Cow<'static, [u8]>, PluginError> {
        if let Some(bytes) = self.embedded {
            return Ok(bytes.into());
        }
        let path = self.component_path();
        std::fs::read(&path)
            .map(Into::into)
            .map_err(|source| PluginError::Io { path, source })
    }

    /// The WIT version this manifest declares.
    pub fn world_version(&self) -> &str {
        self.world.rsplit_once('@').map_or("", |(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "jsonl"
version = "0.1.0"
kind = "tracker"
world = "hearth:plugin/tracker-plugin@0.3.0"
component = "jsonl.wasm"
"#;

    #[test]
    fn defaults_and_paths() {
        let m = Manifest::parse(GOOD, Path::new("/p/jsonl")).unwrap();
        assert_eq!(m.limits.memory_mb, 64);
        assert!(m.permissions.logging_dir);
        assert_eq!(m.component_path(), PathBuf::from("/p/jsonl/jsonl.wasm"));
        assert_eq!(m.world_version(), crate::WIT_VERSION);
    }

    #[test]
    fn limits_above_the_host_maximum_are_refused() {
        let text = format!("{GOOD}[limits]\nmemory-mb = 4096\n");
        let err = Manifest::parse(&text, Path::new("/p/x"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("limits.memory-mb") && err.contains("/p/x/plugin.toml"),
            "{err}"
        );
    }

    #[test]
    fn a_world_that_does_not_match_the_kind_is_refused() {
        let text = GOOD.replace("tracker-plugin", "scheduler-plugin");
        let err = Manifest::parse(&text, Path::new("/p/x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("key `world`"), "{err}");
    }

    #[test]
    fn a_component_outside_the_folder_is_refused() {
        let text = GOOD.replace("jsonl.wasm", "../evil.wasm");
        assert!(Manifest::parse(&text, Path::new("/p/x")).is_err());
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = Manifest::parse(&format!("{GOOD}colour = 1\n"), Path::new("/p/x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("colour"), "{err}");
    }
}
