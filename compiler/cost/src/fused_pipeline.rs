//! The fused-pipeline scheduler: RLHFuse's intra-stage fusion (arXiv 2409.13221, §5).
//!
//! Two or more trained models (actor, critic) share the same `S` devices with pipeline
//! parallelism. The first model is an `S`-stage pipeline running forward (stage `j` on device
//! `j`); every other model has `pp` dividing `S`, runs as `S / pp` replicas and runs in the
//! *reverse* direction (its stage `j` of replica `r` is on device `S - 1 - (r * pp + j)`), so the
//! warm-up and drain bubbles of one model are filled by the other's work. Each micro-batch is a
//! chain of subtasks: forward through the stages in the model's direction, then backward through
//! them in the opposite direction; a stage holds the micro-batch's activations from its forward
//! to its backward there.
//!
//! The search works on per-device *orders*: a schedule is, for every device, the sequence in
//! which it runs its subtasks; start times follow from the orders by a linear-time simulation
//! (each subtask starts when its device is free and its chain predecessor has ended). The
//! phases, in order (see `docs/planning.md`): an urgency-driven active list schedule; randomised
//! forward–backward improvement; simulated annealing on latency (both stop at the
//! [`lower_bound`]); then, never losing latency, memory-capped forward–backward rounds and
//! simulated annealing on peak activation memory. Every result passes [`validate_schedule`].
//! Everything is seeded and bounded by iteration counts, so results are deterministic. The
//! module must not do I/O or print: the CLI reads spec files and prints.

use std::fmt;

use serde::{Deserialize, Serialize};

pub mod spec;
pub use spec::{Grid, PipelineSpec, RealSchedule};

use crate::prng::Rng;

/// The input: how many devices (stages) and the models that share them.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PipelineProblem {
    pub stages: usize,
    pub models: Vec<PipelineModel>,
    /// Search settings; absent = [`SearchOptions::default`].
    #[serde(default)]
    pub search: SearchOptions,
}

/// One trained model: its pipeline depth, micro-batches per replica, and per-stage subtask
/// durations (any time unit, integers so that results are exact) and activation memory.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PipelineModel {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub pp: usize,
    pub microbatches: usize,
    pub fwd: u64,
    pub bwd: u64,
    #[serde(default = "one")]
    pub mem_per_microbatch: u64,
}

fn one() -> u64 {
    1
}

/// How long the annealing runs and from which seed. The iteration counts bound the work, so a
/// result never depends on the machine's speed.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SearchOptions {
    pub seed: u64,
    /// Randomised forward–backward improvement rounds (stops early at the lower bound).
    pub improvement_rounds: u64,
    /// Annealing moves spent on latency (the search stops early at the lower bound).
    pub latency_iterations: u64,
    /// Memory-capped forward–backward rounds at unchanged latency.
    pub memory_rounds: u64,
    /// Annealing moves spent on peak memory at unchanged latency.
    pub memory_iterations: u64,
}

impl Default for SearchOptions {
    fn default() -> SearchOptions {
        SearchOptions {
            seed: 0x5EED,
            improvement_rounds: 600,
            latency_iterations: 60_000,
            memory_rounds: 500,
            memory_iterations: 60_000,
        }
    }
}

/// What is wrong with a problem; the message names the field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProblemError(pub String);

impl fmt::Display for ProblemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProblemError {}

impl PipelineProblem {
    /// Parses and validates a problem from JSON text.
    pub fn from_json(text: &str) -> Result<PipelineProblem, ProblemError> {
        let problem: PipelineProblem =
            serde_json::from_str(text).map_err(|e| ProblemError(e.to_string()))?;
        problem.validate()?;
        Ok(problem)
    }

    /// Checks the shape rules: the first model spans all stages, the others divide them, and
    /// every count and duration is positive. Sizes are capped so that a typo cannot make the
    /// solver allocate without bound.
    pub fn validate(&self) -> Result<(), ProblemError> {
        let err = |m: String| Err(ProblemError(m));
        if self.stages == 0 || self.stages > 1024 {
            return err(format!("`stages` must be in 1..=1024, got {}", self.stages));
        }
        if self.models.is_empty() {
            return err("`models` must list at least one model".into());
        }
        if self.models.len() > 8 {
            return err(format!("at most 8 models, got {}", self.models.len()));
        }
        let mut total_tasks = 0usize;
        for (i, m) in self.models.iter().enumerate() {
            if i == 0 && m.pp != self.stages {
                return err(format!(
                    "models[0].pp must equal `stages` ({}), got {}",
                    self.stages, m.pp
                ));
            }
            if m.pp == 0 || !self.stages.is_multiple_of(m.pp) {
                return err(format!(
                    "models[{i}].pp must divide `stages` ({}), got {}",
                    self.stages, m.pp
                ));
            }
            if m.microbatches == 0 || m.microbatches > 4096 {
                return err(format!(
                    "models[{i}].microbatches must be in 1..=4096, got {}",
                    m.microbatches
                ));
            }
            if m.fwd == 0 || m.bwd == 0 {
                return err(format!("models[{i}].fwd and .bwd must be positive"));
            }
            if m.fwd > 1 << 40 || m.bwd > 1 << 40 || m.mem_per_microbatch > 1 << 50 {
                return err(format!("models[{i}]: durations or memory too large"));
            }
            total_tasks += 2 * m.microbatches * self.stages;
        }
        if total_tasks > 2_000_000 {
            return err(format!(
                "{total_tasks} subtasks is too many for the scheduler (limit 2000000)"
            ));
        }
        Ok(())
    }
}

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Fwd,
    Bwd,
}

const NONE: u32 = u32::MAX;

/// One subtask of the expanded problem.
#[derive(Clone, Debug)]
pub struct Subtask {
    pub model: usize,
    pub replica: usize,
    pub microbatch: usize,
    /// Stage index within the model's own pipeline (0 = where forwards start).
    pub stage: usize,
    pub kind: Kind,
    pub device: usize,
    pub duration: u64,
    pub mem: u64,
    /// The subtask that must end before this one starts (the previous link of the chain).
    pred: u32,
    /// `model * 2 + kind`: subtasks of one stream on one device keep micro-batch order.
    stream: u8,
}

/// The problem expanded into subtasks, with the device each one runs on.
#[derive(Clone, Debug)]
pub struct Instance {
    pub stages: usize,
    pub tasks: Vec<Subtask>,
    /// For each task, the next link of its chain (or `NONE`).
    succ: Vec<u32>,
    /// For each task, the longest path after its end through chain edges and stream edges
    /// (the next micro-batch of the same stream on the same device, which in our orders always
    /// runs later): a lower bound on the time the schedule still needs once it ends.
    after: Vec<u64>,
}

/// The device that runs `stage` of `replica` of model `model`.
pub fn device_of(stages: usize, model: usize, pp: usize, replica: usize, stage: usize) -> usize {
    if model == 0 {
        stage
    } else {
        stages - 1 - (replica * pp + stage)
    }
}

impl Instance {
    /// Expands a validated problem into its subtasks.
    pub fn new(problem: &PipelineProblem) -> Instance {
        let s = problem.stages;
        let mut tasks = Vec::new();
        for (mi, m) in problem.models.iter().enumerate() {
            for r in 0..s / m.pp {
                for mb in 0..m.microbatches {
                    // Chain order: fwd 0..pp, then bwd pp-1..0.
                    let base = tasks.len() as u32;
                    for j in 0..m.pp {
                        tasks.push(Subtask {
                            model: mi,
                            replica: r,
                            microbatch: mb,
                            stage: j,
                            kind: Kind::Fwd,
                            device: device_of(s, mi, m.pp, r, j),
                            duration: m.fwd,
                            mem: m.mem_per_microbatch,
                            pred: if j == 0 { NONE } else { base + j as u32 - 1 },
                            stream: (mi * 2) as u8,
                        });
                    }
                    for k in 0..m.pp {
                        let j = m.pp - 1 - k;
                        tasks.push(Subtask {
                            model: mi,
                            replica: r,
                            microbatch: mb,
                            stage: j,
                            kind: Kind::Bwd,
                            device: device_of(s, mi, m.pp, r, j),
                            duration: m.bwd,
                            mem: m.mem_per_microbatch,
                            pred: base + (m.pp + k) as u32 - 1,
                            stream: (mi * 2 + 1) as u8,
                        });
                    }
                }
            }
        }
        let mut succ = vec![NONE; tasks.len()];
        for (i, t) in tasks.iter().enumerate() {
            if t.pred != NONE {
                succ[t.pred as usize] = i as u32;
            }
        }
        let mut after = vec![0u64; tasks.len()];
        // Both successors have larger indices (chains are stored contiguously, last link last,
        // micro-batch by micro-batch), so one backward sweep suffices.
        for i in (0..tasks.len()).rev() {
            let mut a = 0;
            let s = succ[i];
            if s != NONE {
                a = after[s as usize] + tasks[s as usize].duration;
            }
            let t = &tasks[i];
            let pp = problem.models[t.model].pp;
            if t.microbatch + 1 < problem.models[t.model].microbatches {
                let next = i + 2 * pp;
                a = a.max(after[next] + tasks[next].duration);
            }
            after[i] = a;
        }
        Instance {
            stages: s,
            tasks,
            succ,
            after,
        }
    }

    /// The chain predecessor of task `t`, if any.
    pub fn pred(&self, t: usize) -> Option<usize> {
        let p = self.tasks[t].pred;
        (p != NONE).then_some(p as usize)
    }
}

/// Per-device execution orders (task indices into [`Instance::tasks`]).
pub type Orders = Vec<Vec<u32>>;

/// Computes start/end times from per-device orders in linear time. Reuses its buffers, since
/// the annealing calls it hundreds of thousands of times.
#[derive(Debug)]
struct Evaluator {
    end: Vec<u64>,
    done: Vec<bool>,
    pos: Vec<usize>,
    free: Vec<u64>,
    blocked_on: Vec<u32>,
    stack: Vec<usize>,
}

impl Evaluator {
    fn new(inst: &Instance) -> Evaluator {
        Evaluator {
            end: vec![0; inst.tasks.len()],
            done: vec![false; inst.tasks.len()],
            pos: vec![0; inst.stages],
            free: vec![0; inst.stages],
            blocked_on: vec![NONE; inst.stages],
            stack: Vec::with_capacity(inst.stages),
        }
    }

    /// Runs the orders; returns the makespan and the total tardiness against `target`: the sum
    /// over subtasks of how far their end plus the rest of their chain overshoots it. The
    /// tardiness is zero exactly when every chain could still finish by `target`, and unlike the
    /// makespan it moves with every subtask, which gives the annealing a slope to follow on the
    /// plateaus where the makespan does not change. `None` when the orders deadlock (a device
    /// waits for a subtask queued behind its own).
    fn run(&mut self, inst: &Instance, orders: &Orders, target: u64) -> Option<(u64, u64)> {
        self.done.fill(false);
        self.pos.fill(0);
        self.free.fill(0);
        self.blocked_on.fill(NONE);
        self.stack.clear();
        self.stack.extend((0..inst.stages).rev());
        let mut completed = 0usize;
        let mut tardiness = 0u64;
        while let Some(d) = self.stack.pop() {
            let order = &orders[d];
            while self.pos[d] < order.len() {
                let t = order[self.pos[d]] as usize;
                let task = &inst.tasks[t];
                let ready = if task.pred == NONE {
                    0
                } else if self.done[task.pred as usize] {
                    self.end[task.pred as usize]
                } else {
                    self.blocked_on[d] = task.pred;
                    break;
                };
                let start = self.free[d].max(ready);
                let end = start + task.duration;
                self.end[t] = end;
                tardiness += (end + inst.after[t]).saturating_sub(target);
                self.done[t] = true;
                self.free[d] = end;
                self.pos[d] += 1;
                completed += 1;
                let s = inst.succ[t];
                if s != NONE {
                    let ds = inst.tasks[s as usize].device;
                    if self.blocked_on[ds] == t as u32 {
                        self.blocked_on[ds] = NONE;
                        self.stack.push(ds);
                    }
                }
            }
        }
        if completed != inst.tasks.len() {
            return None;
        }
        let makespan = self.free.iter().copied().max().unwrap_or(0);
        Some((makespan, tardiness))
    }
}

/// Peak activation memory of each device for the given orders. A device runs one subtask at a
/// time, so its memory profile is fixed by its order alone: a micro-batch's activations count
/// from the start of its forward to the end of its backward on that device.
fn device_peaks(inst: &Instance, orders: &Orders) -> Vec<u64> {
    orders.iter().map(|order| order_peak(inst, order)).collect()
}

fn order_peak(inst: &Instance, order: &[u32]) -> u64 {
    let mut cur = 0u64;
    let mut peak = 0u64;
    for &t in order {
        let task = &inst.tasks[t as usize];
        match task.kind {
            Kind::Fwd => {
                cur += task.mem;
                peak = peak.max(cur);
            }
            Kind::Bwd => cur = cur.saturating_sub(task.mem),
        }
    }
    peak
}

/// One scheduled subtask in the output.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ScheduledTask {
    pub model: usize,
    pub replica: usize,
    pub microbatch: usize,
    pub kind: Kind,
    pub start: u64,
    pub end: u64,
}

/// How much of each search budget was used (each phase stops early at the lower bound).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SearchStats {
    pub improvement_rounds: u64,
    pub latency_moves: u64,
    pub memory_rounds: u64,
    pub memory_moves: u64,
}

/// The subtasks one device runs, in order.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceSchedule {
    pub device: usize,
    pub peak_memory: u64,
    pub tasks: Vec<ScheduledTask>,
}

/// The solver's answer. Field order is the JSON order.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FusedSchedule {
    pub latency: u64,
    pub lower_bound: u64,
    pub peak_memory: u64,
    pub serial_1f1b_latency: u64,
    pub greedy_latency: u64,
    pub greedy_peak_memory: u64,
    pub search: SearchStats,
    pub schedule: Vec<DeviceSchedule>,
}

/// The lower bound on latency, the maximum of:
/// - every model's own 1F1B critical path `(M + P - 1)(F + B)` (its last stage cannot start
///   before `(P-1)F`, has `M(F+B)` to do, and its last backward still has `(P-1)B` to go);
/// - for every device, its total work plus unavoidable fill and drain: no subtask can start
///   there before the earliest arrival of any model's first forward, and after its last subtask
///   (a backward of some model) that model's backward chain still has to run to stage 0; we take
///   the smallest such head and tail over the models present, which is safe whichever model the
///   device starts or ends with. Total work per device alone is the case head = tail = 0.
pub fn lower_bound(problem: &PipelineProblem) -> u64 {
    let s = problem.stages;
    let mut bound = 0u64;
    let mut work = vec![0u64; s];
    let mut head = vec![u64::MAX; s];
    let mut tail = vec![u64::MAX; s];
    for (mi, m) in problem.models.iter().enumerate() {
        let (mb, pp) = (m.microbatches as u64, m.pp as u64);
        bound = bound.max((mb + pp - 1) * (m.fwd + m.bwd));
        for r in 0..s / m.pp {
            for j in 0..m.pp {
                let d = device_of(s, mi, m.pp, r, j);
                work[d] += mb * (m.fwd + m.bwd);
                head[d] = head[d].min(j as u64 * m.fwd);
                tail[d] = tail[d].min(j as u64 * m.bwd);
            }
        }
    }
    for d in 0..s {
        bound = bound.max(head[d] + work[d] + tail[d]);
    }
    bound
}

/// The plain 1F1B order (PipeDream-flush) of one stage: `P - j - 1` warm-up forwards, then one
/// forward, one backward, and the remaining backwards.
fn one_f_one_b_positions(pp: usize, stage: usize, mbs: usize) -> Vec<(Kind, usize)> {
    let warm = (pp - stage - 1).min(mbs);
    let mut out = Vec::with_capacity(2 * mbs);
    out.extend((0..warm).map(|m| (Kind::Fwd, m)));
    for i in 0..mbs - warm {
        out.push((Kind::Fwd, warm + i));
        out.push((Kind::Bwd, i));
    }
    out.extend((mbs - warm..mbs).map(|m| (Kind::Bwd, m)));
    out
}

/// Index of a task: (model, replica, microbatch, kind, stage) -> position in `tasks`.
fn task_index(problem: &PipelineProblem) -> impl Fn(usize, usize, usize, Kind, usize) -> u32 + '_ {
    let s = problem.stages;
    let mut offsets = Vec::with_capacity(problem.models.len());
    let mut acc = 0usize;
    for m in &problem.models {
        offsets.push(acc);
        acc += (s / m.pp) * m.microbatches * 2 * m.pp;
    }
    move |model, replica, mb, kind, stage| {
        let m = &problem.models[model];
        let chain = offsets[model] + (replica * m.microbatches + mb) * 2 * m.pp;
        let link = match kind {
            Kind::Fwd => stage,
            Kind::Bwd => 2 * m.pp - 1 - stage,
        };
        (chain + link) as u32
    }
}

/// Latency of running the models one after the other, each with plain 1F1B (replicas of a
/// model run side by side). Simulated with the same evaluator rather than by formula, so it is
/// the same kind of number as the fused latency.
pub fn serial_1f1b_latency(problem: &PipelineProblem) -> u64 {
    let mut total = 0;
    for m in &problem.models {
        let single = PipelineProblem {
            stages: m.pp,
            models: vec![m.clone()],
            search: problem.search.clone(),
        };
        let inst = Instance::new(&single);
        let idx = task_index(&single);
        let orders: Orders = (0..m.pp)
            .map(|j| {
                one_f_one_b_positions(m.pp, j, m.microbatches)
                    .into_iter()
                    .map(|(k, mb)| idx(0, 0, mb, k, j))
                    .collect()
            })
            .collect();
        let mut ev = Evaluator::new(&inst);
        // A 1F1B order never deadlocks; 0 would only show up if that invariant broke, and the
        // tests compare against the closed form.
        total += ev.run(&inst, &orders, u64::MAX).map_or(0, |(ms, _)| ms);
    }
    total
}

/// The greedy start: an active list schedule (Giffler–Thompson) with urgency as priority —
/// the longest path still ahead of a subtask ([`Instance::after`] plus its own duration).
/// Urgency rather than "backward first" is what lets the smaller model's subtasks slip into the
/// larger model's bubbles without pushing the larger model's critical chain.
pub fn greedy_orders(inst: &Instance) -> Orders {
    let prio: Vec<i64> = inst
        .tasks
        .iter()
        .zip(&inst.after)
        .map(|(t, a)| (a + t.duration) as i64)
        .collect();
    list_schedule(inst, Direction::Forward, &prio, None)
}

/// Which way time runs in [`list_schedule`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Direction {
    Forward,
    /// Schedules the mirrored problem (chains reversed, the last micro-batch first): the
    /// right-justified half of forward–backward improvement.
    Backward,
}

/// An active list schedule (Giffler–Thompson): repeatedly take the device whose next subtask
/// could end earliest; among its candidates that could start before that moment, run the one
/// with the highest `prio`. A stream's micro-batches are taken in order. With `cap`, a subtask
/// that takes activation memory (a forward; a backward when time runs backwards) is a
/// candidate only while its device stays within its cap. Returns the orders in forward time
/// whichever the direction; they are incomplete if the caps left no candidate at some point,
/// which the evaluator reports as a deadlock.
fn list_schedule(inst: &Instance, dir: Direction, prio: &[i64], cap: Option<&[u64]>) -> Orders {
    let s = inst.stages;
    let mut mem = vec![0u64; s];
    let opens = |task: &Subtask| (task.kind == Kind::Fwd) == (dir == Direction::Forward);
    let allowed = |task: &Subtask, mem: &[u64]| -> bool {
        match cap {
            Some(cap) if opens(task) => mem[task.device] + task.mem <= cap[task.device],
            _ => true,
        }
    };
    let nstreams = inst
        .tasks
        .iter()
        .map(|t| t.stream as usize + 1)
        .max()
        .unwrap_or(0);
    // FIFO queues per device and stream, in micro-batch order (replicas never share a device).
    let mut queues: Vec<Vec<Vec<u32>>> = vec![vec![Vec::new(); nstreams]; s];
    for (i, t) in inst.tasks.iter().enumerate() {
        queues[t.device][t.stream as usize].push(i as u32);
    }
    for dq in &mut queues {
        for q in dq.iter_mut() {
            q.sort_by_key(|&t| inst.tasks[t as usize].microbatch);
            if dir == Direction::Backward {
                q.reverse();
            }
        }
    }
    let link = |t: usize| -> u32 {
        match dir {
            Direction::Forward => inst.tasks[t].pred,
            Direction::Backward => inst.succ[t],
        }
    };
    let mut head = vec![vec![0usize; nstreams]; s];
    let mut end: Vec<Option<u64>> = vec![None; inst.tasks.len()];
    let mut free = vec![0u64; s];
    let mut orders: Orders = vec![Vec::new(); s];
    // The earliest start of a stream's head on its device, if its predecessor has been placed.
    let release = |t: u32, end: &[Option<u64>], free: u64| -> Option<u64> {
        match link(t as usize) {
            NONE => Some(free),
            p => end[p as usize].map(|e| e.max(free)),
        }
    };
    // The earliest completion of any candidate on each device. Placing a subtask changes it
    // only on its own device and on the device of its chain successor, so it is cached.
    let device_ec =
        |d: usize, head: &[Vec<usize>], end: &[Option<u64>], free: &[u64], mem: &[u64]| {
            let mut best: Option<u64> = None;
            for st in 0..nstreams {
                let Some(&t) = queues[d][st].get(head[d][st]) else {
                    continue;
                };
                if !allowed(&inst.tasks[t as usize], mem) {
                    continue;
                }
                if let Some(r) = release(t, end, free[d]) {
                    let ec = r + inst.tasks[t as usize].duration;
                    if best.is_none_or(|b| ec < b) {
                        best = Some(ec);
                    }
                }
            }
            best
        };
    let mut ecs: Vec<Option<u64>> = (0..s)
        .map(|d| device_ec(d, &head, &end, &free, &mem))
        .collect();
    for _ in 0..inst.tasks.len() {
        let mut earliest: Option<(u64, usize)> = None;
        for (d, ec) in ecs.iter().enumerate() {
            if let Some(ec) = *ec
                && earliest.is_none_or(|(best, _)| ec < best)
            {
                earliest = Some((ec, d));
            }
        }
        // Some stream head always has its predecessor placed (the earliest unplaced link of
        // any chain does), so this only stops if that invariant breaks.
        let Some((ec, d)) = earliest else { break };
        let mut pick: Option<((i64, bool, u32), u64)> = None;
        for st in 0..nstreams {
            let Some(&t) = queues[d][st].get(head[d][st]) else {
                continue;
            };
            let Some(r) = release(t, &end, free[d]) else {
                continue;
            };
            let task = &inst.tasks[t as usize];
            if r >= ec || !allowed(task, &mem) {
                continue;
            }
            let key = (prio[t as usize], task.kind == Kind::Bwd, u32::MAX - t);
            if pick.is_none_or(|(k, _)| key > k) {
                pick = Some((key, r));
            }
        }
        let Some(((_, _, inv), r)) = pick else { break };
        let t = u32::MAX - inv;
        let task = &inst.tasks[t as usize];
        head[d][task.stream as usize] += 1;
        if opens(task) {
            mem[d] += task.mem;
        } else {
            mem[d] = mem[d].saturating_sub(task.mem);
        }
        let e = r + task.duration;
        end[t as usize] = Some(e);
        free[d] = e;
        orders[d].push(t);
        ecs[d] = device_ec(d, &head, &end, &free, &mem);
        let next = match dir {
            Direction::Forward => inst.succ[t as usize],
            Direction::Backward => inst.tasks[t as usize].pred,
        };
        if next != NONE {
            let dn = inst.tasks[next as usize].device;
            ecs[dn] = device_ec(dn, &head, &end, &free, &mem);
        }
    }
    if dir == Direction::Backward {
        for o in &mut orders {
            o.reverse();
        }
    }
    orders
}

/// One round of forward–backward improvement (Li and Willis; Valls et al. for project
/// scheduling): schedule backwards in time taking subtasks in order of their end, then forwards
/// again in order of their latest start in that right-justified schedule. Each pass packs
/// subtasks against the other end, and the pair often closes gaps that neither direction closes
/// alone. `noise` (time units) randomises the priorities so repeated rounds explore.
fn forward_backward(
    inst: &Instance,
    ev: &mut Evaluator,
    orders: &Orders,
    rng: &mut Rng,
    noise: u64,
    cap: Option<&[u64]>,
) -> Option<Orders> {
    ev.run(inst, orders, u64::MAX)?;
    let prio_back: Vec<i64> = ev
        .end
        .iter()
        .map(|&e| e as i64 + rng.range_inclusive(0, noise) as i64)
        .collect();
    let back = list_schedule(inst, Direction::Backward, &prio_back, cap);
    let (ms, _) = ev.run(inst, &back, u64::MAX)?;
    // Right-justify: a task's start in the mirrored schedule is its latest start.
    let late = right_justified_starts(inst, &back, ms)?;
    let prio_fwd: Vec<i64> = late
        .iter()
        .map(|&s| -(s as i64) + rng.range_inclusive(0, noise) as i64)
        .collect();
    Some(list_schedule(inst, Direction::Forward, &prio_fwd, cap))
}

/// Latest starts of the subtasks for fixed orders and a fixed makespan.
fn right_justified_starts(inst: &Instance, orders: &Orders, makespan: u64) -> Option<Vec<u64>> {
    // Mirror the instance: a task's "pred" becomes its chain successor, device orders reverse.
    let mut mirrored = inst.clone();
    for (t, task) in mirrored.tasks.iter_mut().enumerate() {
        task.pred = inst.succ[t];
    }
    mirrored.succ = inst.tasks.iter().map(|t| t.pred).collect();
    let rev: Orders = orders
        .iter()
        .map(|o| o.iter().rev().copied().collect())
        .collect();
    let mut ev = Evaluator::new(&mirrored);
    ev.run(&mirrored, &rev, u64::MAX)?;
    Some(ev.end.iter().map(|&e| makespan.saturating_sub(e)).collect())
}

/// Repeated randomised forward–backward rounds from `start`, keeping a round's result when it
/// is no worse (so the walk drifts across plateaus). Returns the best orders and rounds used.
fn improve_forward_backward(
    inst: &Instance,
    start: Orders,
    bound: u64,
    rounds: u64,
    rng: &mut Rng,
) -> (Orders, u64) {
    let mut ev = Evaluator::new(inst);
    let Some((mut best_ms, _)) = ev.run(inst, &start, u64::MAX) else {
        return (start, 0);
    };
    // Noise of about one and a half subtask durations: enough to swap neighbours in the
    // priority order, too little to scramble it (measured on the published problems).
    let mean =
        inst.tasks.iter().map(|t| t.duration).sum::<u64>() as f64 / inst.tasks.len().max(1) as f64;
    let noise = (mean * 1.5).round() as u64;
    let mut best = start;
    let mut used = 0;
    while used < rounds && best_ms > bound {
        used += 1;
        let Some(next) = forward_backward(inst, &mut ev, &best, rng, noise, None) else {
            break;
        };
        if let Some((ms, _)) = ev.run(inst, &next, u64::MAX)
            && ms <= best_ms
        {
            best_ms = ms;
            best = next;
        }
    }
    (best, used)
}

/// Memory rounds without a gain after which [`improve_memory_forward_backward`] stops.
const MEMORY_STALL_ROUNDS: u64 = 300;

/// Forward–backward rounds for memory: each round caps one device at the peak just below it
/// (the others at the peak) and keeps the result if it is complete, no slower than `latency`
/// and better by (peak, devices at the peak, sum of peaks). The list scheduler then has to
/// interleave backwards earlier on that device, which annealing moves find only slowly.
/// Returns the best orders and rounds used.
fn improve_memory_forward_backward(
    inst: &Instance,
    start: Orders,
    latency: u64,
    rounds: u64,
    rng: &mut Rng,
) -> (Orders, u64) {
    let mut ev = Evaluator::new(inst);
    let mean =
        inst.tasks.iter().map(|t| t.duration).sum::<u64>() as f64 / inst.tasks.len().max(1) as f64;
    let noise = (mean * 1.5).round() as u64;
    let score = |peaks: &[u64]| -> (u64, usize, u64) {
        let max = peaks.iter().copied().max().unwrap_or(0);
        let at_max = peaks.iter().filter(|&&p| p == max).count();
        (max, at_max, peaks.iter().sum())
    };
    let mut best = start;
    let mut peaks = device_peaks(inst, &best);
    let mut best_score = score(&peaks);
    let mut used = 0;
    let mut since_gain = 0;
    // Stop early once a stretch of rounds has found nothing: the caps have stopped biting.
    while used < rounds && best_score.0 > 0 && since_gain < MEMORY_STALL_ROUNDS {
        used += 1;
        since_gain += 1;
        let max = best_score.0;
        let at_max: Vec<usize> = (0..peaks.len()).filter(|&d| peaks[d] == max).collect();
        let target = at_max[rng.below(at_max.len())];
        // Alternate: one device at the peak pushed below it, or all of them.
        let mut cap = vec![max; inst.stages];
        if used % 2 == 0 {
            cap = vec![max - 1; inst.stages];
        }
        cap[target] = max - 1;
        let Some(next) = forward_backward(inst, &mut ev, &best, rng, noise, Some(&cap)) else {
            continue;
        };
        if let Some((ms, _)) = ev.run(inst, &next, u64::MAX)
            && ms <= latency
        {
            let next_peaks = device_peaks(inst, &next);
            let sc = score(&next_peaks);
            if sc < best_score {
                best_score = sc;
                peaks = next_peaks;
                best = next;
                since_gain = 0;
            }
        }
    }
    (best, used)
}

/// Simulated annealing over the orders. A move takes one subtask on one device and moves it a
/// few places earlier or later, never past a subtask of its own stream (micro-batches of a
/// stream keep their order on a device, which loses nothing since they are identical and cuts
/// the search space). Moves that deadlock are rejected.
struct Annealer<'a> {
    inst: &'a Instance,
    ev: Evaluator,
    rng: Rng,
}

/// Where a move took a task from and to, so it can be undone.
#[derive(Clone, Copy)]
struct Move {
    device: usize,
    from: usize,
    to: usize,
}

impl<'a> Annealer<'a> {
    fn propose(&mut self, orders: &mut Orders) -> Option<Move> {
        let d = self.rng.below(self.inst.stages);
        self.propose_on(orders, d)
    }

    fn propose_on(&mut self, orders: &mut Orders, d: usize) -> Option<Move> {
        let order = &mut orders[d];
        let n = order.len();
        if n < 2 {
            return None;
        }
        let from = self.rng.below(n);
        // Short moves are most useful near a good schedule; occasional long ones escape.
        let reach = if self.rng.below(8) == 0 { 16 } else { 3 };
        let delta = 1 + self.rng.below(reach);
        let to = if self.rng.below(2) == 0 {
            from.checked_sub(delta)?
        } else {
            let to = from + delta;
            if to >= n {
                return None;
            }
            to
        };
        let stream = self.inst.tasks[order[from] as usize].stream;
        let (lo, hi) = if to < from {
            (to, from)
        } else {
            (from + 1, to + 1)
        };
        if order[lo..hi]
            .iter()
            .any(|&t| self.inst.tasks[t as usize].stream == stream)
        {
            return None;
        }
        apply(order, from, to);
        Some(Move {
            device: d,
            from,
            to,
        })
    }

    fn undo(orders: &mut Orders, mv: Move) {
        apply(&mut orders[mv.device], mv.to, mv.from);
    }
}

/// Moves the element at `from` to position `to`, shifting the ones between.
fn apply(order: &mut [u32], from: usize, to: usize) {
    if from < to {
        order[from..=to].rotate_left(1);
    } else {
        order[to..=from].rotate_right(1);
    }
}

/// Latency phase: minimise makespan. The annealing cost is the tardiness against a target
/// just below the best makespan found so far (never below the lower bound), plus the makespan
/// itself, so the search always pushes towards a strictly better schedule.
fn anneal_latency(
    annealer: &mut Annealer<'_>,
    start: Orders,
    bound: u64,
    iterations: u64,
) -> (Orders, u64) {
    let inst = annealer.inst;
    let mut cur = start;
    let Some(first) = annealer.ev.run(inst, &cur, u64::MAX) else {
        return (cur, 0);
    };
    let mut best = cur.clone();
    let mut best_ms = first.0;
    let mut target = best_ms.saturating_sub(1).max(bound);
    let n = inst.tasks.len().max(1) as f64;
    let cost = |(ms, tardy): (u64, u64)| ms as f64 + tardy as f64 / n;
    let mut cur_cost = match annealer.ev.run(inst, &cur, target) {
        Some(r) => cost(r),
        None => return (cur, 0),
    };
    // Temperature in time units. The start is already good, so it starts low (a loss of a
    // tenth of a subtask is accepted about a third of the time) and cools geometrically to
    // where only improvements pass; hotter starts were measured to undo the improvement phase.
    let mean_dur = inst.tasks.iter().map(|t| t.duration).sum::<u64>() as f64 / n;
    let t0 = mean_dur * 0.02;
    let t1 = 0.01;
    let mut used = 0u64;
    while used < iterations && best_ms > bound {
        used += 1;
        let temp = t0 * (t1 / t0).powf(used as f64 / iterations as f64);
        let Some(mv) = annealer.propose(&mut cur) else {
            continue;
        };
        match annealer.ev.run(inst, &cur, target) {
            None => Annealer::undo(&mut cur, mv),
            Some(r) => {
                let c = cost(r);
                let accept =
                    c <= cur_cost || annealer.rng.next_f64() < ((cur_cost - c) / temp).exp();
                if !accept {
                    Annealer::undo(&mut cur, mv);
                    continue;
                }
                cur_cost = c;
                if r.0 < best_ms {
                    best_ms = r.0;
                    best.clone_from(&cur);
                    // Aim one unit lower; the current cost is re-measured against it.
                    target = best_ms.saturating_sub(1).max(bound);
                    if let Some(r) = annealer.ev.run(inst, &cur, target) {
                        cur_cost = cost(r);
                    }
                }
            }
        }
    }
    (best, used)
}

/// Memory phase: minimise the peak activation memory (max over devices, then the sum of
/// per-device peaks as a tie-break) among orders whose makespan stays within `latency`.
fn anneal_memory(
    annealer: &mut Annealer<'_>,
    start: Orders,
    latency: u64,
    iterations: u64,
) -> (Orders, u64) {
    let inst = annealer.inst;
    let mut cur = start;
    let mut peaks = device_peaks(inst, &cur);
    let cost = |p: &[u64]| -> f64 {
        let max = p.iter().copied().max().unwrap_or(0) as f64;
        max + 0.5 * p.iter().sum::<u64>() as f64 / (p.len() as f64 * max.max(1.0))
    };
    let mut cur_cost = cost(&peaks);
    let mut best = cur.clone();
    let mut best_cost = cur_cost;
    let mean_mem =
        inst.tasks.iter().map(|t| t.mem).sum::<u64>() as f64 / inst.tasks.len().max(1) as f64;
    let t0 = mean_mem * 0.5;
    let t1 = mean_mem * 0.005 + 1e-9;
    let mut used = 0u64;
    while used < iterations {
        used += 1;
        let temp = t0 * (t1 / t0).powf(used as f64 / iterations as f64);
        // Half the moves go to a device at the peak, where a lower peak is won or lost.
        let proposal = if annealer.rng.below(2) == 0 {
            let max = peaks.iter().copied().max().unwrap_or(0);
            let at_peak: Vec<usize> = (0..peaks.len()).filter(|&d| peaks[d] == max).collect();
            let d = at_peak[annealer.rng.below(at_peak.len())];
            annealer.propose_on(&mut cur, d)
        } else {
            annealer.propose(&mut cur)
        };
        let Some(mv) = proposal else {
            continue;
        };
        let old_peak = peaks[mv.device];
        peaks[mv.device] = order_peak(inst, &cur[mv.device]);
        let c = cost(&peaks);
        let keeps_latency = c <= cur_cost + temp * 8.0
            && annealer
                .ev
                .run(inst, &cur, u64::MAX)
                .is_some_and(|(ms, _)| ms <= latency);
        let accept = keeps_latency
            && (c <= cur_cost || annealer.rng.next_f64() < ((cur_cost - c) / temp).exp());
        if accept {
            cur_cost = c;
            if c < best_cost {
                best_cost = c;
                best.clone_from(&cur);
            }
        } else {
            peaks[mv.device] = old_peak;
            Annealer::undo(&mut cur, mv);
        }
    }
    (best, used)
}

/// Turns orders into the output schedule (start/end times from the evaluator).
fn materialise(inst: &Instance, orders: &Orders) -> Option<(u64, Vec<DeviceSchedule>)> {
    let mut ev = Evaluator::new(inst);
    let (ms, _) = ev.run(inst, orders, u64::MAX)?;
    let schedule = orders
        .iter()
        .enumerate()
        .map(|(d, order)| DeviceSchedule {
            device: d,
            peak_memory: order_peak(inst, order),
            tasks: order
                .iter()
                .map(|&t| {
                    let task = &inst.tasks[t as usize];
                    let end = ev.end[t as usize];
                    ScheduledTask {
                        model: task.model,
                        replica: task.replica,
                        microbatch: task.microbatch,
                        kind: task.kind,
                        start: end - task.duration,
                        end,
                    }
                })
                .collect(),
        })
        .collect();
    Some((ms, schedule))
}

/// Solves a validated problem: greedy start, annealing on latency, then on memory.
pub fn solve(problem: &PipelineProblem) -> Result<FusedSchedule, ProblemError> {
    problem.validate()?;
    let inst = Instance::new(problem);
    let bound = lower_bound(problem);
    let greedy = greedy_orders(&inst);
    let internal = |what: &str| ProblemError(format!("internal error: {what} deadlocked"));
    let (greedy_latency, _) = materialise(&inst, &greedy).ok_or_else(|| internal("greedy"))?;
    let greedy_peak = device_peaks(&inst, &greedy).into_iter().max().unwrap_or(0);
    let mut annealer = Annealer {
        inst: &inst,
        ev: Evaluator::new(&inst),
        rng: Rng::new(problem.search.seed),
    };
    let (improved, rounds) = improve_forward_backward(
        &inst,
        greedy,
        bound,
        problem.search.improvement_rounds,
        &mut annealer.rng,
    );
    let (fast, moves_latency) = anneal_latency(
        &mut annealer,
        improved,
        bound,
        problem.search.latency_iterations,
    );
    let (latency, _) = materialise(&inst, &fast).ok_or_else(|| internal("annealing"))?;
    let (capped, memory_rounds) = improve_memory_forward_backward(
        &inst,
        fast,
        latency,
        problem.search.memory_rounds,
        &mut annealer.rng,
    );
    let (lean, moves_memory) = anneal_memory(
        &mut annealer,
        capped,
        latency,
        problem.search.memory_iterations,
    );
    let (latency, schedule) = materialise(&inst, &lean).ok_or_else(|| internal("annealing"))?;
    let peak_memory = schedule.iter().map(|d| d.peak_memory).max().unwrap_or(0);
    let result = FusedSchedule {
        latency,
        lower_bound: bound,
        peak_memory,
        serial_1f1b_latency: serial_1f1b_latency(problem),
        greedy_latency,
        greedy_peak_memory: greedy_peak,
        search: SearchStats {
            improvement_rounds: rounds,
            latency_moves: moves_latency,
            memory_rounds,
            memory_moves: moves_memory,
        },
        schedule,
    };
    validate_schedule(problem, &result)
        .map_err(|e| ProblemError(format!("internal error: {e}")))?;
    Ok(result)
}

/// Checks a schedule against its problem: every subtask appears exactly once on its own device
/// with its duration; devices run one subtask at a time; chains are respected (forwards stage by
/// stage in the model's direction, backwards after the last forward, in the opposite
/// direction); and the reported peak memories equal the activation memory recomputed from the
/// times. Returns the first violation found.
pub fn validate_schedule(problem: &PipelineProblem, result: &FusedSchedule) -> Result<(), String> {
    let inst = Instance::new(problem);
    let idx = task_index(problem);
    let mut end: Vec<Option<(u64, u64)>> = vec![None; inst.tasks.len()];
    if result.schedule.len() != problem.stages {
        return Err(format!(
            "{} device schedules for {} stages",
            result.schedule.len(),
            problem.stages
        ));
    }
    let mut makespan = 0;
    let mut overall_peak = 0;
    for (d, dev) in result.schedule.iter().enumerate() {
        if dev.device != d {
            return Err(format!("device schedule {d} is labelled {}", dev.device));
        }
        let mut prev_end = 0;
        // Memory events: (time, +mem at forward start / -mem at backward end).
        let mut events: Vec<(u64, i64)> = Vec::new();
        for st in &dev.tasks {
            let m = problem
                .models
                .get(st.model)
                .ok_or_else(|| format!("device {d}: unknown model {}", st.model))?;
            if st.replica >= problem.stages / m.pp || st.microbatch >= m.microbatches {
                return Err(format!("device {d}: replica or micro-batch out of range"));
            }
            // Which stage of this replica lives on device d.
            let stage = (0..m.pp)
                .find(|&j| device_of(problem.stages, st.model, m.pp, st.replica, j) == d)
                .ok_or_else(|| {
                    format!(
                        "device {d}: model {} replica {} is not here",
                        st.model, st.replica
                    )
                })?;
            let t = idx(st.model, st.replica, st.microbatch, st.kind, stage) as usize;
            let dur = match st.kind {
                Kind::Fwd => m.fwd,
                Kind::Bwd => m.bwd,
            };
            if st.end < st.start || st.end - st.start != dur {
                return Err(format!("device {d}: {st:?} does not last {dur}"));
            }
            if st.start < prev_end {
                return Err(format!("device {d}: {st:?} overlaps the previous subtask"));
            }
            prev_end = st.end;
            if end[t].replace((st.start, st.end)).is_some() {
                return Err(format!("device {d}: {st:?} scheduled twice"));
            }
            let mem = m.mem_per_microbatch as i64;
            match st.kind {
                Kind::Fwd => events.push((st.start, mem)),
                Kind::Bwd => events.push((st.end, -mem)),
            }
        }
        makespan = makespan.max(prev_end);
        // At equal times releases come first: a backward that ends at t frees memory before a
        // forward that starts at t needs it.
        events.sort();
        let (mut cur, mut peak) = (0i64, 0i64);
        for (_, delta) in events {
            cur += delta;
            peak = peak.max(cur);
        }
        if peak as u64 != dev.peak_memory {
            return Err(format!(
                "device {d}: peak memory {} reported, {} recomputed",
                dev.peak_memory, peak
            ));
        }
        overall_peak = overall_peak.max(dev.peak_memory);
    }
    for (t, task) in inst.tasks.iter().enumerate() {
        let Some((start, _)) = end[t] else {
            return Err(format!("subtask {task:?} is missing"));
        };
        if let Some(p) = inst.pred(t) {
            let (_, pend) = end[p].ok_or_else(|| format!("subtask {p} is missing"))?;
            if pend > start {
                return Err(format!(
                    "model {} replica {} micro-batch {} {:?} at stage {} starts at {start} before \
                     its predecessor ends at {pend}",
                    task.model, task.replica, task.microbatch, task.kind, task.stage
                ));
            }
        }
    }
    if makespan != result.latency {
        return Err(format!(
            "latency {} reported, {makespan} recomputed",
            result.latency
        ));
    }
    if overall_peak != result.peak_memory {
        return Err(format!(
            "peak memory {} reported, {overall_peak} recomputed",
            result.peak_memory
        ));
    }
    if result.latency < result.lower_bound {
        return Err(format!(
            "latency {} is below the lower bound {}",
            result.latency, result.lower_bound
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(stages: usize, models: &[(usize, usize, u64, u64)]) -> PipelineProblem {
        PipelineProblem {
            stages,
            models: models
                .iter()
                .map(|&(pp, microbatches, fwd, bwd)| PipelineModel {
                    name: None,
                    pp,
                    microbatches,
                    fwd,
                    bwd,
                    mem_per_microbatch: 1,
                })
                .collect(),
            search: SearchOptions::default(),
        }
    }

    /// The three problems whose annealed latencies RLHFuse publishes.
    fn published() -> [(PipelineProblem, u64); 3] {
        [
            (problem(8, &[(8, 16, 5, 10), (4, 8, 4, 8)]), 372),
            (problem(16, &[(16, 16, 2, 4), (8, 8, 2, 4)]), 186),
            (problem(8, &[(8, 32, 5, 10), (8, 32, 2, 4)]), 702),
        ]
    }

    fn check_published(i: usize) {
        let (mut p, expected) = published()[i].clone();
        // The latency phases run at their defaults; the memory phases, which these tests do
        // not assert on, get a small budget to keep the dev-profile test fast.
        p.search.memory_rounds = 50;
        p.search.memory_iterations = 10_000;
        let r = solve(&p).expect("solves");
        validate_schedule(&p, &r).expect("valid");
        assert_eq!(r.lower_bound, expected);
        assert_eq!(r.latency, expected, "{:?}", r.search);
        assert!(r.latency < r.greedy_latency || r.greedy_latency == expected);
        assert!(r.latency < r.serial_1f1b_latency);
    }

    #[test]
    fn published_actor_pp8_critic_pp4_reaches_372() {
        check_published(0);
    }

    #[test]
    fn published_actor_pp16_critic_pp8_reaches_186() {
        check_published(1);
    }

    #[test]
    fn published_actor_pp8_critic_pp8_32_microbatches_reaches_702() {
        check_published(2);
    }

    #[test]
    fn lower_bounds_and_serial_latencies_of_the_published_problems() {
        let [a, b, c] = published();
        assert_eq!(lower_bound(&a.0), 372);
        assert_eq!(lower_bound(&b.0), 186);
        assert_eq!(lower_bound(&c.0), 702);
        // (M + P - 1)(F + B) per model, one model after the other.
        assert_eq!(serial_1f1b_latency(&a.0), 23 * 15 + 11 * 12);
        assert_eq!(serial_1f1b_latency(&b.0), 31 * 6 + 15 * 6);
        assert_eq!(serial_1f1b_latency(&c.0), 39 * 15 + 39 * 6);
    }

    #[test]
    fn a_single_model_is_scheduled_at_its_1f1b_latency() {
        for (pp, m) in [(1, 1), (1, 5), (4, 1), (4, 4), (4, 9), (6, 3)] {
            let p = problem(pp, &[(pp, m, 3, 7)]);
            let r = solve(&p).expect("solves");
            validate_schedule(&p, &r).expect("valid");
            let expected = (m + pp - 1) as u64 * 10;
            assert_eq!(r.lower_bound, expected);
            assert_eq!(r.latency, expected, "pp {pp} m {m}");
            assert_eq!(r.serial_1f1b_latency, expected);
        }
    }

    #[test]
    fn small_random_problems_give_valid_schedules_within_the_bounds() {
        let mut rng = Rng::new(11);
        for case in 0..40 {
            let stages: usize = [1, 2, 3, 4, 6, 8][rng.below(6)];
            let divisors: Vec<usize> = (1..=stages).filter(|d| stages.is_multiple_of(*d)).collect();
            let mut models = vec![(
                stages,
                1 + rng.below(6),
                1 + rng.below(5) as u64,
                1 + rng.below(9) as u64,
            )];
            for _ in 0..rng.below(3) {
                models.push((
                    divisors[rng.below(divisors.len())],
                    1 + rng.below(6),
                    1 + rng.below(5) as u64,
                    1 + rng.below(9) as u64,
                ));
            }
            let mut p = problem(stages, &models);
            p.models[0].mem_per_microbatch = 1 + rng.below(4) as u64;
            p.search.improvement_rounds = 20;
            p.search.latency_iterations = 2_000;
            p.search.memory_rounds = 20;
            p.search.memory_iterations = 2_000;
            let r = solve(&p).expect("solves");
            validate_schedule(&p, &r).unwrap_or_else(|e| panic!("case {case} {p:?}: {e}"));
            assert!(r.latency >= r.lower_bound);
            assert!(r.latency <= r.greedy_latency, "case {case}");
        }
    }

    #[test]
    fn solving_is_deterministic() {
        let (p, _) = published()[0].clone();
        let a = serde_json::to_string(&solve(&p).expect("solves")).expect("json");
        let b = serde_json::to_string(&solve(&p).expect("solves")).expect("json");
        assert_eq!(a, b);
    }

    #[test]
    fn the_memory_phases_lower_the_peak_without_losing_latency() {
        let (mut p, _) = published()[0].clone();
        p.search.memory_rounds = 0;
        p.search.memory_iterations = 0;
        let before = solve(&p).expect("solves");
        p.search.memory_rounds = 200;
        p.search.memory_iterations = 20_000;
        let after = solve(&p).expect("solves");
        validate_schedule(&p, &after).expect("valid");
        assert_eq!(after.latency, before.latency);
        assert!(
            after.peak_memory < before.peak_memory,
            "{} -> {}",
            before.peak_memory,
            after.peak_memory
        );
    }

    #[test]
    fn capped_list_schedules_respect_the_cap_or_stop() {
        let (p, _) = published()[0].clone();
        let inst = Instance::new(&p);
        let prio: Vec<i64> = inst
            .tasks
            .iter()
            .zip(&inst.after)
            .map(|(t, a)| (a + t.duration) as i64)
            .collect();
        let mut ev = Evaluator::new(&inst);
        for dir in [Direction::Forward, Direction::Backward] {
            let capped = list_schedule(&inst, dir, &prio, Some(&[9; 8]));
            assert!(ev.run(&inst, &capped, u64::MAX).is_some(), "{dir:?}");
            assert!(
                device_peaks(&inst, &capped).iter().all(|&m| m <= 9),
                "{dir:?}"
            );
            // No forward fits under a zero cap: the schedule stops, and the evaluator says so.
            let stuck = list_schedule(&inst, dir, &prio, Some(&[0; 8]));
            assert!(ev.run(&inst, &stuck, u64::MAX).is_none(), "{dir:?}");
        }
        let free = list_schedule(&inst, Direction::Forward, &prio, None);
        assert!(device_peaks(&inst, &free).iter().any(|&m| m > 9));
    }

    fn tiny() -> (PipelineProblem, FusedSchedule) {
        let mut p = problem(2, &[(2, 2, 1, 2), (1, 1, 1, 1)]);
        p.models[0].mem_per_microbatch = 3;
        let r = solve(&p).expect("solves");
        (p, r)
    }

    #[test]
    fn validator_rejects_overlap_on_a_device() {
        let (p, mut r) = tiny();
        let tasks = &mut r.schedule[0].tasks;
        let shift = tasks[1].start - tasks[0].start;
        tasks[1].start -= shift;
        tasks[1].end -= shift;
        let e = validate_schedule(&p, &r).expect_err("overlap");
        assert!(
            e.contains("overlaps") || e.contains("before its predecessor"),
            "{e}"
        );
    }

    #[test]
    fn validator_rejects_a_broken_dependency() {
        let (p, mut r) = tiny();
        // Start every subtask of device 1 at time 0, one after the other: the forward of stage 1
        // cannot start before stage 0's forward ends.
        let mut t = 0;
        for st in &mut r.schedule[1].tasks {
            let d = st.end - st.start;
            st.start = t;
            st.end = t + d;
            t += d;
        }
        let e = validate_schedule(&p, &r).expect_err("dependency");
        assert!(e.contains("before its predecessor"), "{e}");
    }

    #[test]
    fn validator_rejects_missing_duplicate_and_wrong_memory() {
        let (p, r) = tiny();
        let mut missing = r.clone();
        missing.schedule[0].tasks.pop();
        assert!(validate_schedule(&p, &missing).is_err());
        let mut dup = r.clone();
        let last = dup.schedule[0].tasks[0].clone();
        let end = dup.schedule[0].tasks.last().map_or(0, |t| t.end);
        dup.schedule[0].tasks.push(ScheduledTask {
            start: end,
            end: end + (last.end - last.start),
            ..last
        });
        let e = validate_schedule(&p, &dup).expect_err("duplicate");
        assert!(e.contains("twice"), "{e}");
        let mut mem = r.clone();
        mem.schedule[0].peak_memory += 1;
        let e = validate_schedule(&p, &mem).expect_err("memory");
        assert!(e.contains("peak memory"), "{e}");
        let mut lat = r;
        lat.latency += 1;
        assert!(validate_schedule(&p, &lat).is_err());
    }

    #[test]
    fn bad_problems_are_rejected_with_the_field_named() {
        let cases = [
            (r#"{"stages": 8, "models": []}"#, "at least one model"),
            (
                r#"{"stages": 8, "models": [{"pp": 4, "microbatches": 2, "fwd": 1, "bwd": 2}]}"#,
                "models[0].pp must equal",
            ),
            (
                r#"{"stages": 8, "models": [{"pp": 8, "microbatches": 2, "fwd": 1, "bwd": 2},
                   {"pp": 3, "microbatches": 2, "fwd": 1, "bwd": 2}]}"#,
                "models[1].pp must divide",
            ),
            (
                r#"{"stages": 2, "models": [{"pp": 2, "microbatches": 0, "fwd": 1, "bwd": 2}]}"#,
                "microbatches",
            ),
            (
                r#"{"stages": 2, "models": [{"pp": 2, "microbatches": 1, "fwd": 0, "bwd": 2}]}"#,
                "positive",
            ),
            (
                r#"{"stages": 2, "models": [{"pp": 2, "microbatches": 1, "fwd": 1, "bwd": 2, "fwdd": 1}]}"#,
                "unknown field",
            ),
            (r#"{"stages": 2, "models": [{"pp": 2}]}"#, "missing field"),
            (r#"{"stages": -1}"#, "invalid value"),
            ("not json", "expected"),
        ];
        for (text, needle) in cases {
            let e = PipelineProblem::from_json(text).expect_err(text);
            assert!(e.0.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn reverse_models_map_replicas_onto_disjoint_reversed_stages() {
        // Critic pp 4 on 8 stages: replica 0 on devices 7..4, replica 1 on 3..0.
        let devs: Vec<usize> = (0..2)
            .flat_map(|r| (0..4).map(move |j| device_of(8, 1, 4, r, j)))
            .collect();
        assert_eq!(devs, vec![7, 6, 5, 4, 3, 2, 1, 0]);
        assert_eq!(device_of(8, 0, 8, 0, 3), 3);
    }
}
