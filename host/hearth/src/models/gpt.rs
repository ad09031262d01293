//! A GPT, layer for layer the model of `shared/bench/peer_gpt_accelerate.py`:
//! token + learned position embeddings, pre-LayerNorm blocks with a fused qkv
//! Linear and causal scaled-dot-product attention, a GELU MLP of width 4d, a
//! final LayerNorm and a separate head. Parameter names are PyTorch's.

use super::weights::{embed, Weights};
use super::{Model, ModuleTree, Unit};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// Sizes of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Number of distinct tokens.
    pub vocab_size: i64,
    /// Longest sequence (number of learned positions).
    pub block_size: i64,
    /// Width of the residual stream.
    pub d_model: i64,
    /// Number of transformer blocks.
    pub layers: i64,
    /// Attention heads per block (must divide `d_model`).
    pub heads: i64,
}

struct Embedding {
    tok: Tensor,
    pos: Tensor,
}

impl Unit for Embedding {
    fn modules(&self) -> Vec<&str> {
        vec!["tok", "pos"]
    }
    fn forward_t(&self, tokens: &Tensor, _train: bool) -> Tensor {
        let t = tokens.size()[1];
        let positions = Tensor::arange(t, (Kind::Int64, tokens.device()));
        embed(&self.tok, tokens) + embed(&self.pos, &positions)
    }
}

struct Block {
    path: String,
    heads: i64,
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    out: nn::Linear,
}

impl Unit for Block {
    fn modules(&self) -> Vec<&str> {
        vec![&self.path]
    }
    fn forward_t(&self, x: &Tensor, _train: bool) -> Tensor {
        // Attention straight from the packed qkv projection: no split into
        // heads, no transpose back, one gradient for all three (hearth's
        // kernels on a CPU; libtorch's scaled_dot_product_attention
        // elsewhere).
        let qkv = self.qkv.forward(&self.ln1.forward(x));
        let a = hearth_ops::self_attention(&qkv, self.heads, true);
        let x = x + self.proj.forward(&a);
        // The exact GELU, keeping its derivative for the backward pass.
        let h = hearth_ops::gelu(&self.fc.forward(&self.ln2.forward(&x)));
        &x + self.out.forward(&h)
    }
}

struct Head {
    ln: nn::LayerNorm,
    head: nn::Linear,
}

impl Unit for Head {
    fn modules(&self) -> Vec<&str> {
        vec!["ln", "head"]
    }
    fn forward_t(&self, x: &Tensor, _train: bool) -> Tensor {
        self.head.forward(&self.ln.forward(x))
    }
}

/// The GPT language model.
pub struct Gpt {
    vs: nn::VarStore,
    config: GptConfig,
    embedding: Embedding,
    blocks: Vec<Block>,
    head: Head,
    tree: ModuleTree,
}

impl Gpt {
    /// Creates a GPT with PyTorch's default initialisation on `device`.
    ///
    /// # Panics
    /// If `heads` does not divide `d_model` (configs are validated before).
    pub fn new(config: GptConfig, device: Device) -> Self {
        Self::with_weights(config, device, Weights::Initialised)
    }

    /// A GPT whose weights are allocated but never written (see
    /// [`Weights::Unmaterialised`]): for the processes that receive rank
    /// 0's weights under `cpu-ram-efficient-loading`.
    pub fn unmaterialised(config: GptConfig, device: Device) -> Self {
        Self::with_weights(config, device, Weights::Unmaterialised)
    }

    /// A GPT whose weights start as `weights` says.
    ///
    /// # Panics
    /// If `heads` does not divide `d_model` (configs are validated before).
    pub fn with_weights(config: GptConfig, device: Device, weights: Weights) -> Self {
        assert!(
            config.d_model % config.heads == 0,
            "heads must divide d_model"
        );
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let d = config.d_model;
        let mut declared: Vec<(String, &str)> = vec![("".into(), "GPT")];
        let mut declare = |path: String, kind: &'static str| {
            declared.push((path.clone(), kind));
            path
        };
        let ln = |p: nn::Path| nn::layer_norm(p, vec![d], Default::default());
        let linear = |p: nn::Path, i, o| weights.linear(p, i, o);

        let embedding = Embedding {
            tok: weights.embedding(
                &root / declare("tok".into(), "Embedding"),
                config.vocab_size,
                d,
            ),
            pos: weights.embedding(
                &root / declare("pos".into(), "Embedding"),
                config.block_size,
                d,
            ),
        };
        declare("blocks".into(), "Sequential");
        let blocks = (0..config.layers)
            .map(|i| {
                let path = declare(format!("blocks.{i}"), "Block");
                let p = &root / "blocks" / i;
                let mut sub = |name: &str, kind| {
                    declare(format!("{path}.{name}"), kind);
                    &p / name
                };
                Block {
                    heads: config.heads,
                    ln1: ln(sub("ln1", "LayerNorm")),
                    qkv: linear(sub("qkv", "Linear"), d, 3 * d),
                    proj: linear(sub("proj", "Linear"), d, d),
                    ln2: ln(sub("ln2", "LayerNorm")),
                    fc: linear(sub("fc", "Linear"), d, 4 * d),
                    out: linear(sub("out", "Linear"), 4 * d, d),
                    path,
                }
            })
            .collect();
        let head = Head {
            ln: ln(&root / declare("ln".into(), "LayerNorm")),
            head: linear(
                &root / declare("head".into(), "Linear"),
                d,
                config.vocab_size,
            ),
        };
        let tree = ModuleTree::new(&declared, &super::declaration_order(&vs));
        Self {
            vs,
            config,
            embedding,
            blocks,
            head,
            tree,
        }
    }

    /// The sizes this model was built with.
    pub fn config(&self) -> GptConfig {
        self.config
    }
}

impl Model for Gpt {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        super::model::sorted_variables(&self.vs)
    }
    fn module_tree(&self) -> &ModuleTree {
        &self.tree
    }
    fn units(&self) -> Vec<&dyn Unit> {
        let mut units: Vec<&dyn Unit> = vec![&self.embedding];
        units.extend(self.blocks.iter().map(|b| b as &dyn Unit));
        units.push(&self.head);
        units
    }
}

/// A GPT small enough for any unit test: 11 tokens, 8 positions, d=8,
/// 2 layers of 2 heads.
#[cfg(test)]
pub(crate) fn tiny_gpt() -> Gpt {
    let config = GptConfig {
        vocab_size: 11,
        block_size: 8,
        d_model: 8,
        layers: 2,
        heads: 2,
    };
    let _rng = crate::global_rng();
    Gpt::new(config, Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: GptConfig = GptConfig {
        vocab_size: 11,
        block_size: 8,
        d_model: 16,
        layers: 2,
        heads: 4,
    };

    fn tiny() -> Gpt {
        Gpt::new(TINY, Device::Cpu)
    }

    #[test]
    fn parameter_names_are_pytorchs() {
        let _rng = crate::global_rng();
        let names: Vec<String> = tiny()
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        for expected in [
            "tok.weight",
            "pos.weight",
            "blocks.1.qkv.weight",
            "blocks.0.out.bias",
            "ln.weight",
            "head.bias",
        ] {
            assert!(
                names.iter().any(|n| n == expected),
                "missing {expected} in {names:?}"
            );
        }
        assert_eq!(names.len(), 2 + 2 * 12 + 4);
    }

    #[test]
    fn module_tree_counts_every_parameter_once() {
        let _rng = crate::global_rng();
        let model = tiny();
        let tree = model.module_tree();
        assert_eq!(tree.modules()[0].num_params as i64, model.num_parameters());
        let block = tree.get("blocks.1").unwrap();
        assert_eq!(block.kind, "Block");
        assert_eq!(tree.modules()[block.parent.unwrap()].path, "blocks");
        assert_eq!(
            tree.get("blocks.1.qkv").unwrap().params,
            ["blocks.1.qkv.weight", "blocks.1.qkv.bias"]
        );
        assert_eq!(tree.get("blocks.1.qkv").unwrap().num_params, 16 * 48 + 48);
    }

    #[test]
    fn forward_is_causal() {
        let _rng = crate::global_rng();
        let model = tiny();
        let a = Tensor::from_slice(&[1i64, 2, 3, 4]).view([1, 4]);
        let b = Tensor::from_slice(&[1i64, 2, 3, 9]).view([1, 4]);
        let (la, lb) = (model.forward_t(&a, false), model.forward_t(&b, false));
        assert_eq!(la.size(), [1, 4, 11]);
        // Changing the last token cannot change the logits of earlier positions.
        assert!(la
            .narrow(1, 0, 3)
            .allclose(&lb.narrow(1, 0, 3), 1e-6, 1e-6, false));
        assert!(!la
            .narrow(1, 3, 1)
            .allclose(&lb.narrow(1, 3, 1), 1e-6, 1e-6, false));
    }

    #[test]
    fn an_unmaterialised_gpt_has_the_names_shapes_and_tree_of_an_initialised_one() {
        let _rng = crate::global_rng();
        let config = TINY;
        let shapes = |m: &Gpt| -> Vec<(String, Vec<i64>, bool)> {
            m.named_parameters()
                .into_iter()
                .map(|(n, t)| (n, t.size(), t.requires_grad()))
                .collect()
        };
        let (a, b) = (
            Gpt::new(config, Device::Cpu),
            Gpt::unmaterialised(config, Device::Cpu),
        );
        assert_eq!(shapes(&a), shapes(&b));
        assert_eq!(
            a.module_tree().modules().len(),
            b.module_tree().modules().len()
        );
        // Once given the first one's values, it computes what it computes.
        tch::no_grad(|| {
            for ((_, p), (_, q)) in b.named_parameters().iter().zip(a.named_parameters()) {
                p.detach().copy_(&q);
            }
        });
        let x = Tensor::randint(11, [2, 8], (Kind::Int64, Device::Cpu));
        assert!(a.forward_t(&x, false).equal(&b.forward_t(&x, false)));
    }
}
