//! Links the hearth binaries against libtorch so they run without
//! `LD_LIBRARY_PATH`, and compiles the small C++ shim in `csrc/` that binds
//! the ATen kernels tch does not expose (fused AdamW, foreach norms).

use std::env;
use std::path::PathBuf;

fn main() {
    // torch-sys (links = "tch") publishes where it found libtorch.
    let lib = PathBuf::from(
        env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not report its libtorch folder; run `make setup` first"),
    );
    let lib = lib.canonicalize().unwrap_or(lib);
    let root = lib
        .parent()
        .expect("libtorch lib folder has a parent")
        .to_path_buf();

    // An rpath on every binary, test and bench of this crate.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // Without --no-as-needed the linker drops libtorch_cuda.so (nothing
    // references it by symbol) and CUDA then reports itself unavailable.
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-L{}", lib.display());
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }

    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=csrc/shim.cpp");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .std("c++17")
        .include(root.join("include"))
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .file("csrc/shim.cpp")
        .compile("hearth_shim");
}
