//! Links the hearth binaries against libtorch so they run without
//! `LD_LIBRARY_PATH`, and compiles the small C++ shim in `csrc/` that binds
//! the ATen kernels tch does not expose (fused AdamW, foreach norms) and
//! libtorch's profiler (`csrc/profiler.cpp`). With
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

    // An rpath on every binary, test and bench of this crate, and the same
    // folder published to the crates above (`links = "hearth_ops"`), whose
    // build script (`hearth_build::link_libtorch`) puts it on theirs.
    rpath(&lib);
    // libtorch_cuda.so is not linked: the linker drops it (nothing refers
    // to it by symbol), and hearth opens it at run time when the NVIDIA
    // driver is present (src/cuda.rs), so a CPU run does not map it.

    let version = torch_version(&root);
    println!("cargo:rustc-env=HEARTH_TORCH_VERSION={version}");
    println!("cargo:torch_version={version}");

    println!("cargo::rustc-check-cfg=cfg(hearth_cuda_graph)");
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        link_nccl(&root);
        build_cuda_graph_library(&root);
    }

    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=csrc/shim.cpp");
    println!("cargo:rerun-if-changed=csrc/guarded.h");
    println!("cargo:rerun-if-changed=csrc/profiler.cpp");
    println!("cargo:rerun-if-changed=csrc/jit_fuse.cpp");
    println!("cargo:rerun-if-changed=csrc/jit_patterns.cpp");
    println!("cargo:rerun-if-changed=csrc/jit_values.h");
    println!("cargo:rerun-if-changed=csrc/llama_blocks.cpp");
    println!("cargo:rerun-if-changed=csrc/llama_blocks_avx2.cpp");
    println!("cargo:rerun-if-changed=csrc/jit_units.cpp");
    println!("cargo:rerun-if-changed=csrc/storage.cpp");
    println!("cargo:rerun-if-changed=csrc/jit_lazy.cpp");
    println!("cargo:rerun-if-changed=csrc/gelu.cpp");
    println!("cargo:rerun-if-changed=csrc/gelu_avx2.cpp");
    println!("cargo:rerun-if-changed=csrc/attention.cpp");
    println!("cargo:rerun-if-changed=csrc/attention_avx2.cpp");
    println!("cargo:rerun-if-changed=csrc/exp_avx2.cpp");
    println!("cargo:rerun-if-changed=csrc/avx2_exp.h");
    println!("cargo:rerun-if-changed=csrc/avx2_kernels.h");
    println!("cargo:rerun-if-changed=csrc/register_tile.h");
    println!("cargo:rerun-if-changed=csrc/tile_avx512.cpp");
    println!("cargo:rerun-if-changed=csrc/kernel_paths.h");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .std("c++17")
        .include(root.join("include"))
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .file(unity_source(&[
            "shim.cpp",
            "llama_blocks.cpp",
            "jit_patterns.cpp",
            "jit_fuse.cpp",
            "jit_units.cpp",
            "storage.cpp",
            "jit_lazy.cpp",
            "profiler.cpp",
            "gelu.cpp",
            "attention.cpp",
        ]))
        // at::parallel_for is a header template whose `#pragma omp
        // parallel` is libtorch's intra-op pool (AT_PARALLEL_OPENMP):
        // compiled without OpenMP, gelu.cpp's and attention.cpp's loops run
        // on the calling thread alone while the pool's others spin.
        .flag("-fopenmp")
        .compile("hearth_shim");
    // The OpenMP runtime libtorch itself loads (torch/lib/libgomp.so.1),
    // not the compiler's: one pool of threads for both.
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib:+verbatim=libgomp.so.1");
    // After the shim, which calls them: the linker reads libraries in order.
    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
        build_avx2_kernels(&root);
    }
}

/// One translation unit that includes the `csrc/` files given: each
/// includes libtorch's ATen headers, whose parsing is most of their
/// compile time (here 35 s for the four as one unit, ~85 s as four).
fn unity_source(files: &[&str]) -> PathBuf {
    let csrc = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("csrc");
    let text: String = files
        .iter()
        .map(|f| format!("#include \"{}\"\n", csrc.join(f).display()))
        .collect();
    let unity = PathBuf::from(env::var("OUT_DIR").expect("cargo sets it")).join("hearth_shim.cpp");
    std::fs::write(&unity, text).expect("OUT_DIR is writable");
    unity
}

/// hearth's own CPU kernels (`csrc/*_avx2.cpp`), compiled for AVX2 and
/// FMA in a library of their own, optimised whatever the profile, and
/// called only on CPUs that have both; then the AVX-512 tiles they call on
/// the avx512 path (`csrc/tile_avx512.cpp`), in a library after them (the
/// linker reads libraries in order), called only on CPUs with AVX-512F.
fn build_avx2_kernels(torch: &std::path::Path) {
    let kernels = |flags: &[&str], files: &[&str], name: &str| {
        let mut build = cc::Build::new();
        build
            .cpp(true)
            .pic(true)
            .warnings(false)
            .std("c++17")
            .opt_level(2)
            .include(torch.join("include"));
        for flag in flags {
            build.flag(flag);
        }
        build.files(files.iter().map(|f| format!("csrc/{f}")));
        build.compile(name);
    };
    kernels(
        &["-mavx2", "-mfma"],
        &[
            "gelu_avx2.cpp",
            "attention_avx2.cpp",
            "exp_avx2.cpp",
            "llama_blocks_avx2.cpp",
        ],
        "hearth_avx2_kernels",
    );
    kernels(
        &["-mavx2", "-mfma", "-mavx512f"],
        &["tile_avx512.cpp"],
        "hearth_avx512_kernels",
    );
}

/// libtorch's version from its headers (`TORCH_VERSION_MAJOR` and the
/// others), for `hearth_comm::environment::torch_version` when the wheel's
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

/// hearth's CUDA library — `csrc/cuda_graph.cpp` (CUDA graphs) and
/// `csrc/cuda_cross_entropy.cpp` (the bfloat16 cross-entropy kernels) — as
/// a shared library of its own (it calls libtorch_cuda by symbol, which
/// hearth itself must not link: see src/cuda.rs), embedded in hearth
/// through `HEARTH_CUDA_GRAPH_LIB` and the `hearth_cuda_graph` cfg. It
/// needs the CUDA runtime's, driver's and NVRTC's headers, which the CUDA
/// wheels of torch install beside it (`nvidia/cu13/include`, or
/// `nvidia/cuda_runtime/include` and `nvidia/cuda_nvrtc/include` for CUDA
/// 12); without them hearth is built without the library and says so when
/// a graph is asked for (the loss then runs on libtorch's operators).
fn build_cuda_graph_library(torch: &std::path::Path) {
    let sources = ["csrc/cuda_graph.cpp", "csrc/cuda_cross_entropy.cpp"];
    for source in sources {
        println!("cargo:rerun-if-changed={source}");
    }
    let site = torch.parent().expect("torch/ has a parent");
    let nvrtc_include = ["nvidia/cu13/include", "nvidia/cuda_nvrtc/include"]
        .iter()
        .map(|dir| site.join(dir))
        .find(|dir| dir.join("nvrtc.h").exists());
    let cuda_include = ["nvidia/cu13/include", "nvidia/cuda_runtime/include"]
        .iter()
        .map(|dir| site.join(dir))
        .find(|dir| dir.join("cuda_runtime_api.h").exists());
    // cuda_runtime.h includes crt/host_config.h, which the runtime wheel
    // leaves to the compiler's package (nvcc); Triton, which torch's CUDA
    // wheels depend on, carries a copy.
    let crt_include = [
        "nvidia/cu13/include",
        "nvidia/cuda_nvcc/include",
        "triton/backends/nvidia/include",
    ]
    .iter()
    .map(|dir| site.join(dir))
    .find(|dir| dir.join("crt/host_config.h").exists());
    let lib = torch.join("lib");
    let found = cuda_include.zip(crt_include).zip(nvrtc_include);
    let Some(((cuda_include, crt_include), nvrtc_include)) =
        found.filter(|_| lib.join("libtorch_cuda.so").exists())
    else {
        println!(
            "cargo:warning=no CUDA runtime or NVRTC headers or libtorch_cuda.so beside {}: hearth is built without CUDA graphs or its GPU cross-entropy",
            torch.display()
        );
        return;
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("libhearth_cuda_graph.so");
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let mut cmd = cc::Build::new().cpp(true).get_compiler().to_command();
    cmd.args(["-shared", "-fPIC", "-O2", "-g0", "-s", "-std=c++17", "-w"])
        .arg(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .arg("-I")
        .arg(torch.join("include"))
        .arg("-I")
        .arg(&cuda_include)
        .arg("-I")
        .arg(&crt_include)
        .arg("-I")
        .arg(&nvrtc_include)
        .args(sources)
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", lib.display()))
        .args(["-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10", "-ldl"]);
    let status = cmd.status().expect("the C++ compiler runs");
    assert!(status.success(), "compiling {sources:?} failed: {cmd:?}");
    println!("cargo:rustc-env=HEARTH_CUDA_GRAPH_LIB={}", out.display());
    println!("cargo:rustc-cfg=hearth_cuda_graph");
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
    rpath(&dir);
}

/// Puts `dir` on the rpath of this crate's own binaries and tests, and
/// adds it to the `rpath` list published to dependents.
fn rpath(dir: &std::path::Path) {
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    RPATH.with(|all| {
        let mut all = all.borrow_mut();
        all.push(dir.to_path_buf());
        let joined = env::join_paths(all.iter()).expect("rpath folders without ':'");
        println!("cargo:rpath={}", joined.to_string_lossy());
    });
}

thread_local! {
    static RPATH: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}
