//! libtorch on the rpath (`hearth_build`), and the WIT package's version
//! (`wit/plugin.wit`) as `HEARTH_WIT_VERSION`, so that it is written in
//! one place.

#[path = "../../wit/package_version.rs"]
mod package_version;

fn main() {
    hearth_build::link_libtorch();
    package_version::emit(std::path::Path::new("../../wit/plugin.wit"));
}
