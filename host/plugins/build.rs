//! libtorch on the rpath (`hearth_build`), the WIT package's version
//! (`wit/plugin.wit`) as `HEARTH_WIT_VERSION`, so that it is written in one
//! place, and the built-in plugins embedded (`build/embed.rs`). `wit` here
//! is a link to the project's `wit/`, which `cargo package` copies in.

#[path = "wit/package_version.rs"]
mod package_version;

#[path = "build/embed.rs"]
mod embed;

fn main() {
    hearth_build::link_libtorch();
    package_version::emit(std::path::Path::new("wit/plugin.wit"));
    embed::main();
}
