//! Passes the WIT package's version to the SDK as `HEARTH_WIT_VERSION`.
//!
//! The SDK carries its own copy of the WIT (`wit/`), so that the packaged
//! crate builds plugins with no hearth checkout beside it. Inside a
//! checkout the copy must equal the project's `../wit/`, which hearth
//! itself is built from: the build stops when they differ.

#[path = "wit/package_version.rs"]
mod package_version;

use std::path::Path;

fn main() {
    let (own, project) = (Path::new("wit"), Path::new("../wit"));
    if project.join("plugin.wit").exists() {
        for file in ["plugin.wit", "package_version.rs"] {
            println!("cargo:rerun-if-changed=../wit/{file}");
            let read = |p: &Path| std::fs::read(p.join(file)).unwrap_or_default();
            if read(own) != read(project) {
                panic!(
                    "guest-sdk/wit/{file} differs from the project's wit/{file}: \
                     copy it over (cp wit/* guest-sdk/wit/), so the SDK speaks the WIT hearth does"
                );
            }
        }
    }
    package_version::emit(&own.join("plugin.wit"));
}
