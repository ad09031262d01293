//! The host side of each interface of hearth's worlds, one file per
//! interface, all on [`PluginState`](crate::sandbox::PluginState).

mod delivery;
mod log;
mod tensors;
mod types;
