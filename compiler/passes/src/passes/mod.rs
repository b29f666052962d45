//! The planner's passes over an [`Annotated`] plan, one file each, and the manager that runs
//! them in order.
//!
//! Order, and why (the design sketch lists `sample-split` first; it moved after `place`):
//!
//! 1. `place` — every call needs devices and a layout before anything can be priced;
//! 2. `sample-split` — chooses the migration threshold `R_t` by simulating the placed plan, and
//!    moves streaming consumers onto the devices the tail frees;
//! 3. `microbatch-interleave` — needs the trains' meshes and pipeline degrees;
//! 4. `reshard-insert` — needs every call's final layout;
//! 5. `speculate` — needs the generation's mesh and batch.
//!
//! Every pass also runs alone (tests do that): a call without a decided placement gets the
//! heuristic one ([`crate::estimate::placements`]). In debug and test builds the manager runs
//! [`braid_ir::graph::TaskGraph::verify`] after every pass, so a pass that breaks the graph
//! fails at once, naming itself. Passes never print; they record decisions and reasons.

pub mod microbatch_interleave;
pub mod place;
pub mod reshard_insert;
pub mod sample_split;
pub mod speculate;

use std::collections::BTreeSet;
use std::fmt;

use crate::annotated::Annotated;

/// Why planning failed (not a user error: the user-facing problems are diagnostics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassError(pub String);

impl fmt::Display for PassError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PassError {}

/// One planning pass.
pub trait Pass {
    /// The kebab-case name of `--disable-pass` and `--dump-after`.
    fn name(&self) -> &'static str;
    /// One line for `--help` and the docs.
    fn summary(&self) -> &'static str;
    fn run(&self, plan: &mut Annotated) -> Result<(), PassError>;
}

/// Every pass, in the order they run.
pub fn all_passes() -> Vec<Box<dyn Pass>> {
    vec![
        Box::new(place::Place),
        Box::new(sample_split::SampleSplit),
        Box::new(microbatch_interleave::MicrobatchInterleave),
        Box::new(reshard_insert::ReshardInsert),
        Box::new(speculate::Speculate),
    ]
}

/// The pass names, in order.
pub fn pass_names() -> Vec<&'static str> {
    all_passes().iter().map(|p| p.name()).collect()
}

/// Runs the passes in order, skipping disabled ones.
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
    disabled: BTreeSet<String>,
    verify: bool,
}

impl fmt::Debug for PassManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PassManager")
            .field("passes", &pass_names())
            .field("disabled", &self.disabled)
            .finish()
    }
}

impl PassManager {
    /// All passes, verifying between them in debug and test builds.
    pub fn new() -> PassManager {
        PassManager {
            passes: all_passes(),
            disabled: BTreeSet::new(),
            verify: cfg!(debug_assertions),
        }
    }

    /// Disables the named passes; an unknown name is an error listing the known ones.
    pub fn disable<S: AsRef<str>>(mut self, names: &[S]) -> Result<PassManager, PassError> {
        for n in names {
            let n = n.as_ref();
            if !self.passes.iter().any(|p| p.name() == n) {
                return Err(PassError(format!(
                    "unknown pass `{n}`; the passes are {}",
                    pass_names().join(", ")
                )));
            }
            self.disabled.insert(n.to_string());
        }
        Ok(self)
    }

    pub fn is_enabled(&self, name: &str) -> bool {
        !self.disabled.contains(name)
    }

    /// Runs the enabled passes; `after` sees the plan after each pass that ran.
    pub fn run(
        &self,
        plan: &mut Annotated,
        mut after: impl FnMut(&str, &Annotated),
    ) -> Result<(), PassError> {
        plan.enabled = self
            .passes
            .iter()
            .map(|p| p.name())
            .filter(|n| !self.disabled.contains(*n))
            .map(str::to_string)
            .collect();
        for pass in &self.passes {
            if self.disabled.contains(pass.name()) {
                continue;
            }
            run_one(pass.as_ref(), plan, self.verify)?;
            after(pass.name(), plan);
        }
        Ok(())
    }
}

impl Default for PassManager {
    fn default() -> Self {
        PassManager::new()
    }
}

/// Runs one pass and (when `verify`) the graph verifier after it.
pub fn run_one(pass: &dyn Pass, plan: &mut Annotated, verify: bool) -> Result<(), PassError> {
    pass.run(plan)?;
    plan.decisions.passes_run.push(pass.name().to_string());
    if verify && let Err(e) = plan.plan.graph.verify() {
        return Err(PassError(format!(
            "the graph is malformed after pass `{}`: {e}",
            pass.name()
        )));
    }
    Ok(())
}

/// A copy of `a` as the later passes will leave it, for simulating a decision in context:
/// `microbatch-interleave` (when `interleave`) and `reshard-insert` run on the copy, so the
/// simulated iteration includes fused training and the reshard and offload tasks.
pub(crate) fn completed(a: &Annotated, interleave: bool) -> Result<Annotated, PassError> {
    let mut probe = a.clone();
    if interleave {
        microbatch_interleave::MicrobatchInterleave.run(&mut probe)?;
    }
    reshard_insert::ReshardInsert.run(&mut probe)?;
    Ok(probe)
}
