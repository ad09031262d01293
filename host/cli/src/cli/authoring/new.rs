//! `hearth plugins new KIND NAME`: a ready project from the templates in
//! `host/cli/templates/`, with the SDK a Rust project needs copied in.

use anyhow::{bail, Context};
use hearth_plugins::{PluginKind, WIT_VERSION};
use std::path::Path;

/// The language of a new plugin project.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(in super::super) enum Lang {
    /// Rust with the hearth-guest SDK, built with cargo.
    Rust,
    /// Python, built with componentize-py.
    Python,
}

/// A template file: where it goes in the project, and its text.
type Template = (&'static str, &'static str);

macro_rules! template {
    ($lang:literal, $($path:literal => $file:literal),+ $(,)?) => {
        &[$(($path, include_str!(concat!("../../../templates/", $lang, "/", $file)))),+]
    };
}

/// What every Rust project has, whatever its kind.
const RUST: &[Template] = template!("rust",
    "Cargo.toml" => "Cargo.toml",
    ".gitignore" => "gitignore",
);

/// Each kind's implementation (`src/lib.rs`) and manifest, in Rust.
const RUST_KINDS: &[(PluginKind, Template, Template)] = &[
    (
        PluginKind::Tracker,
        (
            "src/lib.rs",
            include_str!("../../../templates/rust/tracker.rs"),
        ),
        (
            "plugin.toml",
            include_str!("../../../templates/rust/tracker.toml"),
        ),
    ),
    (
        PluginKind::Scheduler,
        (
            "src/lib.rs",
            include_str!("../../../templates/rust/scheduler.rs"),
        ),
        (
            "plugin.toml",
            include_str!("../../../templates/rust/scheduler.toml"),
        ),
    ),
    (
        PluginKind::WrapPolicy,
        (
            "src/lib.rs",
            include_str!("../../../templates/rust/wrap-policy.rs"),
        ),
        (
            "plugin.toml",
            include_str!("../../../templates/rust/wrap-policy.toml"),
        ),
    ),
    (
        PluginKind::CheckpointHook,
        (
            "src/lib.rs",
            include_str!("../../../templates/rust/checkpoint-hook.rs"),
        ),
        (
            "plugin.toml",
            include_str!("../../../templates/rust/checkpoint-hook.toml"),
        ),
    ),
];

/// A tracker in Python (the other kinds are Rust's so far).
const PYTHON_TRACKER: &[Template] = template!("python",
    "app.py" => "app.py",
    "lines.py" => "lines.py",
    "test_lines.py" => "test_lines.py",
    "plugin.toml" => "plugin.toml",
    ".gitignore" => "gitignore",
);

/// The SDK crate, file by file, as `guest-sdk/` holds it: copied into a
/// Rust project's `vendor/hearth-guest/`, so that it builds with no hearth
/// checkout beside it.
const SDK: &[Template] = &[
    (
        "Cargo.toml",
        include_str!("../../../../../guest-sdk/Cargo.toml"),
    ),
    (
        "build.rs",
        include_str!("../../../../../guest-sdk/build.rs"),
    ),
    (
        "src/lib.rs",
        include_str!("../../../../../guest-sdk/src/lib.rs"),
    ),
    (
        "src/checkpoint.rs",
        include_str!("../../../../../guest-sdk/src/checkpoint.rs"),
    ),
    (
        "src/files.rs",
        include_str!("../../../../../guest-sdk/src/files.rs"),
    ),
    (
        "src/http.rs",
        include_str!("../../../../../guest-sdk/src/http.rs"),
    ),
    (
        "src/outbox.rs",
        include_str!("../../../../../guest-sdk/src/outbox.rs"),
    ),
    (
        "wit/plugin.wit",
        include_str!("../../../../../guest-sdk/wit/plugin.wit"),
    ),
    (
        "wit/package_version.rs",
        include_str!("../../../../../guest-sdk/wit/package_version.rs"),
    ),
];

/// The SDK's version, from its Cargo.toml.
fn sdk_version() -> String {
    let manifest: toml::Table = toml::from_str(SDK[0].1).expect("the SDK's Cargo.toml parses");
    manifest["package"]["version"]
        .as_str()
        .expect("the SDK has a version")
        .to_string()
}

/// Writes a new `kind` plugin project called `name` in `dir` (which must
/// not exist or be empty).
pub(in super::super) fn new_project(
    kind: PluginKind,
    name: &str,
    lang: Lang,
    dir: &Path,
) -> anyhow::Result<()> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!("a plugin name is ASCII letters, digits, '-' and '_' (not {name:?}): it names the plugin in configs");
    }
    let templates: Vec<Template> = match lang {
        Lang::Rust => {
            let (_, lib, manifest) = RUST_KINDS
                .iter()
                .find(|(k, ..)| *k == kind)
                .expect("every kind has a template");
            RUST.iter().copied().chain([*lib, *manifest]).collect()
        }
        Lang::Python if kind == PluginKind::Tracker => PYTHON_TRACKER.to_vec(),
        Lang::Python => bail!(
            "`hearth plugins new` writes Python trackers; a Python {kind} works the same way \
             (componentize-py against `hearth plugins wit`, world {}), from an empty app.py",
            kind.world()
        ),
    };
    if dir.exists()
        && dir
            .read_dir()
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        bail!(
            "{} exists and is not empty; pick a new folder (--dir)",
            dir.display()
        );
    }
    let fill = |text: &str| {
        text.replace("{{name}}", name)
            .replace("{{wit}}", WIT_VERSION)
            .replace("{{sdk}}", &sdk_version())
    };
    let write = |path: &Path, text: &str| -> anyhow::Result<()> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    };
    for (path, text) in &templates {
        write(&dir.join(path), &fill(text))?;
    }
    match lang {
        Lang::Rust => {
            for (path, text) in SDK {
                write(&dir.join("vendor/hearth-guest").join(path), text)?;
            }
        }
        Lang::Python => write(&dir.join("wit/plugin.wit"), super::WIT)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Every source file of the SDK is vendored: a module left out breaks
    /// the new project's build (`http.rs` once was, for the `http` feature).
    #[test]
    fn every_sdk_source_file_is_vendored() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest-sdk/src");
        for entry in std::fs::read_dir(&src).unwrap() {
            let name = format!("src/{}", entry.unwrap().file_name().to_string_lossy());
            assert!(
                super::SDK.iter().any(|(path, _)| *path == name),
                "{name} is not vendored (add it to SDK)"
            );
        }
    }
}
