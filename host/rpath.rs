//! The build script of every hearth crate above `hearth-ops`: puts the
//! folders `hearth-ops` publishes (libtorch's `lib/`, and NCCL's where the
//! `cuda` feature links it) on the rpath of this crate's binaries, tests and
//! examples, so they run without `LD_LIBRARY_PATH`, and passes on libtorch's
//! version for `hearth env`.

pub fn main() {
    if let Some(dirs) = std::env::var_os("DEP_HEARTH_OPS_RPATH") {
        for dir in std::env::split_paths(&dirs) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        }
    }
    if let Ok(version) = std::env::var("DEP_HEARTH_OPS_TORCH_VERSION") {
        println!("cargo:rustc-env=HEARTH_TORCH_VERSION={version}");
    }
}
