//! braid-ir: see ARCHITECTURE.md.

pub mod kernel;
