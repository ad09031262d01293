//! The rpath every hearth crate above `hearth-ops` gets (`../rpath.rs`),
//! and the WIT package's version (`wit/plugin.wit`) as
//! `HEARTH_WIT_VERSION`, so that it is written in one place.

#[path = "../rpath.rs"]
mod rpath;

#[path = "../../wit/package_version.rs"]
mod package_version;

fn main() {
    rpath::main();
    package_version::emit(std::path::Path::new("../../wit/plugin.wit"));
}
