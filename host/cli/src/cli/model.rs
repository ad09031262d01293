//! `hearth model plan CONFIG`: the module tree, the units the configured
//! wrap policy picks, and the bytes per process of parameters, gradients
//! and optimizer state; with `--max-memory`, the module sizes and the
//! device map Accelerate's `infer_auto_device_map` would give.
//! `hearth model estimate CONFIG`: `accelerate estimate-memory`.

use super::{align_right, table, Failure};
use clap::{Args, Subcommand};
use hearth::big_model::{
    self, AutoDeviceMapOptions, MapDevice, MaxMemory, ModuleSizes, Notes, ESTIMATE_DTYPES,
};
use hearth::models::ModuleTree;
use hearth::train::{self, RunOptions, TrainConfig};
use std::path::PathBuf;
use tch::Kind;

/// Arguments of `hearth model`.
#[derive(Debug, Args)]
pub(super) struct ModelArgs {
    #[command(subcommand)]
    command: ModelCommand,
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Print the model's module tree, the units its `[fsdp]` wrap policy
    /// picks, and what each process holds with N processes; with
    /// --max-memory, its module sizes and where each module goes.
    Plan(PlanArgs),
    /// Print the memory to load the model, to train it with Adam, and its
    /// largest layer, per dtype (as `accelerate estimate-memory`).
    Estimate(EstimateArgs),
}

#[derive(Debug, Args)]
struct PlanArgs {
    /// The training config (TOML) whose model and `[fsdp]` section to plan.
    config: PathBuf,
    /// Number of processes to plan for.
    #[arg(short = 'n', long = "num-processes", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    processes: u32,
    /// Print JSON: the sharding plan {"modules", "units", "per_process"}, or
    /// with --max-memory {"sizes": {path: bytes}, "device_map": {path: device}}.
    #[arg(long)]
    json: bool,
    /// Also look for plugins here (before HEARTH_PLUGIN_PATH, the project's plugins/ and the built-ins).
    #[arg(long = "plugin-dir", value_name = "DIR")]
    plugin_dirs: Vec<PathBuf>,
    /// Map the model onto these devices, filling them in order (Accelerate's
    /// infer_auto_device_map): GPU indices, cpu and disk with what each may
    /// hold, e.g. 0=20GiB,1=20GiB,cpu=64GiB (the disk is always last resort).
    #[arg(long, value_name = "DEVICE=SIZE,...", value_parser = max_memory_arg)]
    max_memory: Option<MaxMemory>,
    /// A module class never split across devices (repeatable), e.g. Block.
    #[arg(long = "no-split", value_name = "CLASS", requires = "max_memory")]
    no_split: Vec<String>,
    /// The dtype the weights will be loaded in (bf16, fp16, float32, …).
    #[arg(long, value_name = "DTYPE", requires = "max_memory", value_parser = dtype_arg)]
    dtype: Option<Kind>,
    /// Spread the model evenly over the GPUs (get_balanced_memory) instead
    /// of filling them in order.
    #[arg(long, requires = "max_memory")]
    balanced: bool,
    /// With --balanced: leave GPU 0 as empty as the others allow.
    #[arg(long, requires = "balanced")]
    low_zero: bool,
    /// Print each placement step (Accelerate's verbose).
    #[arg(long, requires = "max_memory")]
    verbose: bool,
}

#[derive(Debug, Args)]
struct EstimateArgs {
    /// The training config (TOML) whose model to size.
    config: PathBuf,
    /// The dtypes to estimate (repeatable; default float32, float16, int8, int4).
    #[arg(long = "dtype", value_name = "DTYPE", value_parser = ESTIMATE_DTYPES)]
    dtypes: Vec<String>,
    /// Print JSON: [{"dtype", "largest_layer", "total_size", "training"}] in bytes.
    #[arg(long)]
    json: bool,
}

fn max_memory_arg(text: &str) -> Result<MaxMemory, String> {
    big_model::parse_max_memory(text).map_err(|e| e.to_string())
}

fn dtype_arg(text: &str) -> Result<Kind, String> {
    big_model::parse_dtype(text).map_err(|e| e.to_string())
}

pub(super) fn execute(args: ModelArgs) -> Result<(), Failure> {
    match args.command {
        ModelCommand::Plan(args) if args.max_memory.is_some() => device_map(args),
        ModelCommand::Plan(args) => sharding_plan(args),
        ModelCommand::Estimate(args) => estimate(args),
    }
}

fn load_tree(config: &std::path::Path) -> Result<ModuleTree, Failure> {
    let config = TrainConfig::from_file(config).map_err(Failure::bad_input)?;
    train::module_tree(&config).map_err(Failure::building)
}

/// Bytes as people read them (powers of 2).
fn human(bytes: f64) -> String {
    let mut size = bytes;
    for unit in ["bytes", "KiB", "MiB", "GiB", "TiB"] {
        if size < 1024.0 || unit == "TiB" {
            return if unit == "bytes" {
                format!("{size:.0} {unit}")
            } else {
                format!("{size:.2} {unit}")
            };
        }
        size /= 1024.0;
    }
    unreachable!()
}

fn device_map(args: PlanArgs) -> Result<(), Failure> {
    let tree = load_tree(&args.config)?;
    let mut notes = Notes::default();
    let given = args.max_memory.clone().expect("checked by execute");
    let max_memory = if args.balanced {
        big_model::get_balanced_memory(
            &tree,
            Some(&given),
            &args.no_split,
            args.dtype,
            args.low_zero,
            &mut notes,
        )
    } else {
        given
    };
    let options = AutoDeviceMapOptions {
        max_memory: Some(max_memory.clone()),
        no_split_module_classes: args.no_split.clone(),
        dtype: args.dtype,
        verbose: args.verbose,
        ..Default::default()
    };
    let map = big_model::infer_auto_device_map(&tree, &options, &mut notes)
        .map_err(Failure::bad_input)?;
    let sizes = big_model::compute_module_sizes(&tree, args.dtype);
    for step in &notes.steps {
        // Steps go where they do not break the JSON.
        if args.json {
            eprintln!("{step}");
        } else {
            println!("{step}");
        }
    }
    if args.json {
        // Serialised from the ordered maps themselves (a JSON value would
        // sort the keys): Accelerate's order.
        #[derive(serde::Serialize)]
        struct Out<'a> {
            sizes: &'a ModuleSizes,
            device_map: &'a big_model::DeviceMap,
        }
        let out = Out {
            sizes: &sizes,
            device_map: &map,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&out).expect("serialises")
        );
        return Ok(());
    }
    print_device_map(&tree, &sizes, &map, &max_memory, &args);
    Ok(())
}

fn print_device_map(
    tree: &ModuleTree,
    sizes: &ModuleSizes,
    map: &big_model::DeviceMap,
    max_memory: &MaxMemory,
    args: &PlanArgs,
) {
    let size = |p: &str| sizes.get(p).copied().unwrap_or(0);
    let mut t = table(&["module", "class", "size", "device"]);
    // In the model's order (a cleaned map lists merged modules last).
    let mut rows: Vec<(&String, &MapDevice)> = map.iter().collect();
    rows.sort_by_key(|(path, _)| sizes.get_index_of(path.as_str()).unwrap_or(usize::MAX));
    for (path, device) in rows {
        let class = tree.get(path).map_or("tensor", |m| m.kind.as_str());
        let name = if path.is_empty() { "(root)" } else { path };
        t.add_row(vec![
            name.to_string(),
            class.to_string(),
            human(size(path) as f64),
            device.to_string(),
        ]);
    }
    align_right(&mut t, &[2]);
    let dtype = args.dtype.map_or(String::new(), |k| format!(", in {k:?}"));
    println!(
        "{}: {} in all{dtype}; largest layer: {}",
        args.config.display(),
        human(size("") as f64),
        human(big_model::largest_layer(tree, sizes, &args.no_split).0 as f64)
    );
    println!("{t}");
    let mut totals = table(&["device", "holds", "may hold"]);
    let mut devices: Vec<MapDevice> = map.values().copied().collect();
    devices.sort();
    devices.dedup();
    for d in devices {
        let held: u64 = map
            .iter()
            .filter(|(_, x)| **x == d)
            .map(|(p, _)| size(p))
            .sum();
        let room = max_memory
            .get(&d)
            .map_or("(no limit)".into(), |m| human(*m as f64));
        totals.add_row(vec![d.to_string(), human(held as f64), room]);
    }
    println!("{totals}");
}

fn estimate(args: EstimateArgs) -> Result<(), Failure> {
    let tree = load_tree(&args.config)?;
    let dtypes = if args.dtypes.is_empty() {
        ["float32", "float16", "int8", "int4"]
            .map(String::from)
            .to_vec()
    } else {
        args.dtypes
    };
    let rows = big_model::estimate_memory(&tree, &dtypes);
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).expect("serialises")
        );
        return Ok(());
    }
    println!(
        "Memory to load and train the model of {}",
        args.config.display()
    );
    let mut t = table(&[
        "dtype",
        "largest layer",
        "total size",
        "training using Adam",
    ]);
    for r in &rows {
        t.add_row(vec![
            r.dtype.clone(),
            human(r.largest_layer),
            human(r.total_size),
            r.training.map_or("N/A".into(), |b| human(b as f64)),
        ]);
    }
    align_right(&mut t, &[1, 2, 3]);
    println!("{t}");
    Ok(())
}

fn sharding_plan(args: PlanArgs) -> Result<(), Failure> {
    let config = TrainConfig::from_file(&args.config).map_err(Failure::bad_input)?;
    let options = RunOptions {
        plugin_dirs: args.plugin_dirs,
        ..Default::default()
    };
    let plan =
        train::plan(&config, &options, args.processes as usize).map_err(Failure::building)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&plan).expect("a plan serialises")
        );
        return Ok(());
    }
    let mut t = table(&["module (* a unit)", "class", "parameters", "bytes"]);
    for m in &plan.modules {
        let depth = m.path.matches('.').count() + usize::from(!m.path.is_empty());
        let name = if m.path.is_empty() { "(root)" } else { &m.path };
        let unit = if plan.units.contains(&m.path) {
            " *"
        } else {
            ""
        };
        t.add_row(vec![
            format!("{}{name}{unit}", "  ".repeat(depth)),
            m.class.clone(),
            m.params.to_string(),
            m.bytes.to_string(),
        ]);
    }
    align_right(&mut t, &[2, 3]);
    println!("{t}");
    println!(
        "\n{} units (*) with {} and the `{}` policy: {}",
        plan.units.len(),
        plan.strategy,
        plan.policy,
        plan.units
            .iter()
            .map(|u| if u.is_empty() { "(root)" } else { u })
            .collect::<Vec<_>>()
            .join(", ")
    );
    let p = plan.per_process;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "per process of {}: parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} MiB",
        plan.processes,
        mib(p.param_bytes),
        mib(p.grad_bytes),
        mib(p.optimizer_bytes)
    );
    if plan.whole_bytes > 0 {
        println!(
            "whole at once during a step: {:.2} MiB of parameters (the root unit, kept from forward \
             to backward, and the largest other unit; with prefetch the next one's gather is in flight)",
            mib(plan.whole_bytes)
        );
    }
    Ok(())
}
