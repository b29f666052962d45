//! The CPU kernels of cached steps: the thin-product kernel (`gemm`), the decode-attention
//! kernel (`attention`), the host-memory layer step that uses them (`step`) and the worker team
//! they share (`team`). This layer knows slices and shapes, not models: `models::model` decides
//! where a step runs on these kernels. With the weight mapping, these are the crate's only
//! `unsafe` code.

pub mod attention;
pub mod gemm;
pub(crate) mod step;
pub(crate) mod team;
