//! The plugin author's commands: `hearth plugins new | build | install |
//! pack | wit`. A project is a folder with a `plugin.toml` (and a
//! `Cargo.toml` for Rust, an `app.py` for Python); `build` lays out the
//! plugin folder (the manifest and the component under the manifest's
//! name) in `target/hearth-plugin/<name>/`, which `install` and `pack`
//! take.

mod build;
mod install;
mod new;

pub(super) use build::build;
pub(super) use install::{install, pack, user_plugin_dir};
pub(super) use new::{new_project, Lang};

/// hearth's WIT package, as this binary speaks it: what `hearth plugins
/// wit` prints and what a Python project is built against.
pub(super) const WIT: &str = include_str!("../../../../../wit/plugin.wit");

/// Where `build` lays out the plugin folder of the project in `dir`.
pub(super) fn built_dir(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    dir.join("target").join("hearth-plugin").join(name)
}
