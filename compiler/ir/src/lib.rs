//! braid-ir: see ARCHITECTURE.md.

pub mod graph;
pub mod kernel;
pub mod loss;
pub mod settings;
