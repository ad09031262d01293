//! hearth's side of `make bench-checkpoint`: `save_state` / `load_state` of
//! the model of Accelerate's peer script (60 × Linear(2048, 2048): 252 M
//! parameters, ~1 GB of fp32 weights and ~2 GB of AdamW state) on the CPU,
//! after one AdamW step. Prints one line in the peer's format.
//! Usage: `save_state OUT_DIR [sync|async|async-again|sharded] [HOOK]`,
//! `async-again` timing an asynchronous save that follows another (as in
//! training, where every save after the first reuses the snapshot
//! buffers; the first one's folder is deleted before, as rotation frees
//! old checkpoints), HOOK a built-in
//! checkpoint hook (`manifest-sha256`) to time what it adds. `sharded`,
//! under mpirun: SHARD_GRAD_OP with SHARDED_STATE_DICT, every process
//! writing its quarter (on 4) of the weights and state; rank 0 prints.

use hearth::accelerator::{Accelerator, ProjectConfiguration};
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use hearth::parallel::{FsdpPlugin, ShardingStrategy, StateDictType};
use hearth::plugins::{PluginSource, SearchPath};
use std::path::PathBuf;
use std::time::Instant;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn sync_disks() {
    let _ = std::process::Command::new("sync").status();
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(args.next().unwrap_or_else(|| "/tmp/hearth_ckpt".into()));
    let mode = args.next();
    let again = mode.as_deref() == Some("async-again");
    let async_save = mode.as_deref() == Some("async") || again;
    let sharded = mode.as_deref() == Some("sharded");
    let hook = args.next();
    let (layers, d) = (60, 2048);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut seq = nn::seq();
    for i in 0..layers {
        seq = seq.add(nn::linear(vs.root() / i, d, d, Default::default()));
    }
    let params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    let mut builder = Accelerator::builder()
        .cpu(true)
        .timeout(std::time::Duration::from_secs(600))
        .project_config(ProjectConfiguration {
            async_save,
            ..Default::default()
        });
    if sharded {
        let plugins = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/plugins");
        builder = builder
            .fsdp(FsdpPlugin {
                sharding_strategy: Some(ShardingStrategy::ShardGradOp),
                auto_wrap_policy: Some("no-wrap".into()),
                state_dict_type: Some(StateDictType::ShardedStateDict),
                sync_module_states: Some(true),
                ..Default::default()
            })
            .plugin_path(SearchPath::only([(PluginSource::BuiltIn, plugins)]));
    }
    let mut acc = builder.build()?;
    let hyper = AdamHyper::adamw(1e-3);
    let opt = Adam::new(vs.trainable_variables(), hyper);
    let (_vs, mut opt) = acc.prepare((vs, opt))?;
    if let Some(name) = &hook {
        let registry =
            hearth::plugins::Registry::discover(&hearth::plugins::SearchPath::standard(&[], None))?;
        let found = registry.find(name)?;
        acc.register_checkpoint_hook(hearth::plugins::load_checkpoint_hook(
            &found.manifest,
            "{}",
        )?);
    }
    let loss = seq
        .forward(&Tensor::randn([4, d], (Kind::Float, Device::Cpu)))
        .sum(Kind::Float);
    acc.backward(&loss)?;
    opt.step()?;
    if acc.is_main_process() {
        let _ = std::fs::remove_dir_all(&out);
    }
    if again {
        let first = out.with_extension("first");
        acc.save_state(Some(&first))?;
        acc.wait_for_checkpoint()?;
        let _ = std::fs::remove_dir_all(&first);
    }
    acc.wait_for_everyone()?;
    sync_disks();
    let t = Instant::now();
    acc.save_state(Some(&out))?;
    let returned = t.elapsed().as_secs_f64();
    acc.wait_for_checkpoint()?;
    acc.wait_for_everyone()?;
    sync_disks();
    let save = t.elapsed().as_secs_f64();
    let manifest = hearth::checkpoint::verify_complete(&out)?;
    let mut files: Vec<String> = manifest.files.iter().map(|f| f.name.clone()).collect();
    files.sort();
    let size: u64 = manifest.files.iter().map(|f| f.size).sum();
    acc.wait_for_everyone()?;
    let t = Instant::now();
    acc.load_state(Some(&out))?;
    acc.wait_for_everyone()?;
    let load = t.elapsed().as_secs_f64();
    if !acc.is_main_process() {
        return Ok(());
    }
    println!(
        "hearth save_state{}{} params={:.0}M bytes={:.2}GB save={save:.2}s ({:.2} GB/s) returned={returned:.2}s load={load:.2}s files={files:?}",
        hook.map(|h| format!(" hook={h}")).unwrap_or_default(),
        if sharded {
            format!(" sharded×{}", acc.num_processes())
        } else {
            String::new()
        },
        params as f64 / 1e6,
        size as f64 / 1e9,
        size as f64 / save / 1e9,
    );
    let _ = std::fs::remove_dir_all(&out);
    Ok(())
}
