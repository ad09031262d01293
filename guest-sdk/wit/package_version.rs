//! Build-script helper shared by the host's plugin crate
//! (`host/plugins/build.rs`) and the guest SDK (`guest-sdk/build.rs`): the
//! WIT package's version is written once, in `wit/plugin.wit`'s `package`
//! line, and both crates read it from there at build time as
//! `env!("HEARTH_WIT_VERSION")`.

use std::path::Path;

/// Reads `package hearth:plugin@<version>;` from `wit` and passes the
/// version to the crate being built as `HEARTH_WIT_VERSION`.
pub fn emit(wit: &Path) {
    println!("cargo:rerun-if-changed={}", wit.display());
    let text = std::fs::read_to_string(wit)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", wit.display()));
    let version = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("package hearth:plugin@"))
        .and_then(|rest| rest.strip_suffix(';'))
        .unwrap_or_else(|| {
            panic!(
                "{} has no `package hearth:plugin@<version>;` line",
                wit.display()
            )
        });
    println!("cargo:rustc-env=HEARTH_WIT_VERSION={version}");
}
