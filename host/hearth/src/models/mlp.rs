//! A neural language model in the style of Bengio et al. (2003): each
//! position's logits come from an MLP over the embeddings of the `context`
//! tokens ending at it (earlier positions are zero-padded), so it is causal
//! like the GPT and trains on the same datasets.

use super::weights::{embed, Weights};
use super::{Model, ModuleTree, Unit};
use tch::nn::{self, Module};
use tch::{Device, Tensor};

/// Sizes of an [`Mlp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpConfig {
    /// Number of distinct tokens.
    pub vocab_size: i64,
    /// How many tokens (the current one and those before it) each prediction sees.
    pub context: i64,
    /// Width of each token embedding.
    pub d_model: i64,
    /// Width of the hidden layer.
    pub hidden: i64,
}

struct Context {
    path: String,
    context: i64,
    tok: Tensor,
}

impl Unit for Context {
    fn modules(&self) -> Vec<&str> {
        vec![&self.path]
    }
    fn forward_t(&self, tokens: &Tensor, _train: bool) -> Tensor {
        let emb = embed(&self.tok, tokens);
        let t = emb.size()[1];
        let shifted: Vec<Tensor> = (0..self.context)
            .map(|k| emb.constant_pad_nd([0, 0, k, 0]).narrow(1, 0, t))
            .collect();
        Tensor::cat(&shifted, -1)
    }
}

struct Layer {
    path: String,
    linear: nn::Linear,
    gelu: bool,
}

impl Unit for Layer {
    fn modules(&self) -> Vec<&str> {
        vec![&self.path]
    }
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let ys = self.linear.forward(xs);
        if self.gelu {
            hearth_ops::gelu(&ys)
        } else {
            ys
        }
    }
}

/// The MLP language model.
pub struct Mlp {
    vs: nn::VarStore,
    context: Context,
    fc: Layer,
    head: Layer,
    tree: ModuleTree,
}

impl Mlp {
    /// Creates the model with PyTorch's default initialisation on `device`.
    pub fn new(config: MlpConfig, device: Device) -> Self {
        Self::with_weights(config, device, Weights::Initialised)
    }

    /// The model with its weights starting as `weights` says.
    pub fn with_weights(config: MlpConfig, device: Device, weights: Weights) -> Self {
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let declared = vec![
            ("".to_string(), "MLP"),
            ("tok".to_string(), "Embedding"),
            ("fc".to_string(), "Linear"),
            ("head".to_string(), "Linear"),
        ];
        let context = Context {
            path: "tok".into(),
            context: config.context,
            tok: weights.embedding(&root / "tok", config.vocab_size, config.d_model),
        };
        let fc = Layer {
            path: "fc".into(),
            linear: weights.linear(&root / "fc", config.context * config.d_model, config.hidden),
            gelu: true,
        };
        let head = Layer {
            path: "head".into(),
            linear: weights.linear(&root / "head", config.hidden, config.vocab_size),
            gelu: false,
        };
        let tree = ModuleTree::new(&declared, &super::declaration_order(&vs));
        Self {
            vs,
            context,
            fc,
            head,
            tree,
        }
    }
}

impl Model for Mlp {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        super::model::sorted_variables(&self.vs)
    }
    fn module_tree(&self) -> &ModuleTree {
        &self.tree
    }
    fn units(&self) -> Vec<&dyn Unit> {
        vec![&self.context, &self.fc, &self.head]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sees_only_its_context_window() {
        let _rng = crate::global_rng();
        let config = MlpConfig {
            vocab_size: 10,
            context: 2,
            d_model: 4,
            hidden: 8,
        };
        let model = Mlp::new(config, Device::Cpu);
        let a = Tensor::from_slice(&[1i64, 2, 3, 4]).view([1, 4]);
        let b = Tensor::from_slice(&[7i64, 2, 3, 4]).view([1, 4]);
        let (la, lb) = (model.forward_t(&a, false), model.forward_t(&b, false));
        assert_eq!(la.size(), [1, 4, 10]);
        // Position 2 sees tokens 1..=2 only, so the first token does not matter.
        assert!(la
            .narrow(1, 2, 2)
            .allclose(&lb.narrow(1, 2, 2), 1e-6, 1e-6, false));
        assert!(!la
            .narrow(1, 0, 1)
            .allclose(&lb.narrow(1, 0, 1), 1e-6, 1e-6, false));
    }
}
