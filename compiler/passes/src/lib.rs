//! braid-passes: the planning half of the compiler — the planner's passes over the task graph
//! (`passes/`, one file each, run by a [`passes::PassManager`]), the estimates that price their
//! decisions on `braid-cost`'s cost model, the lowering of a plan to the simulator, and what
//! `braid plan` / `braid sim` show.
//!
//! Everything in this crate is pure computation over values: it never reads files, never
//! prints and never links libtorch, so `braid plan` and `braid sim` run anywhere. Every random
//! choice comes from an explicit seed, so the same input gives byte-identical output.

pub mod annotated;
pub mod baselines;
pub mod estimate;
pub mod passes;
pub mod render;
pub mod to_sim;

// The planner prices with the cost model and simulates on `braid-cost`; its modules are
// re-exported under their old names so that `crate::cost`, `crate::sim` read as before.
pub use braid_cost::{cluster, cost, fused_pipeline, prng, sim};
