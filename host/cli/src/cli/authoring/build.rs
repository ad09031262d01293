//! `hearth plugins build [DIR]`: builds the project in DIR for
//! wasm32-wasip2 (cargo for Rust, componentize-py for Python) and lays out
//! the plugin folder: `target/hearth-plugin/<name>/` holding `plugin.toml`
//! and the component under the manifest's `component` name. The folder is
//! then checked as `hearth plugins check` checks one.

use anyhow::{bail, Context};
use hearth_plugins::{check_plugin, Manifest, PluginKind};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Builds the project in `dir`; returns the plugin folder it laid out.
pub(in super::super) fn build(dir: &Path) -> anyhow::Result<PathBuf> {
    let manifest = Manifest::read(dir)?;
    let component = if dir.join("Cargo.toml").exists() {
        cargo_build(dir)?
    } else if dir.join("app.py").exists() {
        componentize_py(dir, &manifest)?
    } else {
        bail!(
            "{} has neither a Cargo.toml (Rust) nor an app.py (Python): `hearth plugins build` \
             builds those; a plugin built another way goes into a folder beside its plugin.toml",
            dir.display()
        );
    };
    let out = super::built_dir(dir, &manifest.name);
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::copy(dir.join("plugin.toml"), out.join("plugin.toml"))
        .with_context(|| format!("copying plugin.toml into {}", out.display()))?;
    let target = out.join(&manifest.component);
    std::fs::copy(&component, &target)
        .with_context(|| format!("copying {} to {}", component.display(), target.display()))?;
    check_plugin(&Manifest::read(&out)?)?;
    Ok(out)
}

/// `cargo build --release --target wasm32-wasip2`; the `.wasm` it made,
/// from cargo's own report of its artifacts (so CARGO_TARGET_DIR and a
/// renamed lib are followed).
fn cargo_build(dir: &Path) -> anyhow::Result<PathBuf> {
    let output = Command::new(std::env::var_os("CARGO").unwrap_or("cargo".into()))
        .args(["build", "--release", "--target", "wasm32-wasip2"])
        .args(["--message-format", "json-render-diagnostics"])
        .current_dir(dir)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo (is Rust installed, with `rustup target add wasm32-wasip2`?)")?;
    if !output.status.success() {
        bail!(
            "cargo build failed in {} (its messages are above)",
            dir.display()
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let wasm = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .flat_map(|m| {
            m["filenames"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(|f| f.as_str().map(PathBuf::from))
        })
        .rfind(|f| f.extension().is_some_and(|e| e == "wasm"));
    wasm.with_context(|| {
        format!(
            "cargo built no .wasm in {}: a plugin crate has `[lib] crate-type = [\"cdylib\"]`",
            dir.display()
        )
    })
}

/// `componentize-py -d wit -w <world> componentize app`, with the project's
/// `wit/` (what `hearth plugins new` wrote) or this hearth's WIT.
fn componentize_py(dir: &Path, manifest: &Manifest) -> anyhow::Result<PathBuf> {
    let wit = dir.join("wit");
    if !wit.join("plugin.wit").exists() {
        std::fs::create_dir_all(&wit)?;
        std::fs::write(wit.join("plugin.wit"), super::WIT)?;
    }
    let world = match manifest.kind {
        PluginKind::Tracker => "tracker-plugin",
        other => other.world(),
    };
    let out = dir.join("target").join(format!("{}.wasm", manifest.name));
    std::fs::create_dir_all(dir.join("target"))?;
    let program = std::env::var_os("COMPONENTIZE_PY").unwrap_or("componentize-py".into());
    let status = Command::new(&program)
        .arg("-d")
        .arg(&wit)
        .args(["-w", world, "componentize", "app", "-o"])
        .arg(&out)
        .current_dir(dir)
        .status()
        .with_context(|| {
            format!(
                "running {} (install it with `pip install componentize-py`, or set COMPONENTIZE_PY)",
                program.to_string_lossy()
            )
        })?;
    if !status.success() {
        bail!(
            "componentize-py failed in {} (its messages are above)",
            dir.display()
        );
    }
    Ok(out)
}
