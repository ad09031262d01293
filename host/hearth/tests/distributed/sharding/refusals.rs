//! What sharding cannot do is refused at `prepare`, saying what to do
//! instead.

use super::{accelerator, bench_gpt, Setup, SEEDED};
use hearth::models::{Gpt, Model};
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use hearth::parallel::ShardingStrategy;
use hearth::precision::MixedPrecision;
use std::time::Duration;
use tch::{Device, Tensor};

#[test]
fn an_optimizer_prepared_before_its_sharded_model_is_refused() {
    let setup = Setup {
        strategy: Some(ShardingStrategy::ShardGradOp),
        batch: 1,
        accumulation: 1,
        precision: MixedPrecision::No,
        clip: None,
        custom: false,
        checkpointing: false,
    };
    let mut acc = accelerator(setup, Duration::from_secs(120));
    // Drawing weights here would move the generator under a reference run.
    let _one_at_a_time = SEEDED.lock().unwrap_or_else(|p| p.into_inner());
    let model = Gpt::new(bench_gpt(), Device::Cpu);
    let params: Vec<Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let _opt = acc
        .prepare(Adam::new(params, AdamHyper::adamw(1e-3)))
        .unwrap();
    let err = acc.prepare(model).err().expect("refused");
    let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(chain.contains("prepare the model first"), "{chain}");
}

#[test]
fn full_shard_and_activation_checkpointing_refuse_a_model_whose_forward_is_the_users() {
    for (strategy, checkpointing, says) in [
        (ShardingStrategy::FullShard, false, "use SHARD_GRAD_OP"),
        (
            ShardingStrategy::ShardGradOp,
            true,
            "activation checkpointing runs",
        ),
    ] {
        let setup = Setup {
            strategy: Some(strategy),
            batch: 1,
            accumulation: 1,
            precision: MixedPrecision::No,
            clip: None,
            custom: true,
            checkpointing,
        };
        let mut acc = accelerator(setup, Duration::from_secs(120));
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let _one_at_a_time = SEEDED.lock().unwrap_or_else(|p| p.into_inner());
        let _layer = tch::nn::linear(vs.root() / "layer", 3, 3, Default::default());
        let err = acc.prepare(vs).expect_err("refused");
        let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(
            chain.contains(says) && chain.contains("VarStore"),
            "{chain}"
        );
    }
}
