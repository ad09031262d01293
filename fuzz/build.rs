//! Links the fuzz targets with an rpath to libtorch, so they run without
//! LD_LIBRARY_PATH (LIBTORCH comes from the workspace's .cargo/config.toml).
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(t) = std::env::var("LIBTORCH") {
        let lib = std::path::Path::new(&t).join("lib");
        let lib = lib.canonicalize().unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
