//! Accelerate's big-model utilities, on hearth's [`ModuleTree`]: how large
//! each module is, which device each module goes to when a model is larger
//! than one device (`infer_auto_device_map`), loading a checkpoint straight
//! onto those devices with the rest offloaded to disk in Accelerate's
//! layout, and running such a model (`dispatch_model`).
//!
//! The functions keep Accelerate's names, arguments and results, so that a
//! device map or an offload folder made by one is read by the other; the
//! tests run Accelerate's own functions on the same PyTorch modules as the
//! oracle. Where hearth differs it says so on the function.
//!
//! [`ModuleTree`]: crate::models::ModuleTree

mod balance;
mod device_map;
mod dispatch;
mod error;
mod estimate;
mod handles;
mod loading;
mod memory;
mod offload;
mod sizes;
mod state_dict;

pub use balance::get_balanced_memory;
pub use device_map::{
    check_device_map, clean_device_map, device_of, infer_auto_device_map, AutoDeviceMapOptions,
    DeviceMap,
};
pub use dispatch::{dispatch_model, DispatchOptions, DispatchedModel};
pub use error::*;
pub use estimate::{estimate_memory, MemoryEstimate, ESTIMATE_DTYPES};
pub use handles::{retie_parameters, set_module_tensor_to_device};
pub use loading::{load_checkpoint_in_model, LoadOptions, LoadedCheckpoint};
pub use memory::{get_max_memory, parse_max_memory, parse_memory_size, MapDevice, MaxMemory};
pub use offload::{
    load_offloaded_weight, load_offloaded_weights, offload_state_dict, offload_weight,
    read_offload_index, save_offload_index, OffloadEntry, OffloadIndex, OffloadedWeightsLoader,
    OFFLOAD_INDEX_NAME,
};
pub use sizes::{
    calculate_maximum_sizes, compute_module_sizes, compute_module_total_buffer_size,
    get_max_layer_size, largest_layer, parse_dtype, ModuleSizes,
};
pub use state_dict::load_state_dict;
