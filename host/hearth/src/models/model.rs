//! The `Model` and `Unit` traits.

use super::ModuleTree;
use tch::{nn, TchError, Tensor};

/// One step of a model's forward pass that the host may run on its own (and
/// shard): it maps the previous unit's output to its own.
pub trait Unit {
    /// The paths of the modules whose parameters this unit runs with
    /// (`["blocks.2"]`; `[""]` for every parameter; a parameter's full name
    /// names that parameter alone): unit-wise execution gathers exactly
    /// their shards before running the unit.
    fn modules(&self) -> Vec<&str>;
    /// Runs the unit.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor;
    /// Runs the unit on everything the unit before it gave, for models
    /// whose units pass on more than one tensor (a TorchScript model cut at
    /// its units passes hidden states, rotary tables and masks); the first
    /// unit gets the model's input alone, the last gives its output alone.
    /// By default, [`forward_t`](Self::forward_t) on the one tensor.
    fn forward_all(&self, xs: &[Tensor], train: bool) -> Result<Vec<Tensor>, TchError> {
        match xs {
            [x] => Ok(vec![self.forward_t(x, train)]),
            _ => Err(TchError::Torch(format!(
                "a unit of one tensor was given {}",
                xs.len()
            ))),
        }
    }
}

/// A model hearth can run unit by unit, and so shard under FULL_SHARD: any
/// tensors in, any tensors out. hearth's own GPT takes `[batch, time]`
/// int64 tokens and gives `[batch, time, vocab]` logits; an MLP of yours
/// takes `[batch, features]` floats — the accelerator only passes each
/// unit's output to the next. Implement three methods: the module tree
/// (`ModuleTree::from_variables` over your `VarStore`, with your classes,
/// for the wrap policy), the units in forward order (each naming the
/// modules whose parameters it runs with), and the parameters.
/// `examples/own_model.rs` does it for an MLP and trains to DDP's weights
/// under FULL_SHARD on 2 processes. A model whose forward pass does not
/// split into units can still be prepared as its `VarStore`, under every
/// strategy but FULL_SHARD.
pub trait Model {
    /// The module tree: every module's path, kind and parameters.
    fn module_tree(&self) -> &ModuleTree;
    /// The units in forward order.
    fn units(&self) -> Vec<&dyn Unit>;

    /// Makes the units of the model those `units` (module paths, a wrap
    /// policy's) mark, for a model whose units are not fixed by its type:
    /// a TorchScript model is cut at their calls. An error says why the
    /// model cannot be run so. Called when the model is prepared to run
    /// unit by unit; hearth's own models keep their units (the default).
    fn cut_at(&self, units: &[String]) -> Result<(), String> {
        let _ = units;
        Ok(())
    }

    /// Gives the tensors named `names` (all, for `None`) their values
    /// where the model left them unread (a TorchScript file loaded without
    /// its weights, [`TorchScriptModel::load_lazily`](super::TorchScriptModel::load_lazily)):
    /// `prepare` reads a sharded model one unit at a time, so that no
    /// process holds it whole. hearth's own models hold their values from
    /// the start (the default does nothing).
    fn materialize(&self, names: Option<&[String]>) -> Result<(), String> {
        let _ = names;
        Ok(())
    }

    /// Makes `init` (an `init-from` plan over [`named_state`](Self::named_state))
    /// where [`materialize`](Self::materialize) reads the tensors it
    /// covers, for a model whose weights are read lazily; otherwise gives
    /// it back, to be loaded now (the default).
    fn defer_init(
        &self,
        init: crate::checkpoint::pretrained::InitPlan,
    ) -> Option<crate::checkpoint::pretrained::InitPlan> {
        Some(init)
    }

    /// [`forward_t`](Self::forward_t), with libtorch's error returned where
    /// the model can return it (a TorchScript model's forward pass);
    /// hearth's own models panic, as tch's layers do (the default).
    fn try_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor, TchError> {
        Ok(self.forward_t(xs, train))
    }

    /// Runs every unit in order, each on the previous one's output.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut units = self.units().into_iter();
        let first = units.next().expect("a model has at least one unit");
        units.fold(first.forward_t(xs, train), |xs, unit| {
            unit.forward_t(&xs, train)
        })
    }

    /// Parameters with their PyTorch names, sorted by name (handles to the
    /// model's own tensors).
    fn named_parameters(&self) -> Vec<(String, Tensor)>;

    /// Buffers (state that is not trained, such as BatchNorm's running
    /// statistics) with their PyTorch names, sorted by name; none by default.
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// Everything PyTorch's `state_dict()` holds: the parameters, then the
    /// buffers (what is saved, checkpointed and kept equal across processes).
    fn named_state(&self) -> Vec<(String, Tensor)> {
        let mut state = self.named_parameters();
        state.extend(self.named_buffers());
        state
    }

    /// Number of scalar parameters.
    fn num_parameters(&self) -> i64 {
        self.named_parameters()
            .iter()
            .map(|(_, t)| t.numel())
            .sum::<usize>() as i64
    }
}

/// A custom model (a tch `VarStore` and a forward pass of the user's) with
/// the classes of its modules declared, so that a wrap policy can pick its
/// units by class; modules left undeclared are of class `Module`.
///
/// ```no_run
/// # fn demo(acc: &mut hearth::accelerator::Accelerator) -> Result<(), hearth::accelerator::PrepareError> {
/// use hearth::models::VarStoreModel;
/// let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// // … layers under vs.root() / "layers" / 0, / 1 …
/// let model = VarStoreModel::new(vs)
///     .class("", "Net")
///     .class("layers.0", "Layer")
///     .class("layers.1", "Layer");
/// let vs = acc.prepare(model)?;
/// # Ok(()) }
/// ```
pub struct VarStoreModel {
    /// The variables.
    pub vs: nn::VarStore,
    /// `(module path, class)` pairs; `""` is the root.
    pub classes: Vec<(String, String)>,
}

impl VarStoreModel {
    /// `vs` with no class declared.
    pub fn new(vs: nn::VarStore) -> Self {
        Self {
            vs,
            classes: Vec::new(),
        }
    }

    /// Declares the class of the module at `path`.
    pub fn class(mut self, path: &str, class: &str) -> Self {
        self.classes.push((path.into(), class.into()));
        self
    }

    /// The module tree the variable names and declared classes give.
    pub fn module_tree(&self) -> ModuleTree {
        let root = self
            .classes
            .iter()
            .find(|(p, _)| p.is_empty())
            .map_or("Module", |(_, c)| c.as_str());
        let classes: Vec<(&str, &str)> = self
            .classes
            .iter()
            .map(|(p, c)| (p.as_str(), c.as_str()))
            .collect();
        ModuleTree::from_variables(&super::declaration_order(&self.vs), root, &classes)
    }
}

/// Anything with a state dict: every [`Model`], and a tch `VarStore` (its
/// variables, sorted by name). `save_model` and `get_state_dict` take
/// either, so a model of plain tch layers is saved as it is.
pub trait StateDict {
    /// The tensors by name (parameters, then buffers, for a model).
    fn state_dict(&self) -> Vec<(String, Tensor)>;
}

impl<M: Model + ?Sized> StateDict for M {
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.named_state()
    }
}

impl StateDict for nn::VarStore {
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        sorted_variables(self)
    }
}

/// The parameters of a `VarStore`, sorted by name.
pub fn sorted_variables(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

impl<M: Model + ?Sized> Model for Box<M> {
    fn module_tree(&self) -> &ModuleTree {
        (**self).module_tree()
    }
    fn units(&self) -> Vec<&dyn Unit> {
        (**self).units()
    }
    fn cut_at(&self, units: &[String]) -> Result<(), String> {
        (**self).cut_at(units)
    }
    fn materialize(&self, names: Option<&[String]>) -> Result<(), String> {
        (**self).materialize(names)
    }
    fn defer_init(
        &self,
        init: crate::checkpoint::pretrained::InitPlan,
    ) -> Option<crate::checkpoint::pretrained::InitPlan> {
        (**self).defer_init(init)
    }
    fn forward_t(&self, tokens: &Tensor, train: bool) -> Tensor {
        (**self).forward_t(tokens, train)
    }
    fn try_forward_t(&self, tokens: &Tensor, train: bool) -> Result<Tensor, TchError> {
        (**self).try_forward_t(tokens, train)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        (**self).named_parameters()
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        (**self).named_buffers()
    }
}
