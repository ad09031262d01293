//! What a component is, read before it runs: a component (not a core
//! module), which hearth interface it exports, and for which WIT version.

use super::{PluginError, PluginKind};
use wasmtime::component::Component;
use wasmtime::Engine;

/// The WIT package plugins target.
pub const WIT_PACKAGE: &str = "hearth:plugin";
/// The version of the WIT package this host speaks (`wit/plugin.wit`'s
/// `package` line, read at build time).
pub const WIT_VERSION: &str = env!("HEARTH_WIT_VERSION");

/// What a component exports, in hearth's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentReport {
    /// The hearth interfaces it exports, as `(interface, version)`.
    pub exports: Vec<(String, String)>,
    /// Everything it imports (WASI interfaces and `hearth:plugin/log`).
    pub imports: Vec<String>,
}

/// Refuses bytes that are a core module or not WebAssembly at all.
pub fn check_is_component(
    name: &str,
    path: &std::path::Path,
    bytes: &[u8],
) -> Result<(), PluginError> {
    let refuse = |reason: &str| PluginError::Refused {
        name: name.into(),
        path: path.into(),
        reason: reason.into(),
    };
    if wasmparser::Parser::is_component(bytes) {
        Ok(())
    } else if wasmparser::Parser::is_core_wasm(bytes) {
        Err(refuse(
            "it is a core WebAssembly module, not a component; build it with `cargo build --target wasm32-wasip2` \
             (or wrap it with `wasm-tools component new`)",
        ))
    } else {
        Err(refuse("it is not a WebAssembly file"))
    }
}

/// Lists the component's hearth exports and its imports.
pub fn report(engine: &Engine, component: &Component) -> ComponentReport {
    let ty = component.component_type();
    let prefix = format!("{WIT_PACKAGE}/");
    let exports = ty
        .exports(engine)
        .filter_map(|(n, _)| n.strip_prefix(&prefix))
        .map(|rest| match rest.split_once('@') {
            Some((i, v)) => (i.to_string(), v.to_string()),
            None => (rest.to_string(), String::new()),
        })
        .collect();
    let imports = ty.imports(engine).map(|(n, _)| n.to_string()).collect();
    ComponentReport { exports, imports }
}

/// Whether a plugin built for WIT `version` can run on this host (semver:
/// the same major, and while the major is 0, the same minor).
pub fn compatible(version: &str) -> bool {
    same_line(version, WIT_VERSION)
}

/// Whether WIT versions `a` and `b` can stand for each other (semver: the
/// same major, and while the major is 0, the same minor).
fn same_line(a: &str, b: &str) -> bool {
    let parse = |v: &str| -> Option<(u64, u64)> {
        let mut it = v.split('.');
        Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
    };
    match (parse(a), parse(b)) {
        (Some((maj, min)), Some((bmaj, bmin))) => maj == bmaj && (maj != 0 || min == bmin),
        _ => false,
    }
}

/// Checks that the component exports `kind`'s interface at a version this
/// host speaks and the manifest declares (`declared`, the version of its
/// `world` key), and imports nothing the host does not grant.
pub fn check_world(
    name: &str,
    path: &std::path::Path,
    kind: PluginKind,
    declared: &str,
    report: &ComponentReport,
    asks_network: bool,
) -> Result<(), PluginError> {
    let refuse = |reason: String| PluginError::Refused {
        name: name.into(),
        path: path.into(),
        reason,
    };
    let wanted = kind.interface();
    match report.exports.iter().find(|(i, _)| i == wanted) {
        Some((_, version)) if compatible(version) => {
            if !same_line(declared, version) {
                return Err(refuse(format!(
                    "its plugin.toml declares world {WIT_PACKAGE}/{}@{declared}, but the component was built for \
                     {WIT_PACKAGE}@{version}; set `world = \"{WIT_PACKAGE}/{}@{version}\"` in plugin.toml",
                    kind.world(),
                    kind.world()
                )));
            }
        }
        Some((_, version)) => {
            return Err(refuse(format!(
                "it was built for {WIT_PACKAGE}@{version}, and this host speaks {WIT_PACKAGE}@{WIT_VERSION}; \
                 rebuild it against the WIT in this hearth's wit/ folder"
            )))
        }
        None => {
            let found: Vec<String> = report.exports.iter().map(|(i, v)| format!("{i}@{v}")).collect();
            let what = match report.exports.iter().find_map(|(i, _)| PluginKind::from_interface(i)) {
                Some(other) => format!("it is a {other} plugin (exports {})", found.join(", ")),
                None => "it exports no hearth interface".to_string(),
            };
            return Err(refuse(format!(
                "plugin.toml says kind = \"{kind}\" (world {}), but {what}",
                kind.world()
            )));
        }
    }
    let http = report.imports.iter().find(|i| i.starts_with("wasi:http/"));
    if let Some(net) = http.filter(|_| !asks_network) {
        return Err(refuse(format!(
            "it imports {net}, and its plugin.toml asks for no network; a plugin that reaches \
             hosts lists them in `[permissions] network` (for componentize-js without the \
             network, build with `-d http fetch-event`)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn semver_compatibility() {
        // While 0.x, another minor is another line: this host speaks 0.3.
        assert_eq!(WIT_VERSION, "0.3.0");
        assert!(compatible("0.3.0"));
        assert!(compatible("0.3.7"));
        assert!(!compatible("0.2.0"));
        assert!(!compatible("0.4.0"));
        assert!(!compatible("1.1.0"));
        assert!(!compatible("garbage"));
    }

    #[test]
    fn core_modules_and_junk_are_refused_by_name() {
        let p = std::path::Path::new("x.wasm");
        let core = b"\0asm\x01\0\0\0";
        let err = check_is_component("core", p, core).unwrap_err().to_string();
        assert!(
            err.contains("`core`") && err.contains("core WebAssembly module"),
            "{err}"
        );
        assert!(check_is_component("junk", p, b"hello")
            .unwrap_err()
            .to_string()
            .contains("not a WebAssembly file"));
    }
}
