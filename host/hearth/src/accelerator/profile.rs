//! `Accelerator::profile`: Accelerate's profiling block.

use super::Accelerator;
use crate::profiling::{ProfileError, ProfileKwargs, Profiler};

impl Accelerator {
    /// Profiles what `body` runs with libtorch's profiler, as Accelerate's
    /// `with accelerator.profile(handler) as prof:` does: `kwargs`, else
    /// the builder's [`profile_kwargs`](super::AcceleratorBuilder::profile_kwargs),
    /// else the defaults (everything recorded, nothing written). With a
    /// schedule, `body` calls [`Profiler::step`] once per step. With
    /// `output_trace_dir`, the last trace is written there as
    /// `profile_<process index>.json` and every process waits for the
    /// others. `body`'s value is returned; an error of its own stays in it.
    pub fn profile<R>(
        &self,
        kwargs: Option<&ProfileKwargs>,
        body: impl FnOnce(&mut Profiler) -> R,
    ) -> Result<R, ProfileError> {
        let default = ProfileKwargs::default();
        let kwargs = kwargs.or(self.profile_handler.as_ref()).unwrap_or(&default);
        let mut profiler = Profiler::start_with_metadata(kwargs, self.profiler_metadata())?;
        let value = body(&mut profiler);
        match &kwargs.output_trace_dir {
            Some(dir) => {
                profiler.stop_and_export(dir, self.process_index())?;
                self.wait_for_everyone()?;
            }
            None => drop(profiler.stop()?),
        }
        Ok(value)
    }

    /// What a trace records of the process group with several processes
    /// (torch.profiler's `distributedInfo`, which trace readers such as
    /// HTA use to tell ranks apart).
    pub(crate) fn profiler_metadata(&self) -> Vec<(String, String)> {
        if self.num_processes() == 1 {
            return Vec::new();
        }
        let info = serde_json::json!({
            "backend": self.process_group().backend(),
            "rank": self.process_index(),
            "world_size": self.num_processes(),
        });
        vec![("distributedInfo".to_string(), info.to_string())]
    }
}
