//! braid-passes: the planning half of the compiler — the planner's passes over the task graph
//! (`passes/`, one file each, run by a [`passes::PassManager`]), the cost model, the
//! fused-pipeline scheduler, the cluster simulator, and what `braid plan` / `braid sim` show.
//!
//! Everything in this crate is pure computation over values: it never reads files, never
//! prints and never links libtorch, so `braid plan` and `braid sim` run anywhere. Every random
//! choice comes from an explicit seed, so the same input gives byte-identical output.

pub mod annotated;
pub mod cluster;
pub mod cost;
pub mod estimate;
pub mod fused_pipeline;
pub mod passes;
pub mod prng;
pub mod render;
pub mod sim;
pub mod to_sim;
