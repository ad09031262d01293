//! CUDA graphs: the embedded library loads, and a captured training step
//! trains as the eager one.

use super::cuda;
use tch::Tensor;

/// The CUDA graph library hearth embeds loads and has every function
/// hearth calls, also where there is no GPU (it then needs libtorch_cuda,
/// which hearth loads only with a driver, so this test loads it itself).
#[test]
fn the_embedded_cuda_graph_library_loads() {
    if !cfg!(feature = "cuda") {
        return;
    }
    let torch_lib = hearth::ops::cuda::libtorch_folder().expect("libtorch_cpu is mapped");
    let path =
        std::ffi::CString::new(torch_lib.join("libtorch_cuda.so").to_str().unwrap()).unwrap();
    // SAFETY: a valid path; the handle stays open for the test process.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(
        !handle.is_null(),
        "libtorch_cuda.so did not load from {}",
        torch_lib.display()
    );
    hearth::ops::cuda_graph::check_embedded_library().unwrap();
}

/// `run.cuda-graph`: the captured and replayed step trains as the eager
/// one (same data, same linear schedule read from the GPU between replays,
/// clipping inside the graph), in fp32 and under bf16 autocast; the graph
/// is captured after the warm-up steps and replayed on every later step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_training_step_trains_as_the_eager_one() {
    cuda();
    let dir = std::env::temp_dir().join(format!("hearth-cuda-graph-{}", std::process::id()));
    let steps = 40u64;
    for precision in ["no", "bf16"] {
        let mut weights = Vec::new();
        for graph in [false, true] {
            let text = format!(
                r#"[run]
name = "graph-{graph}"
steps = {steps}
log-every = 10
device = "cuda"
mixed-precision = "{precision}"
cuda-graph = {graph}

[model]
kind = "gpt"
d-model = 64
layers = 2
heads = 4

[data]
kind = "sort-digits"
digits = 6
batch-size = 32

[optimizer]
kind = "adamw"
lr = 3e-3
max-grad-norm = 0.5

[scheduler]
name = "linear"
warmup-steps = 5
"#
            );
            let path = dir.join(format!("{precision}-{graph}.toml"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
            let config = hearth::train::TrainConfig::from_toml(&text, &path).unwrap();
            let options = hearth::train::RunOptions {
                output_dir: Some(dir.join(precision)),
                quiet: true,
                ..Default::default()
            };
            let summary = hearth::train::run(&config, &options).unwrap();
            eprintln!(
                "{precision} cuda-graph={graph}: loss {:.4}, {:.0} tokens/s, {:?}",
                summary.final_loss, summary.tokens_per_sec, summary.cuda_graph
            );
            if graph {
                let stats = summary.cuda_graph.expect("a graphed run reports its graph");
                let warmup = hearth::train::CUDA_GRAPH_WARMUP_STEPS;
                assert_eq!(stats.warmup_steps, warmup);
                assert_eq!(stats.captured_at_step, Some(warmup + 1));
                assert_eq!(stats.replays, steps - warmup);
            } else {
                assert!(summary.cuda_graph.is_none());
            }
            // By name: a safetensors header is a map, read in no set order.
            let named: std::collections::BTreeMap<String, Tensor> =
                Tensor::read_safetensors(&summary.model_path)
                    .unwrap()
                    .into_iter()
                    .collect();
            weights.push(named);
        }
        let (eager, graphed) = (&weights[0], &weights[1]);
        assert_eq!(
            eager.keys().collect::<Vec<_>>(),
            graphed.keys().collect::<Vec<_>>()
        );
        for ((name, a), b) in eager.iter().zip(graphed.values()) {
            let diff = f64::try_from((a - b).abs().max()).unwrap();
            let scale = f64::try_from(a.abs().max()).unwrap();
            assert!(
                diff <= 1e-3 * scale.max(1.0),
                "{precision}: {name} differs by {diff} between the eager and the captured step"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
