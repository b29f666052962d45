//! The simulator's input: a DAG of tasks, each with its work and the devices it occupies, built
//! with [`DagBuilder`].
//!
//! The lowering of `.rlhf` programs will produce these DAGs; until then tests and studies build
//! them by hand. The builder checks the DAG once, in [`DagBuilder::build`], so the engine can
//! trust it. This module only describes work; it must not simulate (that is `engine.rs`).

use std::fmt;

use serde::Serialize;

use crate::cost::{CostModel, Layout, ModelShape};
use crate::sim::lengths::LengthDist;

/// A task's index in its DAG.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct TaskId(pub usize);

/// Long-tail migration: when no more than `threshold` samples are still decoding, the
/// remaining ones move (with their KV caches) onto the first `to_instances` instances, and the
/// devices of the others are released for other tasks (RLHFuse §4).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Migration {
    pub threshold: u64,
    pub to_instances: u64,
}

/// A generation stage: `samples` prompts of `prompt_len` tokens, split evenly over
/// `instances` engine instances (each on an equal share of the task's devices, tensor-parallel
/// inside), decoded in lock-step batches of at most `max_batch` running samples. A decode
/// step's time comes from the cost model as a function of the live batch, so the long tail
/// runs at small batch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GenerateSpec {
    pub samples: u64,
    /// Samples per prompt (`n` of the `generate`, 1 for one each): an admission prefills each
    /// prompt once for all of its samples ([`CostModel::shared_prefill_time`]).
    pub samples_per_prompt: u64,
    pub prompt_len: u64,
    pub instances: u64,
    pub lengths: LengthDist,
    pub model: ModelShape,
    pub cost: CostModel,
    pub migration: Option<Migration>,
    /// Running samples an instance holds at most (Braid's engine: [`ENGINE_MAX_BATCH`]); the
    /// rest wait and are prefilled and admitted as rows free (continuous batching). `None`:
    /// every sample runs from the start.
    pub max_batch: Option<u64>,
    /// Pipeline stages inside each instance (1 for Braid's engine, which decodes with tensor
    /// parallelism only; more for a system that pipelines generation, as ReaL's heuristic
    /// does): each instance's devices split into `stages` stages of `devices / instances /
    /// stages` tensor-parallel devices, and a step costs
    /// [`crate::cost::CostModel::pipelined_decode_step_time`].
    pub stages: u64,
}

/// Running samples one instance of Braid's generation engine holds at most
/// (`braid_runtime::EngineOptions::max_batch`'s default, which reads this constant).
pub const ENGINE_MAX_BATCH: u64 = 32;

/// What a task does.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Work {
    /// A fixed duration (e.g. a training step from [`CostModel::train_step_time`]).
    Fixed {
        seconds: f64,
    },
    Generate(Box<GenerateSpec>),
    /// Per-sample work (log-probs, values, scores) on `replicas` data-parallel replicas, each
    /// on an equal share of the task's devices (`stages` pipeline stages inside). A replica
    /// takes up to `chunk` samples per micro-batch; a micro-batch takes `chunk_fixed +
    /// per_sample · n` seconds in each stage, and a replica's run of micro-batches issued back
    /// to back pays the first one's crossing of the other `stages − 1` stages once
    /// ([`Work::run_time`]). When it streams from a generation task it starts on the samples
    /// already emitted and follows the rest as they come, each free replica taking a share of
    /// what waits (and holding only its own devices while it runs).
    PerSample {
        samples: u64,
        chunk: u64,
        chunk_fixed: f64,
        per_sample: f64,
        stages: u64,
        replicas: u64,
    },
    /// An exchange among the ranks of its devices (the runtime's all-gathers on CPU ranks),
    /// which costs the last rank to arrive what `by_skew` gives at the skew of their arrivals:
    /// `(skew, seconds)` points, sorted by skew, the first at skew 0 (every rank at once),
    /// interpolated linearly and flat beyond the last. The simulator runs a data-parallel
    /// call's ranks as one task ending together; the runtime's ranks end apart, by about
    /// `range` × the seconds since they last met in an exchange (or since the iteration
    /// began), the expected range of their finishing times (see
    /// [`crate::cost::CostModel::arrival_range`]). [`Work::exchange_seconds`].
    Exchange {
        by_skew: Vec<(f64, f64)>,
        range: f64,
    },
}

impl Work {
    /// Seconds of [`Work::Exchange`] when its ranks last met `since` seconds ago; 0 for other
    /// work.
    pub fn exchange_seconds(&self, since: f64) -> f64 {
        let Work::Exchange { by_skew, range } = self else {
            return 0.0;
        };
        if by_skew.is_empty() {
            return 0.0;
        }
        crate::cost::device::interpolate(by_skew, (range * since).max(0.0))
    }

    /// Per-sample work from the cost model: a forward pass over the whole sequence of each
    /// sample on `replicas` data-parallel replicas with the given layout inside each; the
    /// micro-batch's fixed cost is reading the weights once (what a tiny micro-batch pays for).
    pub fn inference(
        cost: &CostModel,
        model: &ModelShape,
        layout: Layout,
        replicas: u64,
        samples: u64,
        seq_len: u64,
        chunk: u64,
    ) -> Work {
        // Per pipeline stage: micro-batches issued back to back leave one stage apart.
        let pp = layout.pp.max(1) as f64;
        // Its ranks compute at once and the call ends with the slowest of them.
        let ranks = replicas.max(1) * layout.tp.max(1) * layout.pp.max(1);
        let slow = cost.slowest_of(ranks);
        let one = cost.forward_time(model, layout, 1, seq_len) / pp * slow;
        let many = cost.forward_time(model, layout, chunk.max(1), seq_len) / pp * slow;
        // A linear fit through micro-batch sizes 1 and `chunk`: small ones are dominated by
        // the weight reads, large ones by compute.
        let per_sample = if chunk > 1 {
            ((many - one) / (chunk - 1) as f64).max(0.0)
        } else {
            one
        };
        let chunk_fixed = (one - per_sample).max(0.0);
        Work::PerSample {
            samples,
            chunk: chunk.max(1),
            chunk_fixed,
            per_sample,
            stages: layout.pp.max(1),
            replicas: replicas.max(1),
        }
    }

    /// Seconds one replica of per-sample work takes for a run of `n` samples issued back to
    /// back: `⌈n/chunk⌉` micro-batches through the first stage, plus the first micro-batch's
    /// crossing of the other stages. 0 for other work.
    pub fn run_time(&self, n: u64) -> f64 {
        let Work::PerSample {
            chunk,
            chunk_fixed,
            per_sample,
            stages,
            ..
        } = self
        else {
            return 0.0;
        };
        if n == 0 {
            return 0.0;
        }
        let chunk = (*chunk).max(1);
        let first = n.min(chunk) as f64;
        let fill = ((*stages).max(1) - 1) as f64 * (chunk_fixed + per_sample * first);
        fill + n.div_ceil(chunk) as f64 * chunk_fixed + n as f64 * per_sample
    }
}

/// One task of the DAG.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TaskSpec {
    pub name: String,
    /// The stage this task belongs to in reports (`generate`, `inference`, `train`, …).
    pub stage: String,
    pub devices: Vec<usize>,
    pub work: Work,
    /// Tasks that must finish before this one starts.
    pub deps: Vec<TaskId>,
    /// A generation task whose samples this per-sample task consumes as they are emitted.
    pub stream_from: Option<TaskId>,
}

/// A checked DAG over `devices` devices, tasks in creation order (a topological order).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Dag {
    pub devices: usize,
    pub tasks: Vec<TaskSpec>,
    /// The devices are multi-core hosts (CPUs) on which the generation engine and the
    /// inference it streams into run on threads of their own, as Braid's runtime runs them,
    /// each on a core ([`crate::cost::DeviceSpec::spare_core`]): a streaming consumer's chunk
    /// may run on a device its producer holds.
    pub threaded: bool,
}

/// Why a DAG is malformed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DagError(pub String);

impl fmt::Display for DagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DagError {}

/// Builds a [`Dag`]. A task may only depend on tasks created before it, so every DAG built
/// this way is acyclic by construction.
#[derive(Debug)]
pub struct DagBuilder {
    dag: Dag,
    errors: Vec<String>,
}

impl DagBuilder {
    pub fn new(devices: usize) -> DagBuilder {
        DagBuilder {
            dag: Dag {
                devices,
                tasks: Vec::new(),
                threaded: false,
            },
            errors: Vec::new(),
        }
    }

    /// Marks the devices as threaded hosts (see [`Dag::threaded`]).
    pub fn threaded(&mut self, yes: bool) -> &mut DagBuilder {
        self.dag.threaded = yes;
        self
    }

    /// Adds a task; returns its id.
    pub fn task(
        &mut self,
        name: &str,
        stage: &str,
        devices: impl IntoIterator<Item = usize>,
        work: Work,
    ) -> TaskId {
        self.dag.tasks.push(TaskSpec {
            name: name.to_string(),
            stage: stage.to_string(),
            devices: devices.into_iter().collect(),
            work,
            deps: Vec::new(),
            stream_from: None,
        });
        TaskId(self.dag.tasks.len() - 1)
    }

    /// `task` starts only after `dep` has finished.
    pub fn after(&mut self, task: TaskId, dep: TaskId) -> &mut DagBuilder {
        if dep.0 >= task.0 || task.0 >= self.dag.tasks.len() {
            self.errors.push(format!(
                "task {} cannot depend on task {}: dependencies must be created first",
                task.0, dep.0
            ));
        } else if !self.dag.tasks[task.0].deps.contains(&dep) {
            self.dag.tasks[task.0].deps.push(dep);
        }
        self
    }

    /// `consumer` (per-sample work) processes `producer`'s (a generation's) samples as they
    /// are emitted, rather than after it finishes.
    pub fn stream(&mut self, consumer: TaskId, producer: TaskId) -> &mut DagBuilder {
        if producer.0 >= consumer.0 || consumer.0 >= self.dag.tasks.len() {
            self.errors.push(format!(
                "task {} cannot stream from task {}: producers must be created first",
                consumer.0, producer.0
            ));
        } else {
            self.dag.tasks[consumer.0].stream_from = Some(producer);
        }
        self
    }

    /// Checks the DAG: devices in range and not repeated, positive finite work, streaming
    /// only from a generation into per-sample work of the same number of samples, instances
    /// that split the generation's devices evenly.
    pub fn build(self) -> Result<Dag, DagError> {
        if let Some(e) = self.errors.first() {
            return Err(DagError(e.clone()));
        }
        let dag = self.dag;
        if dag.devices == 0 {
            return Err(DagError("a DAG needs at least one device".into()));
        }
        for (i, t) in dag.tasks.iter().enumerate() {
            let err = |what: String| Err(DagError(format!("task {i} `{}`: {what}", t.name)));
            if t.devices.is_empty() {
                return err("occupies no device".into());
            }
            let mut sorted = t.devices.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != t.devices.len() {
                return err("lists a device twice".into());
            }
            if let Some(&d) = sorted.last()
                && d >= dag.devices
            {
                return err(format!(
                    "device {d} is out of range (the DAG has {})",
                    dag.devices
                ));
            }
            match &t.work {
                Work::Fixed { seconds } => {
                    if !(seconds.is_finite() && *seconds >= 0.0) {
                        return err("duration must be finite and non-negative".into());
                    }
                }
                Work::Exchange { by_skew, range } => {
                    let finite = |x: f64| x.is_finite() && x >= 0.0;
                    if by_skew.first().is_none_or(|p| p.0 != 0.0)
                        || by_skew.windows(2).any(|w| w[1].0 <= w[0].0)
                        || by_skew.iter().any(|p| !finite(p.0) || !finite(p.1))
                        || !finite(*range)
                    {
                        return err(
                            "an exchange needs its times by skew sorted from skew 0, finite and non-negative, and a finite non-negative range"
                                .into(),
                        );
                    }
                }
                Work::Generate(g) => {
                    if g.samples == 0 || g.instances == 0 {
                        return err("generation needs samples and instances".into());
                    }
                    if !(t.devices.len() as u64).is_multiple_of(g.instances) {
                        return err(format!(
                            "{} devices do not split into {} instances",
                            t.devices.len(),
                            g.instances
                        ));
                    }
                    if let Some(m) = &g.migration
                        && (m.to_instances == 0 || m.to_instances > g.instances)
                    {
                        return err("migration must keep between 1 and all instances".into());
                    }
                }
                Work::PerSample {
                    samples,
                    chunk,
                    chunk_fixed,
                    per_sample,
                    stages,
                    replicas,
                } => {
                    if *samples == 0 || *chunk == 0 {
                        return err("per-sample work needs samples and a chunk size".into());
                    }
                    if *stages == 0
                        || *replicas == 0
                        || !(t.devices.len() as u64).is_multiple_of(*replicas)
                    {
                        return err(format!(
                            "per-sample work needs stages and replicas, and its {} devices split \
                             evenly over its {} replicas",
                            t.devices.len(),
                            replicas
                        ));
                    }
                    if !(chunk_fixed.is_finite()
                        && per_sample.is_finite()
                        && *chunk_fixed >= 0.0
                        && *per_sample >= 0.0)
                    {
                        return err("per-sample costs must be finite and non-negative".into());
                    }
                }
            }
            if let Some(p) = t.stream_from {
                let producer = &dag.tasks[p.0];
                let (Work::Generate(g), Work::PerSample { samples, .. }) =
                    (&producer.work, &t.work)
                else {
                    return err(
                        "only per-sample work can stream, and only from a generation".into(),
                    );
                };
                if g.samples != *samples {
                    return err(format!(
                        "streams {} samples from `{}`, which emits {}",
                        samples, producer.name, g.samples
                    ));
                }
            }
        }
        Ok(dag)
    }
}
