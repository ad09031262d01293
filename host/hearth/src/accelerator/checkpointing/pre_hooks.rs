//! Accelerate's `register_save_state_pre_hook` and
//! `register_load_state_pre_hook` as Rust closures, for code the user
//! trusts (untrusted code is a checkpoint hook plugin, run in the sandbox).
//! Registering returns a [`RemovableHandle`]; dropping it or calling
//! [`RemovableHandle::remove`] unregisters the hook.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// A save pre-hook: Accelerate's `hook(models, weights, output_dir)`. It
/// gets each prepared model's weights (name and tensor, in prepare order)
/// about to be written and the checkpoint folder being written (staged:
/// files the hook writes there are committed with the checkpoint). It may
/// change the tensors or remove a model's entry — a hook that saves a
/// model itself removes it — and what is left is written as
/// `model.safetensors`, `model_1.safetensors`, … in its new order, as
/// Accelerate enumerates what is left. Runs on the processes that write
/// the checkpoint.
pub type SaveStatePreHook = Box<dyn FnMut(&mut Vec<Vec<(String, Tensor)>>, &Path) + Send>;

/// A load pre-hook: Accelerate's `hook(models, input_dir)`, with each
/// model given by its index in prepare order. It gets the models hearth is
/// about to read, in the order of the checkpoint's model files, and the
/// checkpoint folder; a hook that loads a model itself removes its index,
/// and the models left read `model.safetensors`, `model_1.safetensors`, …
/// in their order.
pub type LoadStatePreHook = Box<dyn FnMut(&mut Vec<usize>, &Path) + Send>;

type Hooks<H> = Arc<Mutex<BTreeMap<u64, H>>>;

/// The registered pre-hooks, run in the order they were registered.
#[derive(Default)]
pub(crate) struct PreHooks {
    save: Hooks<SaveStatePreHook>,
    load: Hooks<LoadStatePreHook>,
    next: AtomicU64,
}

/// Unregisters its hook when dropped or on [`remove`](Self::remove)
/// (`torch.utils.hooks.RemovableHandle`).
#[must_use = "the hook is unregistered when its handle is dropped"]
pub struct RemovableHandle {
    remove: Option<Box<dyn FnOnce() + Send>>,
}

impl RemovableHandle {
    /// Unregisters the hook now.
    pub fn remove(mut self) {
        if let Some(remove) = self.remove.take() {
            remove();
        }
    }
}

impl Drop for RemovableHandle {
    fn drop(&mut self) {
        if let Some(remove) = self.remove.take() {
            remove();
        }
    }
}

fn register<H: Send + 'static>(hooks: &Hooks<H>, id: u64, hook: H) -> RemovableHandle {
    hooks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, hook);
    let weak = Arc::downgrade(hooks);
    RemovableHandle {
        remove: Some(Box::new(move || {
            if let Some(hooks) = weak.upgrade() {
                hooks.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            }
        })),
    }
}

impl PreHooks {
    pub(crate) fn add_save(&self, hook: SaveStatePreHook) -> RemovableHandle {
        register(&self.save, self.next.fetch_add(1, Ordering::Relaxed), hook)
    }

    pub(crate) fn add_load(&self, hook: LoadStatePreHook) -> RemovableHandle {
        register(&self.load, self.next.fetch_add(1, Ordering::Relaxed), hook)
    }

    /// Runs the save pre-hooks on `weights` for the checkpoint in `folder`.
    pub(crate) fn before_save(&self, weights: &mut Vec<Vec<(String, Tensor)>>, folder: &Path) {
        let mut hooks = self.save.lock().unwrap_or_else(|p| p.into_inner());
        for hook in hooks.values_mut() {
            hook(weights, folder);
        }
    }

    /// Runs the load pre-hooks; returns the indices of the models left to
    /// read, in file order, or why the hooks left an impossible list.
    pub(crate) fn before_load(&self, models: usize, folder: &Path) -> Result<Vec<usize>, String> {
        let mut order: Vec<usize> = (0..models).collect();
        let mut hooks = self.load.lock().unwrap_or_else(|p| p.into_inner());
        for hook in hooks.values_mut() {
            hook(&mut order, folder);
        }
        let mut seen = std::collections::BTreeSet::new();
        for &i in &order {
            if i >= models || !seen.insert(i) {
                return Err(format!(
                    "a load_state pre-hook left the model list {order:?}: each entry must be one of the {models} prepared models' indices (0 to {}), at most once",
                    models.saturating_sub(1)
                ));
            }
        }
        Ok(order)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_hooks_run_in_order_until_removed_and_an_impossible_list_is_refused() {
        let hooks = PreHooks::default();
        let drop_first = hooks.add_load(Box::new(|models, _| {
            models.remove(0);
        }));
        let reverse = hooks.add_load(Box::new(|models, _| models.reverse()));
        assert_eq!(hooks.before_load(3, Path::new("ck")), Ok(vec![2, 1]));
        drop(reverse);
        assert_eq!(hooks.before_load(3, Path::new("ck")), Ok(vec![1, 2]));
        drop_first.remove();
        assert_eq!(hooks.before_load(3, Path::new("ck")), Ok(vec![0, 1, 2]));
        for bad in [vec![3], vec![1, 1]] {
            let _h = hooks.add_load(Box::new(move |models, _| *models = bad.clone()));
            let err = hooks.before_load(3, Path::new("ck")).unwrap_err();
            assert!(
                err.contains("a load_state pre-hook left the model list") && err.contains("0 to 2"),
                "{err}"
            );
        }
    }
}
