//! Passes the WIT package's version (`wit/plugin.wit`) to the SDK as
//! `HEARTH_WIT_VERSION`, so that it is written in one place.

#[path = "../wit/package_version.rs"]
mod package_version;

fn main() {
    package_version::emit(std::path::Path::new("../wit/plugin.wit"));
}
