//! `hearth:plugin/types`: types only, nothing the host implements.

use super::super::tracker::hearth::plugin::types;
use crate::sandbox::PluginState;

impl types::Host for PluginState {}
