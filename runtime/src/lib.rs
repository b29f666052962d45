//! Braid's runtime: models, the generation engine, inference, training and the executor of a
//! `Plan`. This is the only crate in the workspace that links libtorch (through `tch`); the
//! compiler crates never depend on it.

pub mod device;
