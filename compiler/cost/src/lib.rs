//! braid-cost: what Braid knows about hardware and time, independent of any program — the cost
//! model (device table, model shapes, compute and transfer times, memory needs), cluster specs,
//! the discrete-event cluster simulator, and the fused-pipeline scheduler of RLHFuse's
//! intra-stage fusion.
//!
//! Architecture Invariant: this crate knows nothing of the IR, the checker or the planner (no
//! `braid-*` dependency; `tests/architecture.rs`). The planner (`braid-passes`) lowers plans to
//! the simulator's DAG and prices its decisions with the cost model; the plan format
//! (`braid-ir`) embeds the cluster and model shapes defined here. Everything is pure
//! computation: no files, no printing, every random choice from an explicit seed.

pub mod cluster;
pub mod cost;
pub mod fused_pipeline;
pub mod prng;
pub mod sim;
