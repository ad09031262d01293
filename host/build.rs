//! Links the hearth binaries against libtorch so they run without
//! `LD_LIBRARY_PATH`, and compiles the small C++ shim in `csrc/` that binds
//! the ATen kernels tch does not expose (fused AdamW, foreach norms). With
//! the `cuda` feature it also puts NCCL where cudarc looks for it.

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
    // libtorch_cuda.so is not linked: the linker drops it (nothing refers
    // to it by symbol), and hearth opens it at run time when the NVIDIA
    // driver is present (src/ops/cuda.rs), so a CPU run does not map it.

    println!(
        "cargo:rustc-env=HEARTH_TORCH_VERSION={}",
        torch_version(&root)
    );

    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        link_nccl(&root);
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

/// libtorch's version from its headers (`TORCH_VERSION_MAJOR` and the
/// others), for `hearth::environment::torch_version` when the wheel's
/// `version.py` cannot be read at run time.
fn torch_version(torch: &std::path::Path) -> String {
    let header = torch.join("include/torch/headeronly/version.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let text = std::fs::read_to_string(&header).unwrap_or_default();
    let part = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("#define TORCH_VERSION_{name} ")))
            .and_then(|v| v.trim().parse::<u32>().ok())
    };
    match (part("MAJOR"), part("MINOR"), part("PATCH")) {
        (Some(major), Some(minor), Some(patch)) => format!("{major}.{minor}.{patch}"),
        _ => panic!(
            "could not read libtorch's version from {}; is LIBTORCH a libtorch 2.x?",
            header.display()
        ),
    }
}

/// cudarc opens `libnccl.so`; the nvidia-nccl wheel beside torch ships only
/// `libnccl.so.2` (the copy libtorch_cuda loads). A `libnccl.so` linked to
/// it in a folder on the rpath makes both open the same library.
fn link_nccl(torch: &std::path::Path) {
    let nccl = torch
        .parent()
        .map(|site| site.join("nvidia/nccl/lib/libnccl.so.2"))
        .filter(|p| p.exists());
    let Some(nccl) = nccl else {
        println!(
            "cargo:warning=no nvidia/nccl/lib/libnccl.so.2 beside {}: the NCCL backend will look for libnccl.so on LD_LIBRARY_PATH",
            torch.display()
        );
        return;
    };
    let dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("nccl");
    std::fs::create_dir_all(&dir).expect("OUT_DIR is writable");
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&nccl, &link).expect("a symlink in OUT_DIR");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
}
