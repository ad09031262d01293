//! The Accelerator against Accelerate and PyTorch: RNG state,
//! `find_executable_batch_size` on a real libtorch out-of-memory error,
//! schedulers, prepare and unwrap, saving on the right processes,
//! Accelerate's enum spellings, DDP options and `free_memory`.
//! Accumulation, precision, the data loader and trackers have files of
//! their own.

use hearth_testkit as common;

use common::oracle;
use hearth::accelerator::{find_executable_batch_size, Accelerator, BatchSizeError, LrSchedule};
use hearth::optim::Sgd;
use hearth::plugins::PluginError;
use hearth::precision::MixedPrecision;
use serde_json::Value;
use tch::nn::{self};
use tch::{Device, Kind, Tensor};

use crate::{linear_schedule, serial, sgd, FakeWorld, Place};

#[test]
fn rng_state_round_trips() {
    let _serial = serial();
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    acc.set_seed(123, false, false);
    let state = acc.rng_state().unwrap();
    let a = Tensor::randn([5], (Kind::Float, Device::Cpu));
    let _ = Tensor::randn([7], (Kind::Float, Device::Cpu));
    acc.set_rng_state(&state).unwrap();
    let b = Tensor::randn([5], (Kind::Float, Device::Cpu));
    assert!(a.equal(&b));
}

#[test]
fn find_executable_batch_size_backs_off_on_a_real_out_of_memory_error() {
    let mut tried = Vec::new();
    let fits = find_executable_batch_size(64, |bs| {
        tried.push(bs);
        // Above 40, ask libtorch for a petabyte: its allocator refuses.
        let elems = if bs > 40 { 1i64 << 48 } else { 16 };
        Tensor::f_empty([elems], (Kind::Float, Device::Cpu)).map(|_| bs)
    })
    .unwrap();
    assert_eq!(fits, 40);
    assert_eq!(tried, vec![64, 57, 51, 45, 40]);
    let other = find_executable_batch_size(8, |_| {
        Tensor::f_zeros([2], (Kind::Float, Device::Cpu)).and_then(|t| t.f_view([3]))
    });
    assert!(matches!(other, Err(BatchSizeError::Failed(_))));
}

/// A world of `n` processes in which this one has index `rank`; nothing
/// is communicated (enough for what is decided per process).
#[test]
fn a_scheduler_steps_once_per_process_unless_batches_are_split() {
    for (split, per_step) in [(false, 2), (true, 1)] {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .process_group(Box::new(FakeWorld { rank: 0, n: 2 }))
            .split_batches(split)
            // A bare parameter, in no model: deliberately not synchronised.
            .check_prepared(false)
            .build()
            .unwrap();
        let p = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let opt = Sgd::new(vec![p.shallow_clone()], sgd(1.0, 0.0));
        let schedule = linear_schedule(1.0);
        let (mut opt, mut sched) = acc.prepare((opt, schedule)).unwrap();
        for _ in 0..3 {
            acc.accumulate(|| {
                acc.backward(&p.sum(Kind::Float)).unwrap();
                opt.step().unwrap();
                sched.step().unwrap();
                opt.zero_grad();
            });
        }
        assert_eq!(sched.steps(), 3 * per_step, "split_batches = {split}");
        assert!((opt.lr() - (1.0 - (3 * per_step) as f64 / 10.0)).abs() < 1e-12);
    }
}

#[test]
fn scheduler_state_round_trips_and_sets_the_rate() {
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let make = |acc: &mut Accelerator| {
        let p = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let opt = Sgd::new(vec![p.shallow_clone()], sgd(1.0, 0.0));
        let schedule = linear_schedule(1.0);
        let prepared = acc.prepare((opt, schedule)).unwrap();
        (p, prepared)
    };
    let (p, (mut opt, mut sched)) = make(&mut acc);
    for _ in 0..4 {
        acc.accumulate(|| {
            acc.backward(&p.sum(Kind::Float)).unwrap();
            opt.step().unwrap();
            sched.step().unwrap();
            opt.zero_grad();
        });
    }
    let (step, bytes) = sched.state().unwrap();
    let (_, (opt2, mut sched2)) = make(&mut acc);
    assert_eq!(opt2.lr(), 1.0);
    sched2.load_state(step, &bytes).unwrap();
    assert_eq!(sched2.steps(), 4);
    assert!((opt2.lr() - 0.6).abs() < 1e-12 && (opt.lr() - 0.6).abs() < 1e-12);
}

#[test]
fn prepare_twice_is_harmless_and_unwrap_gives_the_model_back() {
    let _serial = serial();
    use hearth::models::{Gpt, GptConfig, Model};
    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    let gpt = Gpt::new(
        GptConfig {
            vocab_size: 11,
            block_size: 8,
            d_model: 16,
            layers: 1,
            heads: 2,
        },
        Device::Cpu,
    );
    let names: Vec<String> = gpt.named_parameters().into_iter().map(|(n, _)| n).collect();
    let opt = Sgd::new(
        gpt.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect::<Vec<_>>(),
        sgd(0.1, 0.0),
    );
    let (model, opt) = acc.prepare((gpt, opt)).unwrap();
    let (model, opt) = acc.prepare((model, opt)).unwrap();
    assert_eq!(opt.parameters().len(), names.len());
    let state = acc.get_state_dict(&model);
    assert_eq!(
        state.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
        names
    );
    let gpt: Gpt = acc.unwrap_model(model);
    assert_eq!(gpt.named_parameters().len(), names.len());
    acc.free_memory(opt).unwrap();
}

#[test]
fn save_writes_from_the_main_process_only() {
    let dir = common::scratch("acc-save");
    let tensors = vec![(
        "w".to_string(),
        Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]),
    )];
    for rank in [1, 0] {
        let acc = Accelerator::builder()
            .cpu(true)
            .process_group(Box::new(FakeWorld { rank, n: 2 }))
            .build()
            .unwrap();
        let path = dir.join("extra.safetensors");
        assert_eq!(acc.save(&tensors, &path).unwrap(), rank == 0);
        assert_eq!(path.exists(), rank == 0, "rank {rank}");
    }
    let back =
        hearth::checkpoint::load_safetensors(&dir.join("extra.safetensors"), Device::Cpu).unwrap();
    assert_eq!(back[0].0, "w");
    assert!(back[0].1.equal(&tensors[0].1));
}

#[test]
fn a_model_in_a_world_without_collectives_is_refused_naming_the_broadcast() {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .process_group(Box::new(FakeWorld { rank: 0, n: 2 }))
        .build()
        .unwrap();
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _layer = nn::linear(vs.root(), 2, 2, Default::default());
    let err = acc.prepare(vs).err().unwrap();
    let source = std::error::Error::source(&err).unwrap().to_string();
    assert!(err.to_string().contains("rank 0's parameters"), "{err}");
    assert!(
        source.contains("broadcast") && source.contains("no collectives"),
        "{source}"
    );
}

/// A schedule that returns the given rates at every step.
struct Fixed(Vec<f64>);

impl LrSchedule for Fixed {
    fn lrs(&mut self, _: u64) -> Result<Vec<f64>, PluginError> {
        Ok(self.0.clone())
    }
}

/// Issue 18, item 4: a schedule of the user's that returns the wrong
/// number of rates (or an impossible rate) is an error naming the count
/// and the groups, not silently ignored.
#[test]
fn a_schedule_returning_the_wrong_number_of_rates_is_an_error() {
    let _serial = serial();
    let prepare = |rates: Vec<f64>| {
        let mut acc = Accelerator::builder().cpu(true).build().unwrap();
        let params =
            |n| vec![Tensor::ones([n], (Kind::Float, Device::Cpu)).set_requires_grad(true)];
        let opt = Sgd::new(
            vec![
                hearth::optim::ParamGroup::new(params(2)),
                hearth::optim::ParamGroup::new(params(3)),
            ],
            sgd(0.1, 0.0),
        );
        let schedule: Box<dyn LrSchedule> = Box::new(Fixed(rates));
        acc.prepare((opt, schedule))
    };
    let (opt, mut sched) = prepare(vec![0.5, 0.25]).unwrap();
    sched.step().unwrap();
    assert_eq!(opt.lrs(), [0.5, 0.25]);
    let (opt, mut sched) = prepare(vec![0.5]).unwrap();
    sched.step().unwrap();
    assert_eq!(opt.lrs(), [0.5, 0.5], "one rate is for every group");
    let chain = |e: &dyn std::error::Error| {
        let mut text = e.to_string();
        let mut at = e.source();
        while let Some(cause) = at {
            text = format!("{text}: {cause}");
            at = cause.source();
        }
        text
    };
    // Prepare asks for the first rates already.
    let error = |rates| match prepare(rates) {
        Err(e) => chain(&e),
        Ok((_, mut sched)) => chain(&sched.step().unwrap_err()),
    };
    let e = error(vec![0.1, 0.2, 0.3]);
    assert!(
        e.contains("returned 3 rates") && e.contains("2 parameter groups"),
        "{e}"
    );
    let e = error(vec![f64::NAN, 0.1]);
    assert!(e.contains("NaN") && e.contains("finite"), "{e}");
}

/// Every value of `enum` in Accelerate's own list either parses to a hearth
/// value of the same spelling or is refused with `refusal` in the message;
/// every hearth value is one of Accelerate's. Returns the values refused.
fn same_spellings<T>(
    accelerate: &Value,
    name: &str,
    hearth: &[T],
    spell: impl Fn(&T) -> String,
    parse: impl Fn(&str) -> Result<T, String>,
    refusal: &str,
) -> Vec<String> {
    let theirs: Vec<String> = serde_json::from_value(accelerate[name].clone()).unwrap();
    let mut refused = Vec::new();
    for value in &theirs {
        match parse(value) {
            Ok(t) => assert_eq!(&spell(&t), value, "{name} {value}"),
            Err(e) => {
                assert!(e.contains(refusal), "{name} {value}: {e}");
                refused.push(value.clone());
            }
        }
        // Accelerate's enums are case-insensitive where hearth parses.
        if let Ok(t) = parse(&value.to_ascii_uppercase()) {
            assert_eq!(&spell(&t), value);
        }
    }
    for t in hearth {
        assert!(
            theirs.contains(&spell(t)),
            "{name} {} is not Accelerate's",
            spell(t)
        );
    }
    let unknown = parse("no-such-value")
        .err()
        .expect("an unknown value is refused");
    assert!(unknown.contains("no-such-value"), "{unknown}");
    refused
}

#[test]
fn accelerates_enum_values_parse_with_its_spellings_or_say_why_not() {
    use hearth::accelerator::{LoggerType, RngType};
    use hearth::comm::DistributedType;
    let accelerate: Value = serde_json::from_str(&oracle("accelerate_enums.py", &[])).unwrap();
    let refused = same_spellings(
        &accelerate,
        "DistributedType",
        &[
            DistributedType::No,
            DistributedType::MultiCpu,
            DistributedType::MultiGpu,
            DistributedType::Fsdp,
        ],
        |t| t.to_string(),
        str::parse,
        "hearth does not drive",
    );
    assert!(refused.contains(&"DEEPSPEED".to_string()), "{refused:?}");
    let refused = same_spellings(
        &accelerate,
        "PrecisionType",
        &[
            MixedPrecision::No,
            MixedPrecision::Bf16,
            MixedPrecision::Fp16,
        ],
        |t| t.to_string(),
        str::parse,
        "FP8 tensor cores",
    );
    assert_eq!(refused, ["fp8"]);
    same_spellings(
        &accelerate,
        "RNGType",
        &[RngType::Torch, RngType::Cuda, RngType::Generator],
        |t| t.to_string(),
        str::parse,
        "hearth does not drive",
    );
    let refused = same_spellings(
        &accelerate,
        "LoggerType",
        &[
            LoggerType::All,
            LoggerType::Tensorboard,
            LoggerType::Mlflow,
            LoggerType::Dvclive,
            LoggerType::Wandb,
        ],
        |t| t.to_string(),
        str::parse,
        "hearth has no tracker plugin",
    );
    assert!(refused.contains(&"aim".to_string()), "{refused:?}");
    // Config files spell them the same way.
    let t: DistributedType = serde_json::from_str("\"MULTI_GPU\"").unwrap();
    assert_eq!(t, DistributedType::MultiGpu);
    assert_eq!(
        serde_json::to_string(&DistributedType::Fsdp).unwrap(),
        "\"FSDP\""
    );
    let e = serde_json::from_str::<MixedPrecision>("\"fp8\"").unwrap_err();
    assert!(e.to_string().contains("FP8 tensor cores"), "{e}");
}

/// Bad `DdpOptions` are refused when the accelerator is built, naming the
/// field and what to set (the same checks as `[distributed]`'s).
#[test]
fn bad_ddp_options_are_refused_when_the_accelerator_is_built() {
    use hearth::parallel::{CommHook, CommWrapper, DdpOptions, PowerSgdOptions};
    let refusal = |ddp: DdpOptions| {
        Accelerator::builder()
            .cpu(true)
            .ddp(ddp)
            .build()
            .err()
            .expect("refused")
            .to_string()
    };
    let e = refusal(DdpOptions {
        comm_hook: CommHook::BatchedPowerSgd,
        ..Default::default()
    });
    assert!(
        e.starts_with("DistributedDataParallelKwargs: comm_hook = batched_power_sgd"),
        "{e}"
    );
    let e = refusal(DdpOptions {
        comm_wrapper: CommWrapper::Bf16,
        ..Default::default()
    });
    assert!(
        e.contains("comm_wrapper = bf16") && e.contains("set comm_hook"),
        "{e}"
    );
    let e = refusal(DdpOptions {
        comm_hook: CommHook::PowerSgd,
        comm_state_option: PowerSgdOptions {
            warm_start: false,
            start_power_sgd_iter: 1,
            ..Default::default()
        },
        ..Default::default()
    });
    assert!(
        e.contains("start_powerSGD_iter = 1") && e.contains("use_error_feedback"),
        "{e}"
    );
    let e = refusal(DdpOptions {
        bucket_cap_mb: 0.0,
        ..Default::default()
    });
    assert!(e.contains("bucket_cap_mb"), "{e}");
}

#[test]
fn save_and_save_object_write_on_the_main_process_or_each_machines_first() {
    let work = common::scratch("save-object");
    #[derive(serde::Serialize)]
    struct Summary {
        epoch: u32,
        losses: Vec<f64>,
    }
    let summary = Summary {
        epoch: 3,
        losses: vec![0.5, 0.25],
    };
    let tensors = vec![("w".to_string(), Tensor::from_slice(&[1.0f32, 2.0]))];
    for each_node in [false, true] {
        for rank in 0..4 {
            let acc = Accelerator::builder()
                .cpu(true)
                .process_group(Box::new(Place { rank }))
                .project_config(hearth::accelerator::ProjectConfiguration {
                    save_on_each_node: each_node,
                    ..Default::default()
                })
                .build()
                .unwrap();
            let json = work.join(format!("{each_node}-{rank}.json"));
            let st = work.join(format!("{each_node}-{rank}.safetensors"));
            let wrote = acc.save_object(&summary, &json).unwrap();
            assert_eq!(acc.save(&tensors, &st).unwrap(), wrote);
            // Accelerate: the main process, or each machine's local main.
            assert_eq!(
                wrote,
                rank == 0 || (each_node && rank == 2),
                "{each_node} {rank}"
            );
            assert_eq!(json.exists(), wrote);
            if wrote {
                let back: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
                assert_eq!(back, serde_json::json!({"epoch": 3, "losses": [0.5, 0.25]}));
                let w = hearth::checkpoint::read_safetensor(&st, "w").unwrap();
                assert_eq!(Vec::<f32>::try_from(&w).unwrap(), [1.0, 2.0]);
            }
        }
    }
}

/// `free_memory` (and `clear`) forget what Accelerate's forget, run live
/// (`tests/oracles/accelerate_free_memory.py`): the step counter goes back
/// to 0 and a later save holds no model, optimizer or scheduler.
#[test]
fn free_memory_forgets_what_accelerates_does() {
    let _serial = serial();
    let dir = common::scratch("free-memory");
    let oracle: Value = serde_json::from_str(
        oracle(
            "accelerate_free_memory.py",
            &[dir.join("accelerate").to_str().unwrap()],
        )
        .trim(),
    )
    .unwrap();
    let stems = |folder: std::path::PathBuf| -> Vec<String> {
        let mut stems: Vec<String> = std::fs::read_dir(folder)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .map(|f| f.split(['.', '_']).next().unwrap().to_string())
            .filter(|s| ["model", "optimizer", "scheduler"].contains(&s.as_str()))
            .collect();
        stems.sort();
        stems.dedup();
        stems
    };
    let accelerate_stems = |files: &Value| -> Vec<String> {
        let mut stems: Vec<String> = files
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                f.as_str()
                    .unwrap()
                    .split(['.', '_'])
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect();
        stems.dedup();
        stems
    };
    for clear in [false, true] {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .gradient_accumulation_steps(2)
            .build()
            .unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let _layer = nn::linear(vs.root(), 3, 2, Default::default());
        let opt = Sgd::new(vs.trainable_variables(), sgd(0.1, 0.0));
        let (vs, opt) = acc.prepare((vs, opt)).unwrap();
        let sched = acc.prepare((opt, linear_schedule(0.1))).unwrap();
        for _ in 0..3 {
            acc.accumulate(|| ());
        }
        let before = acc
            .save_state(Some(&dir.join(format!("before-{clear}"))))
            .unwrap();
        assert_eq!(acc.step(), oracle["before"]["step"].as_u64().unwrap());
        assert_eq!(stems(before), accelerate_stems(&oracle["before"]["files"]));
        if clear {
            acc.clear((vs, sched)).unwrap();
        } else {
            acc.free_memory((vs, sched)).unwrap();
        }
        assert_eq!(acc.step(), oracle["after"]["step"].as_u64().unwrap());
        let after = acc
            .save_state(Some(&dir.join(format!("after-{clear}"))))
            .unwrap();
        assert_eq!(stems(after), accelerate_stems(&oracle["after"]["files"]));
        acc.accumulate(|| ());
        assert_eq!(
            acc.step(),
            oracle["after"]["step_after_one_more"].as_u64().unwrap()
        );
    }
}
