//! `Accelerator::profile` and `ProfileKwargs` against PyTorch's profiler
//! and Accelerate's `accelerator.profile()`, run live on the same steps.

use crate::serial;
use hearth::accelerator::Accelerator;
use hearth_testkit::{oracle, scratch};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

/// The names and counts of a Chrome trace's events of category `cat`.
fn trace_events(trace: &Value, cat: &str) -> std::collections::BTreeMap<String, usize> {
    let mut names = std::collections::BTreeMap::new();
    for event in trace["traceEvents"].as_array().unwrap() {
        if event["cat"] == cat {
            *names
                .entry(event["name"].as_str().unwrap().to_string())
                .or_insert(0) += 1;
        }
    }
    names
}

/// `Accelerator::profile` against Accelerate's `accelerator.profile()` run
/// live (`tests/oracles/accelerate_profile.py`) on the same steps of a
/// linear layer, with the same ProfileKwargs: on_trace_ready is called at
/// the same step, the same steps are recorded (`ProfilerStep#n`), the
/// trace holds the same operators the same number of times with their
/// input shapes, and the same options at its top. hearth's own
/// `hearth::backward` span is in each recorded step.
#[test]
fn profile_records_the_steps_and_operators_accelerate_records() {
    use hearth::profiling::{ProfileKwargs, ProfilerActivity, ScheduleOption};
    let _serial = serial();
    let dir = scratch("profile");
    let oracle: Value = serde_json::from_str(
        oracle(
            "accelerate_profile.py",
            &[dir.join("accelerate").to_str().unwrap()],
        )
        .trim(),
    )
    .unwrap();

    let ready = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = ready.clone();
    let kwargs = ProfileKwargs {
        activities: Some(vec![ProfilerActivity::Cpu]),
        schedule_option: Some(ScheduleOption {
            wait: 1,
            warmup: 1,
            active: 2,
            repeat: 1,
            skip_first: 1,
            ..Default::default()
        }),
        on_trace_ready: Some(std::sync::Arc::new(move |prof| {
            seen.lock().unwrap().push(prof.step_num());
        })),
        record_shapes: true,
        with_flops: true,
        output_trace_dir: Some(dir.join("hearth")),
        ..Default::default()
    };
    let acc = Accelerator::builder()
        .cpu(true)
        .profile_kwargs(kwargs)
        .build()
        .unwrap();
    let x = Tensor::ones([4, 8], (Kind::Float, Device::Cpu));
    let w = Tensor::full([16, 8], 0.5, (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let b = Tensor::zeros([16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    acc.profile(None, |prof| {
        for _ in 0..8 {
            let loss = x.linear(&w, Some(&b)).relu().sum(Kind::Float);
            acc.backward(&loss).unwrap();
            prof.step().unwrap();
        }
    })
    .unwrap();

    assert_eq!(serde_json::json!(*ready.lock().unwrap()), oracle["ready"]);
    let read = |path: &std::path::Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let ours = read(&dir.join("hearth/profile_0.json"));
    let theirs = read(std::path::Path::new(oracle["trace"].as_str().unwrap()));
    // The one operator that differs: backward's seed gradient (ones_like
    // of the loss) is allocated by aten::empty from C++'s
    // torch::autograd::backward (contiguous format) and by
    // aten::empty_strided from Python's (preserve format).
    let ops = |trace: &Value| {
        let mut names = trace_events(trace, "cpu_op");
        if let Some(n) = names.remove("aten::empty_strided") {
            names.insert("aten::empty".into(), n);
        }
        names
    };
    assert_eq!(ops(&ours), ops(&theirs));
    assert_eq!(ops(&ours)["aten::addmm"], 2);
    let steps = |trace: &Value| {
        let mut names = trace_events(trace, "user_annotation");
        names.retain(|name, _| name.starts_with("ProfilerStep#"));
        names
    };
    assert_eq!(steps(&ours), steps(&theirs));
    assert_eq!(
        trace_events(&ours, "user_annotation")["hearth::backward"],
        2
    );

    let dims = |trace: &Value| -> Vec<Value> {
        trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "aten::addmm")
            .map(|e| e["args"]["Input Dims"].clone())
            .collect()
    };
    assert_eq!(dims(&ours), dims(&theirs));
    assert_eq!(dims(&ours).len(), 2);
    for key in ["record_shapes", "with_flops"] {
        assert_eq!(ours[key], theirs[key], "{key}");
    }
}

/// What a trace says of a scripted module's operators: the call stack and
/// module path of `aten::linear` and `aten::relu`, and whether allocations
/// were traced (the same extraction as `tests/oracles/torchscript_profile.py`).
fn stacks_modules_and_memory(trace: &Value) -> Value {
    let events = trace["traceEvents"].as_array().unwrap();
    let mut out = serde_json::json!({
        "memory": events.iter().any(|e| e["name"] == "[memory]"),
    });
    for name in ["aten::linear", "aten::relu"] {
        let first = events.iter().find(|e| e["name"] == name).unwrap();
        let mut args = first["args"].as_object().cloned().unwrap_or_default();
        args.retain(|k, _| k == "Call stack" || k == "Module Hierarchy");
        out[name] = Value::Object(args);
    }
    out
}

/// `ProfileKwargs::with_stack`, `with_modules` and `profile_memory` on a
/// TorchScript module (libtorch keeps the stacks and module paths of
/// TorchScript code only): each operator gets the call stack and module
/// path PyTorch's profiler gives it on the same saved module, and
/// allocations are traced; with the three off, none of it.
#[test]
fn stacks_modules_and_memory_are_traced_as_pytorch_traces_a_scripted_module() {
    use hearth::models::{TorchScriptModel, Unit};
    use hearth::profiling::{ProfileKwargs, ProfilerActivity};
    let _serial = serial();
    let dir = scratch("profile-script");
    let theirs: Value =
        serde_json::from_str(oracle("torchscript_profile.py", &[dir.to_str().unwrap()]).trim())
            .unwrap();
    let model = TorchScriptModel::load(&dir.join("m.pt"), Device::Cpu).unwrap();
    let traced = |on: bool| -> Value {
        let out = dir.join(format!("hearth-{on}"));
        let acc = Accelerator::builder()
            .cpu(true)
            .profile_kwargs(ProfileKwargs {
                activities: Some(vec![ProfilerActivity::Cpu]),
                with_stack: on,
                with_modules: on,
                profile_memory: on,
                output_trace_dir: Some(out.clone()),
                ..Default::default()
            })
            .build()
            .unwrap();
        let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
        let _ = acc.profile(None, |_| model.forward_t(&x, false)).unwrap();
        let text = std::fs::read_to_string(out.join("profile_0.json")).unwrap();
        stacks_modules_and_memory(&serde_json::from_str(&text).unwrap())
    };
    let on = traced(true);
    assert_eq!(on, theirs);
    assert_eq!(
        on["aten::linear"]["Module Hierarchy"],
        "TOP(Net)::forward.fc(Linear)::forward."
    );
    assert_eq!(
        traced(false),
        serde_json::json!({"memory": false, "aten::linear": {}, "aten::relu": {}})
    );
}
