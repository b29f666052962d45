//! braid-passes: the planning half of the compiler — the cost model, the fused-pipeline
//! scheduler and the cluster simulator (the graph passes will join them here).
//!
//! Everything in this crate is pure computation over values: it never reads files, never
//! prints and never links libtorch, so `braid plan` and `braid sim` run anywhere. Every random
//! choice comes from an explicit seed, so the same input gives byte-identical output.

pub mod cluster;
pub mod cost;
pub mod fused_pipeline;
pub mod prng;
pub mod sim;
