//! A TorchScript model cut at its units (a wrap policy's): its pieces, one
//! per unit call and one per stretch of code between them
//! ([`hearth_ops::CutForward`]), each a [`Unit`] passing its tensors on.

use super::model::{first_line, lock, ModelOutput, Piece, TorchScriptModel};
use crate::models::Unit;
use hearth_ops::AutocastGuard;
use tch::{Device, Kind, TchError, Tensor};

impl Unit for Piece {
    fn modules(&self) -> Vec<&str> {
        self.tensors.iter().map(String::as_str).collect()
    }
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut out = self
            .forward_all(std::slice::from_ref(xs), train)
            .unwrap_or_else(|e| {
                panic!(
                    "TorchScript model {}: piece {} failed: {e}",
                    self.path.display(),
                    self.index
                )
            });
        match out.len() {
            1 => out.remove(0),
            n => panic!(
                "TorchScript model {}: piece {} gives {n} tensors, not one",
                self.path.display(),
                self.index
            ),
        }
    }
    fn forward_all(&self, xs: &[Tensor], train: bool) -> Result<Vec<Tensor>, TchError> {
        let mut loaded = lock(&self.loaded);
        loaded.mode(train)?;
        let inputs: Vec<Tensor> = match (self.unpack_labels, xs) {
            (true, [packed]) => vec![packed.get(0), packed.get(1)],
            (true, _) => {
                return Err(TchError::Torch(
                    "a loss model's first piece takes the stacked ids and labels".into(),
                ))
            }
            (false, _) => xs.iter().map(Tensor::shallow_clone).collect(),
        };
        // A traced graph fixes the kinds it converts to (transformers' norms
        // compute in float32 and cast back to the kind traced with): with
        // its weights gathered in 16 bits (a mixed-precision policy's
        // param_dtype) the piece runs under autocast to that kind, so its
        // matmuls take them as the policy means.
        let sixteen = self
            .weights
            .iter()
            .map(Tensor::kind)
            .find(|k| matches!(k, Kind::BFloat16 | Kind::Half));
        let device = self.weights.first().map_or(Device::Cpu, Tensor::device);
        let _autocast = match (sixteen, AutocastGuard::active(device)) {
            (Some(kind), None) => Some(AutocastGuard::new(device, kind)?),
            _ => None,
        };
        let cut = loaded.cut.as_ref().expect("pieces exist once cut");
        cut.run(self.index, &inputs)
    }
}

impl TorchScriptModel {
    /// How many pieces its forward pass runs as (1 until it is cut).
    pub fn piece_count(&self) -> usize {
        self.pieces.get().map_or(1, |(_, p)| p.len())
    }

    /// The names, in the module tree, of the parameters and buffers read
    /// by a piece that uses `uses` (module paths and tensor names): a tied
    /// parameter read under its second name counts under its first.
    fn tensors_used(&self, uses: &[String]) -> Vec<String> {
        let own = |name: &str| {
            self.tree
                .ties()
                .iter()
                .find(|group| group.iter().any(|n| n == name))
                .and_then(|group| {
                    group
                        .iter()
                        .find(|n| self.params.iter().any(|(p, _)| p == *n))
                })
                .cloned()
                .unwrap_or_else(|| name.to_string())
        };
        let names = self
            .params
            .iter()
            .chain(&self.buffers)
            .map(|(n, _)| n.clone())
            .chain(self.tree.ties().iter().flatten().cloned());
        let mut used: Vec<String> = names
            .filter(|n| uses.iter().any(|u| crate::models::under(n, u)))
            .map(|n| own(&n))
            .collect();
        used.sort();
        used.dedup();
        used
    }

    /// [`Model::cut_at`]: the forward pass cut at the calls of `units`.
    pub(super) fn cut_into_pieces(&self, units: &[String]) -> Result<(), String> {
        let units: Vec<String> = units.iter().filter(|u| !u.is_empty()).cloned().collect();
        let why = |message: String| {
            format!(
                "TorchScript model {}: hearth cannot run it unit by unit: {message}",
                self.path.display()
            )
        };
        if let Some((done, _)) = self.pieces.get() {
            return match *done == units {
                true => Ok(()),
                false => Err(why(format!(
                    "it was already cut at other units ({})",
                    done.join(", ")
                ))),
            };
        }
        let mut loaded = lock(&self.loaded);
        let cut = loaded.module.cut(&units).map_err(|e| why(first_line(&e)))?;
        let inputs = match self.output {
            ModelOutput::Logits => 1,
            ModelOutput::Loss => 2,
        };
        let found = cut.pieces();
        if found.first().map(|p| p.inputs) != Some(inputs)
            || found.last().map(|p| p.outputs) != Some(1)
        {
            return Err(why(format!(
                "its forward pass takes {} tensors and gives {}; hearth gives it {inputs} and takes one",
                found.first().map_or(0, |p| p.inputs),
                found.last().map_or(0, |p| p.outputs)
            )));
        }
        let pieces = found
            .iter()
            .enumerate()
            .map(|(index, p)| {
                let used = self.tensors_used(&p.uses);
                Piece {
                    loaded: self.loaded.clone(),
                    index,
                    unpack_labels: index == 0 && self.output == ModelOutput::Loss,
                    weights: self
                        .params
                        .iter()
                        .filter(|(n, _)| used.contains(n))
                        .map(|(_, t)| t.shallow_clone())
                        .collect(),
                    tensors: used,
                    path: self.path.clone(),
                }
            })
            .collect();
        loaded.cut = Some(cut);
        drop(loaded);
        let _ = self.pieces.set((units, pieces));
        Ok(())
    }
}
