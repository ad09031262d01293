//! Your own model under every strategy, FULL_SHARD included: implement
//! [`Model`] — its units in forward order, its module tree, its parameters —
//! and hearth shards it unit by unit as it shards its built-in GPT. Each
//! [`Unit`] names the modules whose parameters it runs with; under
//! FULL_SHARD hearth gathers exactly those before running it and frees them
//! after.
//!
//! Fits y = sin(x·w) with a 4-layer MLP. The strategy comes from the
//! environment as Accelerate's does (`HEARTH_USE_FSDP=1`,
//! `HEARTH_FSDP_SHARDING_STRATEGY=FULL_SHARD`,
//! `HEARTH_FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP`,
//! `HEARTH_FSDP_TRANSFORMER_CLS_TO_WRAP=Layer`); without them it is DDP.
//! `hearth launch -n 2 --cpu -- target/debug/examples/own_model OUT` trains
//! on 2 processes and writes OUT/model.safetensors.

use anyhow::Result;
use hearth::accelerator::Accelerator;
use hearth::data::{DataLoader, Dataset};
use hearth::models::{declaration_order, Model, ModuleTree, Unit};
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use hearth::tch::nn::{self, Module};
use hearth::tch::{Device, Kind, Reduction, Tensor};

/// One layer: a Linear under `path`, then tanh (none on the last).
struct Layer {
    path: String,
    linear: nn::Linear,
    last: bool,
}

impl Unit for Layer {
    fn modules(&self) -> Vec<&str> {
        vec![&self.path]
    }
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let ys = self.linear.forward(xs);
        if self.last {
            ys
        } else {
            ys.tanh()
        }
    }
}

/// The model: its variables, its module tree and its layers.
struct Net {
    vs: nn::VarStore,
    tree: ModuleTree,
    layers: Vec<Layer>,
}

impl Net {
    fn new(widths: &[i64]) -> Self {
        let vs = nn::VarStore::new(Device::Cpu);
        let n = widths.len() - 1;
        let layers: Vec<Layer> = (0..n)
            .map(|i| Layer {
                path: format!("layers.{i}"),
                linear: nn::linear(
                    vs.root() / "layers" / i,
                    widths[i],
                    widths[i + 1],
                    Default::default(),
                ),
                last: i + 1 == n,
            })
            .collect();
        let paths: Vec<String> = layers.iter().map(|l| l.path.clone()).collect();
        let classes: Vec<(&str, &str)> = paths.iter().map(|p| (p.as_str(), "Layer")).collect();
        let tree = ModuleTree::from_variables(&declaration_order(&vs), "Net", &classes);
        Self { vs, tree, layers }
    }
}

impl Model for Net {
    fn module_tree(&self) -> &ModuleTree {
        &self.tree
    }
    fn units(&self) -> Vec<&dyn Unit> {
        self.layers.iter().map(|l| l as &dyn Unit).collect()
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        hearth::models::sorted_variables(&self.vs)
    }
}

/// 256 points of y = sin(x·w), x in R^4.
struct Points(Tensor, Tensor);

impl Dataset for Points {
    type Item = (Tensor, Tensor);
    fn len(&self) -> usize {
        self.0.size()[0] as usize
    }
    fn get(&self, i: usize) -> (Tensor, Tensor) {
        (self.0.get(i as i64), self.1.get(i as i64))
    }
}

fn main() -> Result<()> {
    let out = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "own-model".into()),
    );
    let mut acc = Accelerator::builder().build()?;
    acc.set_seed(0, false, false);
    let x = Tensor::randn([256, 4], (Kind::Float, Device::Cpu));
    let w = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 1.5]).view([4, 1]);
    let loader = DataLoader::new(Points(x.shallow_clone(), x.matmul(&w).sin()), 16).shuffle(0);
    let net = Box::new(Net::new(&[4, 32, 32, 32, 1])) as Box<dyn Model>;
    let opt = Adam::new(
        net.named_parameters()
            .into_iter()
            .map(|(_, p)| p)
            .collect::<Vec<_>>(),
        AdamHyper::adamw(1e-2),
    );
    let (net, mut opt, loader) = acc.prepare((net, opt, loader))?;
    for epoch in 1..=10 {
        let (mut total, mut batches) = (0.0, 0);
        for (x, y) in loader.iter() {
            let loss = net.forward_t(&x, true).mse_loss(&y, Reduction::Mean);
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
            total += f64::try_from(&loss)?;
            batches += 1;
        }
        if epoch % 5 == 0 {
            acc.print(format!("epoch {epoch}: mse {:.4}", total / batches as f64));
        }
    }
    let sync = acc.gradient_sync_stats();
    let strategy = acc
        .fsdp_settings()
        .map(|f| format!("{:?}", f.sharding_strategy));
    acc.print(format!(
        "{}: {} reduce-scatters, {} all-reduces, {} gathers",
        strategy.as_deref().unwrap_or("DDP"),
        sync.reduce_scatters,
        sync.all_reduces,
        sync.gathers
    ));
    acc.save_model(&net, &out, u64::MAX)?;
    acc.print(format!(
        "model written to {}",
        out.join("model.safetensors").display()
    ));
    Ok(())
}
