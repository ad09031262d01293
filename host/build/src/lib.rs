//! The build-script side of depending on hearth.
//!
//! A binary that links hearth links libtorch, a shared library outside any
//! system folder. Cargo lets a dependency add link arguments only to its own
//! targets, so the crate that owns the binary has to put libtorch's folder
//! on its rpath itself. With this crate that is one line:
//!
//! ```toml
//! [dependencies]
//! hearth = { path = "../hearth/host/hearth" }
//! [build-dependencies]
//! hearth-build = { path = "../hearth/host/build" }
//! ```
//!
//! ```no_run
//! // build.rs, in `fn main() { … }`:
//! hearth_build::link_libtorch();
//! ```
//!
//! How it knows the folder: `hearth-ops`'s build script (`links =
//! "hearth_ops"`) publishes the folders it linked against as `rpath`
//! metadata, and `hearth` (`links = "hearth"`) passes them on, so Cargo
//! gives a crate that depends on either one `DEP_HEARTH_OPS_RPATH` or
//! `DEP_HEARTH_RPATH`. hearth's own crates call this same function.

use std::env;

/// The metadata variables this looks in, nearest layer first.
const RPATH_VARS: [&str; 2] = ["DEP_HEARTH_OPS_RPATH", "DEP_HEARTH_RPATH"];
const VERSION_VARS: [&str; 2] = ["DEP_HEARTH_OPS_TORCH_VERSION", "DEP_HEARTH_TORCH_VERSION"];

/// Puts the folders hearth linked against (libtorch's `lib/`, and NCCL's
/// with the `cuda` feature) on the rpath of every binary, test and example
/// of the calling crate, and sets `HEARTH_TORCH_VERSION` for its code.
///
/// # Panics
/// When the calling crate does not depend on `hearth` (or `hearth-ops`)
/// directly: Cargo hands a build script the metadata of its direct
/// dependencies only. The message says what to add.
pub fn link_libtorch() {
    let Some(dirs) = first_of(&RPATH_VARS) else {
        panic!(
            "hearth_build::link_libtorch: no DEP_HEARTH_RPATH in this build script's environment; \
             add `hearth` to the [dependencies] of the crate whose build.rs calls it"
        );
    };
    for dir in env::split_paths(&dirs) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    let version = first_of(&VERSION_VARS);
    if let Some(version) = &version {
        println!("cargo:rustc-env=HEARTH_TORCH_VERSION={version}");
    }
    // A crate with a `links` key (hearth itself) passes both on to its
    // dependents.
    if env::var_os("CARGO_MANIFEST_LINKS").is_some() {
        println!("cargo:rpath={dirs}");
        if let Some(version) = version {
            println!("cargo:torch_version={version}");
        }
    }
}

fn first_of(vars: &[&str]) -> Option<String> {
    vars.iter().find_map(|v| env::var(v).ok())
}
