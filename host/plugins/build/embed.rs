//! Builds the built-in plugins (`plugins/` at the repository's root) for
//! wasm32-wasip2 and writes `$OUT_DIR/builtin.rs`: every built-in's
//! `plugin.toml` and component, as bytes in the library. A program that
//! links hearth so has them wherever it runs, with no plugin folder.
//!
//! The components are built by a nested `cargo build` into the folder
//! `make plugins` uses (`target/plugins-build`), so in a checkout the two
//! share their work. `HEARTH_EMBED_PLUGINS=0` leaves them out (the library
//! then finds built-ins only through `HEARTH_BUILTIN_PLUGINS`); so does a
//! build without the plugins' sources (a packaged crate), with a warning.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "wasm32-wasip2";

pub fn main() {
    println!("cargo:rerun-if-env-changed=HEARTH_EMBED_PLUGINS");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("builtin.rs");
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = crate_dir.join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let sources = root.join("plugins");
    let embedded = if env::var("HEARTH_EMBED_PLUGINS").as_deref() == Ok("0") {
        Vec::new()
    } else if !sources.join("Cargo.toml").is_file() {
        println!(
            "cargo:warning=no built-in plugin sources at {}: this hearth embeds none; \
             set HEARTH_BUILTIN_PLUGINS to a folder of built plugins",
            sources.display()
        );
        Vec::new()
    } else {
        for watched in ["plugins", "guest-sdk/src", "guest-sdk/Cargo.toml", "wit"] {
            println!("cargo:rerun-if-changed={}", root.join(watched).display());
        }
        let target_dir = root.join("target/plugins-build");
        build(&sources, &target_dir);
        plugins(&sources, &target_dir.join(TARGET).join("release"))
    };
    std::fs::write(&out, source(&embedded)).expect("OUT_DIR is writable");
}

/// One built-in: its manifest and its component file.
struct Embedded {
    manifest: PathBuf,
    component: PathBuf,
}

/// `cargo build --release` of the plugins' workspace, in an environment
/// cleaned of what the outer build set for the host's crates.
fn build(sources: &Path, target_dir: &Path) {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .current_dir(sources)
        .args(["build", "--release", "--quiet", "--target", TARGET])
        .arg("--target-dir")
        .arg(target_dir);
    for var in [
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "RUSTC_WORKSPACE_WRAPPER",
        // The outer build's compiler paths: the nested build finds the
        // same toolchain through rustup, as `make plugins` does, so the two
        // share one build.
        "RUSTC",
        "RUSTDOC",
        "CARGO_MAKEFLAGS",
        "MAKEFLAGS",
        "MFLAGS",
    ] {
        command.env_remove(var);
    }
    let status = command.status().unwrap_or_else(|e| {
        panic!(
            "running cargo to build the built-in plugins in {}: {e}",
            sources.display()
        )
    });
    assert!(
        status.success(),
        "building the built-in plugins in {} failed (above). Is the wasm target installed? \
         `rustup target add {TARGET}`; or build without them: HEARTH_EMBED_PLUGINS=0",
        sources.display()
    );
}

/// The plugins `make plugins` installs: each crate's `plugin.toml`, or one
/// per `manifests/*.toml` (one component under several names).
fn plugins(sources: &Path, built: &Path) -> Vec<Embedded> {
    let mut manifests: Vec<(String, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(sources).expect("the plugins folder reads") {
        let dir = entry.expect("a plugins entry").path();
        let krate = dir.file_name().unwrap().to_string_lossy().into_owned();
        if dir.join("plugin.toml").is_file() {
            manifests.push((krate.clone(), dir.join("plugin.toml")));
        }
        if let Ok(more) = std::fs::read_dir(dir.join("manifests")) {
            for m in more {
                let path = m.expect("a manifests entry").path();
                if path.extension().is_some_and(|e| e == "toml") {
                    manifests.push((krate.clone(), path));
                }
            }
        }
    }
    manifests.sort();
    manifests
        .into_iter()
        .map(|(krate, manifest)| {
            let component = built.join(format!("hearth_plugin_{}.wasm", krate.replace('-', "_")));
            assert!(component.is_file(), "{} was not built", component.display());
            Embedded {
                manifest,
                component,
            }
        })
        .collect()
}

/// `BUILT_IN`, a list of (manifest text, component bytes), each component
/// included once however many manifests share it.
fn source(embedded: &[Embedded]) -> String {
    let mut components: Vec<&Path> = embedded.iter().map(|e| e.component.as_path()).collect();
    components.sort();
    components.dedup();
    let mut text = String::new();
    for (i, c) in components.iter().enumerate() {
        writeln!(
            text,
            "static COMPONENT_{i}: &[u8] = include_bytes!({:?});",
            c.display().to_string()
        )
        .unwrap();
    }
    text += "/// The built-in plugins: (manifest text, component bytes).\n";
    text += "pub(crate) static BUILT_IN: &[(&str, &[u8])] = &[\n";
    for e in embedded {
        let i = components.iter().position(|c| *c == e.component).unwrap();
        let manifest = e.manifest.display().to_string();
        writeln!(text, "    (include_str!({manifest:?}), COMPONENT_{i}),").unwrap();
    }
    text += "];\n";
    text
}
