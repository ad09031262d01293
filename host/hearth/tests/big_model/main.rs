//! Accelerate's big-model utilities: module sizes and device maps, and
//! loading checkpoints into dispatched models.

mod loading;
mod sizes;
