//! `hearth report`: a run's curves from its folder alone, offline — the
//! history every run keeps ([`hearth::train::History`], `metrics.jsonl`),
//! its config and summary —
//! drawn as one self-contained `report.html` (inline SVG) and a PNG per
//! metric; several runs overlaid, with the config keys they differ in.

mod html;
mod plot;
mod runs;
mod write;

pub use write::*;
