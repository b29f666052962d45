//! braid-ir: see ARCHITECTURE.md.

pub mod exec_plan;
pub mod graph;
pub mod kernel;
pub mod loss;
pub mod settings;
pub mod transfer;
