//! The discrete-event engine: runs a [`Dag`] for a number of iterations and records what each
//! device did when.
//!
//! Events (a task finishes, a generation emits samples or releases devices — those of an
//! instance that drained before the migration, and those the migration of its long tail
//! frees — a per-sample chunk finishes) are processed in time order, ties in the order
//! they were scheduled, so a run is deterministic. A task starts as soon as its dependencies
//! are done (for a streaming consumer: as soon as its producer has started) and all its
//! devices are free; tasks are considered in DAG order. Iterations run back to back (the next
//! generation needs the weights the previous training produced). The engine must not print or
//! write files; reports and traces are values.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;

use serde::Serialize;

use crate::cost::Layout;
use crate::prng::Rng;
use crate::sim::dag::{Dag, GenerateSpec, TaskId, Work};

/// How long and from which seed to simulate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SimOptions {
    pub iterations: u32,
    pub seed: u64,
}

impl Default for SimOptions {
    fn default() -> SimOptions {
        SimOptions {
            iterations: 3,
            seed: 0x5EED,
        }
    }
}

/// Something one device did: a chunk of work of one task.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Span {
    pub device: usize,
    pub iteration: u32,
    pub task: String,
    pub stage: String,
    pub label: String,
    pub start: f64,
    pub end: f64,
}

/// When one stage ran in one iteration (first start to last end of its tasks).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageTime {
    pub stage: String,
    pub start: f64,
    pub end: f64,
}

/// What a generation task did in one iteration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GenerationReport {
    pub task: String,
    pub mean_len: f64,
    pub max_len: u64,
    /// When the long tail was consolidated (absent: no migration happened).
    pub migrated_at: Option<f64>,
    pub samples_migrated: u64,
    /// When 90 % of the samples had finished: from then to `end` is the long tail, when at
    /// most a tenth of the batch still decodes.
    pub p90_at: f64,
    pub end: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IterationReport {
    pub index: u32,
    pub start: f64,
    pub time: f64,
    pub stages: Vec<StageTime>,
    pub generations: Vec<GenerationReport>,
}

/// A stage's mean duration over the iterations.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageSummary {
    pub stage: String,
    pub mean_time: f64,
}

/// The result of a simulation. Times are in seconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimReport {
    pub mean_iteration_time: f64,
    pub total_time: f64,
    pub stages: Vec<StageSummary>,
    /// Busy time over total time, per device.
    pub device_utilisation: Vec<f64>,
    /// Idle device-time over total device-time: `1 - mean utilisation`.
    pub bubble_fraction: f64,
    pub iterations: Vec<IterationReport>,
    #[serde(skip)]
    pub timeline: Vec<Span>,
}

/// A DAG that cannot run (the engine found no task to start while some were waiting).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimError(pub String);

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimError {}

/// Simulates `opts.iterations` iterations of `dag`.
pub fn simulate(dag: &Dag, opts: &SimOptions) -> Result<SimReport, SimError> {
    let mut rng = Rng::new(opts.seed);
    let mut timeline = Vec::new();
    let mut iterations = Vec::new();
    let mut now = 0.0;
    for index in 0..opts.iterations {
        let it = run_iteration(dag, index, now, &mut rng, &mut timeline)?;
        now = it.start + it.time;
        iterations.push(it);
    }
    let total_time = now;
    let n = iterations.len().max(1) as f64;
    let mean_iteration_time = iterations.iter().map(|i| i.time).sum::<f64>() / n;
    // Stages in order of first appearance in the DAG, so the report order is stable.
    let mut stage_names: Vec<&str> = Vec::new();
    for t in &dag.tasks {
        if !stage_names.contains(&t.stage.as_str()) {
            stage_names.push(&t.stage);
        }
    }
    let stages = stage_names
        .iter()
        .map(|s| StageSummary {
            stage: s.to_string(),
            mean_time: iterations
                .iter()
                .flat_map(|i| i.stages.iter().filter(|st| st.stage == *s))
                .map(|st| st.end - st.start)
                .sum::<f64>()
                / n,
        })
        .collect();
    // Busy time per device: the union of its spans (on threaded devices a streamed chunk
    // runs beside the generation, and the device is busy once, not twice).
    let mut spans: Vec<Vec<(f64, f64)>> = vec![Vec::new(); dag.devices];
    for s in &timeline {
        spans[s.device].push((s.start, s.end));
    }
    let busy: Vec<f64> = spans
        .into_iter()
        .map(|mut v| {
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (mut total, mut end) = (0.0, f64::NEG_INFINITY);
            for (a, b) in v {
                if b > end {
                    total += b - a.max(end);
                    end = b;
                }
            }
            total
        })
        .collect();
    let device_utilisation: Vec<f64> = busy
        .iter()
        .map(|b| {
            if total_time > 0.0 {
                b / total_time
            } else {
                0.0
            }
        })
        .collect();
    let mean_util = device_utilisation.iter().sum::<f64>() / dag.devices.max(1) as f64;
    Ok(SimReport {
        mean_iteration_time,
        total_time,
        stages,
        device_utilisation,
        bubble_fraction: 1.0 - mean_util,
        iterations,
        timeline,
    })
}

/// A time for the event queue: seconds, ordered totally (times are finite and non-negative).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Time) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Time) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Finish(usize),
    Release(usize, Vec<usize>),
    Emit(usize, u64),
    /// Task, samples, replica.
    ChunkDone(usize, u64, usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    Running,
    Done,
}

/// Per-task bookkeeping of one iteration.
#[derive(Clone, Debug)]
struct TaskRun {
    state: State,
    start: f64,
    end: f64,
    emitted: u64,
    processed: u64,
    /// Samples a streaming consumer's replicas are working on.
    in_flight: u64,
    /// Which of a streaming consumer's replicas are running a chunk.
    busy: Vec<bool>,
}

struct Engine<'a> {
    dag: &'a Dag,
    index: u32,
    queue: BinaryHeap<std::cmp::Reverse<(Time, u64, Event)>>,
    seq: u64,
    owner: Vec<Option<usize>>,
    /// On threaded devices ([`Dag::threaded`]): the streaming consumer running a chunk beside
    /// the generation that holds the device (one at a time, as the runtime's one inference
    /// thread runs them).
    lane: Vec<Option<usize>>,
    runs: Vec<TaskRun>,
    /// When each device's rank last met the others in an exchange ([`Work::Exchange`]).
    met: Vec<f64>,
    /// When the iteration began (the ranks meet at every iteration's end).
    start: f64,
    rng: &'a mut Rng,
    timeline: &'a mut Vec<Span>,
    generations: Vec<GenerationReport>,
}

impl Engine<'_> {
    fn push(&mut self, at: f64, ev: Event) {
        self.seq += 1;
        self.queue.push(std::cmp::Reverse((Time(at), self.seq, ev)));
    }

    fn span(&mut self, task: usize, devices: &[usize], label: String, start: f64, end: f64) {
        let t = &self.dag.tasks[task];
        for &d in devices {
            self.timeline.push(Span {
                device: d,
                iteration: self.index,
                task: t.name.clone(),
                stage: t.stage.clone(),
                label: label.clone(),
                start,
                end,
            });
        }
    }

    /// Starts every waiting task that can start, and the next chunk of every running
    /// streaming consumer whose devices are free, in DAG order.
    fn try_start_all(&mut self, now: f64) {
        for i in 0..self.dag.tasks.len() {
            let t = &self.dag.tasks[i];
            let streaming = t.stream_from.is_some();
            if self.runs[i].state == State::Running && streaming {
                self.next_chunk(i, now);
                continue;
            }
            if self.runs[i].state != State::Waiting {
                continue;
            }
            let deps_done = t.deps.iter().all(|d| self.runs[d.0].state == State::Done);
            let producer_started = t
                .stream_from
                .is_none_or(|p| self.runs[p.0].state != State::Waiting);
            // A streaming consumer holds its devices only while a chunk runs (RLHFuse's
            // sample-level subtasks), so it starts without them.
            let devices_free = streaming || t.devices.iter().all(|&d| self.owner[d].is_none());
            if deps_done && producer_started && devices_free {
                self.start(i, now);
            }
        }
    }

    fn start(&mut self, i: usize, now: f64) {
        let t = &self.dag.tasks[i];
        if t.stream_from.is_none() {
            for &d in &t.devices {
                self.owner[d] = Some(i);
            }
        }
        self.runs[i].state = State::Running;
        self.runs[i].start = now;
        match &t.work {
            Work::Fixed { seconds } => {
                self.span(i, &t.devices, t.name.clone(), now, now + seconds);
                self.push(now + seconds, Event::Finish(i));
            }
            Work::Exchange { .. } => {
                let met = t
                    .devices
                    .iter()
                    .map(|&d| self.met[d])
                    .fold(self.start, f64::max);
                let seconds = t.work.exchange_seconds(now - met);
                self.span(i, &t.devices, t.name.clone(), now, now + seconds);
                self.push(now + seconds, Event::Finish(i));
            }
            Work::Generate(g) => self.start_generation(i, g, now),
            Work::PerSample {
                samples, replicas, ..
            } => {
                if t.stream_from.is_some() {
                    self.runs[i].busy = vec![false; *replicas as usize];
                    self.next_chunk(i, now);
                } else {
                    // Everything is available: each replica runs its share back to back.
                    let end = now + t.work.run_time(samples.div_ceil(*replicas));
                    self.span(i, &t.devices, format!("{} ×{samples}", t.name), now, end);
                    self.push(end, Event::Finish(i));
                }
            }
        }
    }

    /// Gives the samples waiting for a streaming consumer to its free replicas (those not
    /// running a chunk whose devices nobody holds): each takes an equal share — at most one
    /// micro-batch without pipeline stages, everything as one back-to-back run with them —
    /// and holds only its own devices while it runs, so consumers sharing freed devices
    /// interleave, and a trickle of tail samples does not wait for a full chunk. Finishes the
    /// task when every sample is processed.
    fn next_chunk(&mut self, i: usize, now: f64) {
        let t = &self.dag.tasks[i];
        let Work::PerSample {
            samples,
            chunk,
            stages,
            replicas,
            ..
        } = &t.work
        else {
            return;
        };
        let Some(p) = t.stream_from else { return };
        let run = &self.runs[i];
        if run.state != State::Running {
            return;
        }
        if run.processed >= *samples {
            self.push(now, Event::Finish(i));
            return;
        }
        let mut pending = self.runs[p.0]
            .emitted
            .saturating_sub(run.processed + run.in_flight);
        if pending == 0 {
            return;
        }
        let per = t.devices.len() / (*replicas as usize).max(1);
        let free: Vec<usize> = (0..*replicas as usize)
            .filter(|&r| {
                !self.runs[i].busy.get(r).copied().unwrap_or(true)
                    && t.devices[r * per..(r + 1) * per].iter().all(|&d| {
                        self.owner[d].is_none()
                            || (self.dag.threaded
                                && self.owner[d] == Some(p.0)
                                && self.lane[d].is_none())
                    })
            })
            .collect();
        if free.is_empty() {
            return;
        }
        let mut share = pending.div_ceil(free.len() as u64);
        if *stages <= 1 {
            share = share.min(*chunk);
        }
        for r in free {
            if pending == 0 {
                break;
            }
            let n = share.min(pending);
            pending -= n;
            let devs = t.devices[r * per..(r + 1) * per].to_vec();
            let end = now + t.work.run_time(n);
            for &d in &devs {
                if self.owner[d].is_none() {
                    self.owner[d] = Some(i);
                } else {
                    // Beside its producer, on a threaded device.
                    self.lane[d] = Some(i);
                }
            }
            self.runs[i].busy[r] = true;
            self.runs[i].in_flight += n;
            self.span(i, &devs, format!("{} ×{n}", t.name), now, end);
            self.push(end, Event::ChunkDone(i, n, r));
        }
    }

    fn start_generation(&mut self, i: usize, g: &GenerateSpec, now: f64) {
        let t = &self.dag.tasks[i];
        let lens: Vec<u64> = (0..g.samples).map(|_| g.lengths.sample(self.rng)).collect();
        let trace = trace_generation(g, &t.devices, now, &lens);
        for (at, n) in &trace.emits {
            self.push(*at, Event::Emit(i, *n));
        }
        for (at, devs) in &trace.releases {
            self.push(*at, Event::Release(i, devs.clone()));
        }
        for (devs, label, s, e) in &trace.spans {
            self.span(i, devs, label.clone(), *s, *e);
        }
        self.push(trace.end, Event::Finish(i));
        self.generations.push(GenerationReport {
            task: t.name.clone(),
            mean_len: lens.iter().sum::<u64>() as f64 / lens.len().max(1) as f64,
            max_len: lens.iter().copied().max().unwrap_or(0),
            migrated_at: trace.migrated_at,
            samples_migrated: trace.migrated,
            p90_at: quantile_time(&trace.emits, g.samples, 0.9).unwrap_or(trace.end),
            end: trace.end,
        });
    }

    fn free_devices(&mut self, i: usize, devices: &[usize]) {
        for &d in devices {
            if self.owner[d] == Some(i) {
                self.owner[d] = None;
            }
            if self.lane[d] == Some(i) {
                self.lane[d] = None;
            }
        }
    }

    fn handle(&mut self, now: f64, ev: Event) {
        match ev {
            Event::Finish(i) => {
                if self.runs[i].state == State::Done {
                    return;
                }
                self.runs[i].state = State::Done;
                self.runs[i].end = now;
                let devices = self.dag.tasks[i].devices.clone();
                if matches!(self.dag.tasks[i].work, Work::Exchange { .. }) {
                    for &d in &devices {
                        self.met[d] = now;
                    }
                }
                self.free_devices(i, &devices);
                // A consumer may be waiting for the last samples of a finished producer.
                self.wake_consumers(i, now);
                self.try_start_all(now);
            }
            Event::Release(i, devices) => {
                self.free_devices(i, &devices);
                self.try_start_all(now);
            }
            Event::Emit(i, n) => {
                self.runs[i].emitted += n;
                self.wake_consumers(i, now);
            }
            Event::ChunkDone(i, n, r) => {
                self.runs[i].processed += n;
                self.runs[i].in_flight -= n;
                self.runs[i].busy[r] = false;
                let t = &self.dag.tasks[i];
                let per = match &t.work {
                    Work::PerSample { replicas, .. } => t.devices.len() / (*replicas as usize),
                    _ => t.devices.len(),
                };
                let devices = t.devices[r * per..(r + 1) * per].to_vec();
                self.free_devices(i, &devices);
                // Its next chunk or whatever else waits for these devices, in DAG order.
                self.try_start_all(now);
            }
        }
    }

    fn wake_consumers(&mut self, producer: usize, now: f64) {
        for c in 0..self.dag.tasks.len() {
            if self.dag.tasks[c].stream_from == Some(TaskId(producer))
                && self.runs[c].state == State::Running
            {
                self.next_chunk(c, now);
            }
        }
    }
}

fn run_iteration(
    dag: &Dag,
    index: u32,
    start: f64,
    rng: &mut Rng,
    timeline: &mut Vec<Span>,
) -> Result<IterationReport, SimError> {
    let first_span = timeline.len();
    let mut e = Engine {
        dag,
        index,
        queue: BinaryHeap::new(),
        seq: 0,
        owner: vec![None; dag.devices],
        lane: vec![None; dag.devices],
        runs: vec![
            TaskRun {
                state: State::Waiting,
                start: 0.0,
                end: 0.0,
                emitted: 0,
                processed: 0,
                in_flight: 0,
                busy: Vec::new(),
            };
            dag.tasks.len()
        ],
        met: vec![start; dag.devices],
        start,
        rng,
        timeline,
        generations: Vec::new(),
    };
    e.try_start_all(start);
    while let Some(std::cmp::Reverse((Time(now), _, ev))) = e.queue.pop() {
        e.handle(now, ev);
    }
    if let Some(stuck) = e.runs.iter().position(|r| r.state != State::Done) {
        return Err(SimError(format!(
            "task `{}` never finished: its devices or inputs never became available",
            dag.tasks[stuck].name
        )));
    }
    let end = e.runs.iter().map(|r| r.end).fold(start, f64::max);
    let mut stages: Vec<StageTime> = Vec::new();
    for (t, r) in dag.tasks.iter().zip(&e.runs) {
        match stages.iter_mut().find(|s| s.stage == t.stage) {
            Some(s) => {
                s.start = s.start.min(r.start);
                s.end = s.end.max(r.end);
            }
            None => stages.push(StageTime {
                stage: t.stage.clone(),
                start: r.start,
                end: r.end,
            }),
        }
    }
    let generations = std::mem::take(&mut e.generations);
    debug_assert!(e.timeline[first_span..].iter().all(|s| s.end <= end + 1e-9));
    Ok(IterationReport {
        index,
        start,
        time: end - start,
        stages,
        generations,
    })
}

/// When the `q`-quantile of `samples` had been emitted.
fn quantile_time(emits: &[(f64, u64)], samples: u64, q: f64) -> Option<f64> {
    let mut sorted = emits.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let want = (samples as f64 * q).ceil() as u64;
    let mut seen = 0;
    for (at, n) in sorted {
        seen += n;
        if seen >= want {
            return Some(at);
        }
    }
    None
}

/// What a generation does, computed when it starts (the lengths are drawn then).
#[derive(Debug, Default)]
struct GenerationTrace {
    /// (time, samples finished at that time), in time order.
    emits: Vec<(f64, u64)>,
    /// Devices freed (by instances that drained before the migration, and by the migration),
    /// and when.
    releases: Vec<(f64, Vec<usize>)>,
    /// When the long tail was consolidated.
    migrated_at: Option<f64>,
    spans: Vec<(Vec<usize>, String, f64, f64)>,
    migrated: u64,
    end: f64,
}

/// One engine instance's decoding state. A sample's context at this instance's step `s` is
/// `ctx0 + s`, so the sum of live contexts is kept incrementally.
#[derive(Debug)]
struct Instance {
    devices: Vec<usize>,
    clock: f64,
    step: i64,
    /// (finish step, ctx0), sorted by finish step from `pos` on.
    samples: Vec<(i64, i64)>,
    pos: usize,
    sum_ctx0: i64,
    decode_start: f64,
    /// Its devices were handed back (it drained before the migration and will not receive
    /// the tail).
    released: bool,
    /// Lengths of samples not admitted yet (beyond `max_batch`), in admission order.
    waiting: std::collections::VecDeque<u64>,
}

impl Instance {
    /// Samples running (admitted, not finished).
    fn live(&self) -> u64 {
        (self.samples.len() - self.pos) as u64
    }

    /// Samples not finished: running or waiting for a row.
    fn unfinished(&self) -> u64 {
        self.live() + self.waiting.len() as u64
    }

    fn step_time(&self, g: &GenerateSpec, layout: Layout) -> f64 {
        let live = self.live();
        if live == 0 {
            return 0.0;
        }
        let ctx = (self.sum_ctx0 + live as i64 * (self.step + 1)).max(0) as f64 / live as f64;
        g.cost
            .pipelined_decode_step_time(&g.model, layout, live, ctx.round() as u64)
    }

    /// Decodes one step; returns how many samples finished.
    fn advance(&mut self, dt: f64) -> u64 {
        self.clock += dt;
        self.step += 1;
        let mut done = 0;
        while self.pos < self.samples.len() && self.samples[self.pos].0 <= self.step {
            self.sum_ctx0 -= self.samples[self.pos].1;
            self.pos += 1;
            done += 1;
        }
        done
    }

    /// Admits waiting samples into the rows `max_batch` leaves free (continuous batching);
    /// returns the prefill time the admitted prompts take.
    fn admit(&mut self, g: &GenerateSpec, layout: Layout) -> f64 {
        let cap = g.max_batch.unwrap_or(u64::MAX);
        let free = cap
            .saturating_sub(self.live())
            .min(self.waiting.len() as u64);
        if free == 0 {
            return 0.0;
        }
        let admitted: Vec<(i64, i64)> = self
            .waiting
            .drain(..free as usize)
            .map(|len| (len as i64, g.prompt_len as i64))
            .collect();
        self.receive(&admitted);
        g.cost.pipelined_shared_prefill_time(
            &g.model,
            layout,
            free,
            g.prompt_len,
            g.samples_per_prompt,
        )
    }

    /// Takes the unfinished samples out as (tokens left, current context); waiting ones
    /// leave with their whole length at the prompt's context.
    fn drain(&mut self, prompt_len: u64) -> Vec<(i64, i64)> {
        let mut out: Vec<(i64, i64)> = self.samples[self.pos..]
            .iter()
            .map(|&(fin, ctx0)| (fin - self.step, ctx0 + self.step))
            .collect();
        out.extend(
            self.waiting
                .drain(..)
                .map(|len| (len as i64, prompt_len as i64)),
        );
        self.samples.truncate(self.pos);
        self.sum_ctx0 = 0;
        out
    }

    fn receive(&mut self, moved: &[(i64, i64)]) {
        let mut rest: Vec<(i64, i64)> = self.samples.drain(self.pos..).collect();
        rest.extend(
            moved
                .iter()
                .map(|&(left, ctx)| (self.step + left, ctx - self.step)),
        );
        rest.sort_unstable();
        self.sum_ctx0 = rest.iter().map(|s| s.1).sum();
        self.samples = rest;
        self.pos = 0;
    }
}

/// Simulates a generation's decoding given the drawn lengths: instances advance step by step
/// (always the one whose step ends first); once no more than the migration threshold remain,
/// the instances finish their current step and the tail moves, KV caches included, onto the
/// first `to_instances` instances.
fn trace_generation(
    g: &GenerateSpec,
    devices: &[usize],
    start: f64,
    lens: &[u64],
) -> GenerationTrace {
    let per = devices.len() / g.instances as usize;
    let stages = g.stages.clamp(1, per.max(1) as u64);
    let layout = Layout {
        dp: 1,
        tp: (per as u64 / stages).max(1),
        pp: stages,
    };
    // The generation's ranks compute at once and its end waits for the slowest of them.
    let slow = g.cost.slowest_of(devices.len() as u64);
    let mut insts: Vec<Instance> = (0..g.instances as usize)
        .map(|k| Instance {
            devices: devices[k * per..(k + 1) * per].to_vec(),
            clock: start,
            step: 0,
            samples: Vec::new(),
            pos: 0,
            sum_ctx0: 0,
            decode_start: start,
            released: false,
            waiting: Default::default(),
        })
        .collect();
    let count = insts.len();
    for (j, &len) in lens.iter().enumerate() {
        insts[j % count].waiting.push_back(len);
    }
    let mut trace = GenerationTrace::default();
    for inst in &mut insts {
        let prefill = inst.admit(g, layout) * slow;
        let batch = inst.live();
        trace.spans.push((
            inst.devices.clone(),
            format!("prefill ×{batch}"),
            start,
            start + prefill,
        ));
        inst.clock = start + prefill;
        inst.decode_start = inst.clock;
    }
    let mut live: u64 = lens.len() as u64;
    let mut migrated = false;
    let kv_per_token = g.model.kv_bytes_per_token(g.cost.dtype_bytes) as f64;
    loop {
        if let Some(m) = &g.migration
            && !migrated
            && live <= m.threshold
            && insts.len() as u64 > m.to_instances
        {
            migrated = true;
            // Every instance still decoding finishes the step it is in.
            let mut t_m = insts.iter().map(|i| i.clock).fold(start, f64::max);
            for inst in insts.iter_mut() {
                if inst.live() > 0 && inst.clock < t_m {
                    let dt = inst.step_time(g, layout) * slow;
                    let n = inst.advance(dt);
                    live -= n;
                    if n > 0 {
                        trace.emits.push((inst.clock, n));
                    }
                    inst.clock += inst.admit(g, layout) * slow;
                }
            }
            t_m = insts.iter().map(|i| i.clock).fold(t_m, f64::max);
            let keep = m.to_instances as usize;
            let mut moved = Vec::new();
            let mut released = Vec::new();
            for inst in insts.iter_mut().skip(keep).filter(|i| !i.released) {
                if inst.clock > inst.decode_start {
                    trace.spans.push((
                        inst.devices.clone(),
                        "decode".into(),
                        inst.decode_start,
                        inst.clock,
                    ));
                }
                moved.extend(inst.drain(g.prompt_len));
                released.extend(inst.devices.iter().copied());
            }
            // Each receiving instance gets every `keep`-th moved sample; each of its devices
            // holds its tensor-parallel share of those KV caches and receives it over its own
            // link: NVLink when the whole generation sits in one node, else its network port.
            let d = &g.cost.device;
            let node = g.cost.devices_per_node.max(1) as usize;
            let one_node = devices.first().map(|f| f / node) == devices.last().map(|l| l / node);
            let (bw, lat) = if one_node {
                (d.intra_node_bandwidth, d.intra_node_latency)
            } else {
                (d.inter_node_bandwidth, d.inter_node_latency)
            };
            let transfer = (0..keep)
                .map(|k| {
                    let bytes: f64 = moved
                        .iter()
                        .skip(k)
                        .step_by(keep)
                        .map(|&(_, ctx)| ctx as f64 * kv_per_token)
                        .sum();
                    if bytes > 0.0 {
                        lat + bytes / per as f64 / (bw * d.network_efficiency)
                    } else {
                        0.0
                    }
                })
                .fold(0.0, f64::max);
            trace.migrated = moved.len() as u64;
            let ready = t_m + transfer;
            for (k, inst) in insts.iter_mut().take(keep).enumerate() {
                let share: Vec<(i64, i64)> = moved.iter().skip(k).step_by(keep).copied().collect();
                if inst.clock > inst.decode_start {
                    trace.spans.push((
                        inst.devices.clone(),
                        "decode".into(),
                        inst.decode_start,
                        inst.clock,
                    ));
                }
                inst.receive(&share);
                inst.clock = inst.clock.max(ready);
                inst.decode_start = inst.clock;
            }
            insts.truncate(keep);
            trace.releases.push((ready, released));
            trace.migrated_at = Some(ready);
        }
        // The instance whose next step ends first.
        let mut next: Option<(f64, usize, f64)> = None;
        for (k, inst) in insts.iter().enumerate() {
            if inst.live() == 0 {
                continue;
            }
            let dt = inst.step_time(g, layout) * slow;
            if next.is_none_or(|(end, _, _)| inst.clock + dt < end) {
                next = Some((inst.clock + dt, k, dt));
            }
        }
        let Some((_, k, dt)) = next else { break };
        let n = insts[k].advance(dt);
        if n > 0 {
            live -= n;
            trace.emits.push((insts[k].clock, n));
        }
        // Rows freed by finished samples take waiting ones (their prefill delays the step).
        let g_prefill = insts[k].admit(g, layout) * slow;
        insts[k].clock += g_prefill;
        // With migration, an instance that will not receive the tail hands its devices back
        // as soon as it drains, rather than idling until the migration.
        let inst = &mut insts[k];
        if let Some(m) = &g.migration
            && !migrated
            && k >= m.to_instances as usize
            && inst.unfinished() == 0
            && !inst.released
        {
            inst.released = true;
            trace.spans.push((
                inst.devices.clone(),
                "decode".into(),
                inst.decode_start,
                inst.clock,
            ));
            inst.decode_start = inst.clock;
            trace.releases.push((inst.clock, inst.devices.clone()));
        }
    }
    let tail = if migrated { "decode (tail)" } else { "decode" };
    for inst in &insts {
        if inst.clock > inst.decode_start {
            trace.spans.push((
                inst.devices.clone(),
                tail.into(),
                inst.decode_start,
                inst.clock,
            ));
        }
    }
    trace.end = insts.iter().map(|i| i.clock).fold(start, f64::max);
    trace
}

/// Picks the migration threshold `R_t` for generation task `task` by simulating the whole DAG
/// (so the trade-off is measured where it matters: a later, larger migration keeps the tail
/// fast but frees devices later) for every candidate, with the same seed, and taking the one
/// with the shortest mean iteration. Ties go to the smaller threshold. Returns the choice and
/// every candidate's mean iteration time.
pub fn pick_migration_threshold(
    dag: &Dag,
    task: TaskId,
    candidates: &[u64],
    opts: &SimOptions,
) -> Result<(u64, Vec<(u64, f64)>), SimError> {
    let Some(Work::Generate(g)) = dag.tasks.get(task.0).map(|t| &t.work) else {
        return Err(SimError(format!("task {} is not a generation", task.0)));
    };
    let to_instances = g.migration.as_ref().map_or(1, |m| m.to_instances);
    let mut results = Vec::new();
    for &threshold in candidates {
        let mut variant = dag.clone();
        if let Work::Generate(g) = &mut variant.tasks[task.0].work {
            g.migration = Some(crate::sim::dag::Migration {
                threshold,
                to_instances,
            });
        }
        let report = simulate(&variant, opts)?;
        results.push((threshold, report.mean_iteration_time));
    }
    let best = results
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
        .map(|r| r.0)
        .ok_or_else(|| SimError("no candidate thresholds".into()))?;
    Ok((best, results))
}
