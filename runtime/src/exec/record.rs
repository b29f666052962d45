//! What a run leaves behind: checkpoints and their restore, `metrics.jsonl` and TensorBoard,
//! the histogram of generated lengths, the run's fingerprint, and the metrics of a step.

use super::*;

impl<'p> Executor<'p> {
    /// Loads the trained models' weights of checkpoint `dir` (a `step-N` directory), without
    /// its optimizer state or data cursors: what `braid run --eval-only` evaluates.
    pub fn load_trained(&mut self, dir: &Path) -> Result<()> {
        for i in 0..self.slots.len() {
            if self.slots[i].opt.is_some() {
                self.load_weights(i, dir)?;
            }
        }
        Ok(())
    }

    /// Copies slot `i`'s weights from checkpoint `dir` into its model (and its replica).
    fn load_weights(&mut self, i: usize, dir: &Path) -> Result<()> {
        let device = self.options.device;
        let slot = &mut self.slots[i];
        let mdir = dir.join("models").join(&slot.spec.name);
        let (head, kind) = {
            let m = slot.model()?;
            (m.head(), m.kind())
        };
        let loaded = Model::load(
            &mdir,
            &LoadOptions {
                head,
                dtype: Some(kind),
                device,
            },
        )?;
        for m in slot.copies_mut() {
            copy_weights(m, &loaded)?;
        }
        Ok(())
    }

    pub(super) fn restore(&mut self) -> Result<()> {
        let Some((step, dir)) = checkpoint::latest(&self.options.run_dir)? else {
            return Ok(());
        };
        let state = checkpoint::read_state(&dir)?;
        let fingerprint = fingerprint(self.exec);
        if state.fingerprint != fingerprint {
            return Err(Error::file(
                dir.join("state.json"),
                "the checkpoint was made by a different plan (another program, other run settings, or planned for another target or world size); resume with the run directory's own plan.json, in the world it was planned for",
            ));
        }
        // Every rank that trains a model loads it and its optimizer state; a rank that only
        // runs a model's other calls gets its weights from the first reshard after loading
        // (below).
        for i in 0..self.slots.len() {
            if self.slots[i].opt.is_none() {
                continue;
            }
            self.load_weights(i, &dir)?;
            let name = self.slots[i].spec.name.clone();
            let slot = &mut self.slots[i];
            let (Some(m), Some(opt)) = (slot.model.as_ref(), slot.opt.as_mut()) else {
                continue;
            };
            opt.load(&checkpoint::part_path(
                checkpoint::optimizer_path(&dir, &name),
                m,
            ))?;
            if opt.has_masters() {
                // The weights the run continues from; the model's copy is rounded from
                // them (and equals the checkpoint's weights, which are that rounding).
                opt.load_masters(&checkpoint::part_path(
                    checkpoint::master_path(&dir, &name),
                    m,
                ))?;
            }
        }
        // Ranks that hold a trained model without training it (its generation, on other
        // devices) read its weights from the checkpoint too: the same weights the trained
        // ranks hold.
        for i in 0..self.slots.len() {
            if self.slots[i].opt.is_none()
                && self.slots[i].model.is_some()
                && self.slots[i].spec.optimizer.is_some()
                && dir.join("models").join(&self.slots[i].spec.name).exists()
            {
                self.load_weights(i, &dir)?;
            }
        }
        for (i, d) in self.plan.datasets.iter().enumerate() {
            self.cursors[i] = state.cursors.get(&d.name).copied().unwrap_or(0);
        }
        self.first_step = step;
        Ok(())
    }

    /// Whether this rank writes the run's files (metrics, TensorBoard, samples, the plan).
    fn writes(&self) -> bool {
        self.comm.rank == 0
    }

    /// Runs the remaining steps, reporting each; writes checkpoints and `metrics.jsonl`. Only
    /// rank 0 writes the run's files and reports events; every rank runs the steps.
    pub fn run(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<()> {
        let result = self.run_steps(on_event);
        match result {
            // Every rank ends in order: rank 0 keeps the store until the others are done.
            Ok(()) => self.comm.shutdown(),
            Err(e) => Err(e),
        }
    }

    fn run_steps(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<()> {
        let metrics_path = self.options.run_dir.join("metrics.jsonl");
        let samples_path = self.options.run_dir.join("samples.jsonl");
        let mut tb = None;
        let mut files = None;
        if self.writes() {
            std::fs::create_dir_all(&self.options.run_dir)
                .map_err(|e| Error::file(&self.options.run_dir, format!("cannot create: {e}")))?;
            checkpoint::truncate_metrics(&metrics_path, self.first_step)?;
            checkpoint::truncate_metrics(&samples_path, self.first_step)?;
            checkpoint::write_atomic(
                &self.options.run_dir.join("plan.txt"),
                format!("{}\n{}", self.plan.graph_text(), self.plan.losses_text()).as_bytes(),
            )?;
            checkpoint::write_atomic(
                &self.options.run_dir.join("plan.json"),
                self.exec.to_json().as_bytes(),
            )?;
            tb = Some(crate::exec::tensorboard::EventWriter::create(
                &self.options.run_dir.join("tensorboard"),
            )?);
            on_event(Event::Start {
                first_step: self.first_step,
                total: self.total_steps,
            });
        }
        let every = self
            .options
            .checkpoint_every
            .unwrap_or(self.plan.checkpoint_every)
            .max(0);
        let mut lengths_seen: Vec<usize> = Vec::new();
        let mut prompts_seen: Vec<usize> = Vec::new();
        if self.first_step == 0 && self.evaluates_at(0) {
            // The policy before training: a line of its own, step 0.
            let metrics = self.evaluate()?;
            if let Some(tb) = tb.as_mut() {
                write_metrics(&metrics_path, tb, 0, &metrics)?;
                on_event(Event::Eval {
                    step: 0,
                    metrics: &metrics,
                });
            }
        }
        if let Some(tb) = tb.take() {
            files = Some(StepFiles::start(&self.options.run_dir, tb)?);
        }
        for step in self.first_step..self.total_steps {
            let (mine, lengths, prompts) = self.step(step)?;
            let (mut metrics, spans) = self.gather_step(mine)?;
            let evaluated = self.evaluates_at(step + 1);
            if evaluated {
                metrics.extend(self.evaluate()?);
            }
            lengths_seen.extend(lengths);
            prompts_seen.extend(prompts);
            if let Some(files) = files.as_mut() {
                files.send(FileJob::Step {
                    step: step + 1,
                    metrics: metrics.clone(),
                    samples: self.last_samples.iter().map(|l| l.to_string()).collect(),
                    spans,
                    devices: self.comm.size.max(1),
                })?;
                on_event(Event::Step {
                    step: step + 1,
                    total: self.total_steps,
                    metrics: &metrics,
                    samples: &self.last_samples,
                });
                if evaluated {
                    on_event(Event::Eval {
                        step: step + 1,
                        metrics: &metrics,
                    });
                }
            }
            let done = step + 1;
            if (every > 0 && done % every == 0) || done == self.total_steps {
                // The metrics and samples of every step up to the checkpoint are on disk
                // before it is: a run resumed from it keeps their lines.
                if let Some(files) = files.as_mut() {
                    files.flush()?;
                }
                let dir = self.checkpoint(done)?;
                if self.writes() {
                    on_event(Event::Checkpoint {
                        step: done,
                        dir: &dir,
                    });
                }
            }
        }
        if let Some(files) = files.as_mut() {
            files.finish()?;
        }
        if self.writes() && !lengths_seen.is_empty() {
            checkpoint::write_atomic(
                &self.options.run_dir.join("lengths.txt"),
                length_histogram("generated lengths of the policy's rollouts", &lengths_seen)
                    .as_bytes(),
            )?;
        }
        if self.writes() && !prompts_seen.is_empty() {
            checkpoint::write_atomic(
                &self.options.run_dir.join("prompt-lengths.txt"),
                length_histogram("prompt lengths of the policy's rollouts", &prompts_seen)
                    .as_bytes(),
            )?;
        }
        Ok(())
    }

    /// The step's metrics on rank 0, from every rank's: a rank reports what it computed (a
    /// training's metrics on its training ranks, identical there after their reductions;
    /// generation timings on generating ranks). Times and memory are the largest rank's, generated tokens
    /// per second the sum over ranks; every other value is the one the lowest rank reporting
    /// it has (every rank computes the same reward and KL from the same gathered values).
    ///
    /// With them, every rank's spans of the step (rank 0's copy; `None` elsewhere), in the same
    /// exchange: the measured timeline of the run's latest step, which rank 0 writes to
    /// `RUN_DIR/timeline.json` in the format `braid sim --trace` writes (one thread per rank)
    /// and `braid report` shows beside the simulated one.
    fn gather_step(&self, mine: Metrics) -> Result<(Metrics, Option<Vec<Span>>)> {
        if self.comm.is_single() {
            let mut mine = mine;
            mine.remove("stream/hidden_s");
            mine.remove("stream/infer_s");
            return Ok((mine, Some(self.timeline.clone())));
        }
        let bytes = serde_json::to_vec(&StepReport {
            metrics: mine.into_iter().map(|(k, v)| (k, Some(v))).collect(),
            spans: self.timeline.clone(),
            started: self.step_started,
        })
        .map_err(|e| Error::invalid("metrics", e.to_string()))?;
        let all = self.comm.all_gather_bytes(bytes)?;
        let mut out: BTreeMap<String, f64> = BTreeMap::new();
        let mut spans: Vec<Span> = Vec::new();
        let reports = all
            .iter()
            .map(|part| {
                serde_json::from_slice::<StepReport>(part)
                    .map_err(|e| Error::invalid("metrics", e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        // One clock for every rank's spans (the host's: exact on one machine, as close as the
        // nodes' clocks agree on several), counted from the earliest rank's start of the step.
        let earliest = reports
            .iter()
            .map(|r| r.started)
            .fold(f64::INFINITY, f64::min);
        for r in reports {
            let shift = r.started - earliest;
            spans.extend(r.spans.into_iter().map(|mut s| {
                s.start += shift;
                s.end += shift;
                s
            }));
            for (k, v) in r.metrics {
                let v = v.unwrap_or(f64::NAN);
                match out.get_mut(&k) {
                    None => {
                        out.insert(k, v);
                    }
                    Some(x)
                        if (k.starts_with("time/") && k != "time/infer_hidden")
                            || k.starts_with("memory/") =>
                    {
                        *x = x.max(v);
                    }
                    Some(x)
                        if k == "tokens_per_s"
                            || k.starts_with("stream/")
                            || matches!(
                                k.as_str(),
                                "migrate/samples"
                                    | "migrate/bytes"
                                    | "migrate/prefill_tokens"
                                    | "migrate/reallocated"
                            ) =>
                    {
                        *x += v
                    }
                    Some(x) if matches!(k.as_str(), "migrate/happened" | "migrate/seconds") => {
                        *x = x.max(v)
                    }
                    Some(_) => {}
                }
            }
        }
        // The share of streamed inference hidden under generation, over every rank's.
        if let (Some(h), Some(i)) = (out.remove("stream/hidden_s"), out.remove("stream/infer_s"))
            && i > 0.0
        {
            out.insert("time/infer_hidden".into(), h / i);
        }
        Ok((out, self.writes().then_some(spans)))
    }

    /// Writes a checkpoint of every trained model: rank 0 opens a pending checkpoint, the
    /// first rank training each model writes that model and its optimizer state, and rank 0
    /// commits it once every rank is done (the run directory must be on a file system every
    /// rank sees, as on one machine).
    pub(super) fn checkpoint(&self, step: i64) -> Result<PathBuf> {
        let mut cursors = BTreeMap::new();
        for (i, d) in self.plan.datasets.iter().enumerate() {
            cursors.insert(d.name.clone(), self.cursors[i]);
        }
        let state = State {
            step,
            cursors,
            seed: self.plan.seed,
            pipeline: self.plan.pipeline.clone(),
            fingerprint: fingerprint(self.exec),
        };
        if self.comm.is_single() {
            let mut trained: Vec<(&str, &Model, &Tokenizer, &AdamW)> = Vec::new();
            for s in &self.slots {
                if let Some(o) = &s.opt {
                    trained.push((s.spec.name.as_str(), s.model()?, &s.tokenizer, o));
                }
            }
            return checkpoint::save(&self.options.run_dir, &state, &trained);
        }
        let tmp = checkpoint::pending_dir(&self.options.run_dir, step);
        if self.writes() {
            checkpoint::begin(&self.options.run_dir, step)?;
        }
        self.comm.barrier()?;
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(o) = &s.opt
                && self.writes_model(i)?
            {
                checkpoint::write_model(&tmp, &s.spec.name, s.model()?, &s.tokenizer, o)?;
            }
        }
        self.comm.barrier()?;
        let dir = if self.writes() {
            checkpoint::commit(&self.options.run_dir, &tmp, &state)?
        } else {
            self.options
                .run_dir
                .join("checkpoints")
                .join(format!("step-{step:06}"))
        };
        // Nobody runs on before the checkpoint is complete: a kill after this loses no step.
        self.comm.barrier()?;
        Ok(dir)
    }

    /// Whether this rank writes trained model `i` into checkpoints: the lowest rank of its
    /// trainings' meshes, or with pipeline or tensor parallelism every rank of the first
    /// replica (each stage its own file of the sharded checkpoint, gathered from its tensor
    /// ranks, which write their own optimizer state).
    fn writes_model(&self, i: usize) -> Result<bool> {
        let home = self.slots[i].home;
        if home.stages <= 1 && home.tp <= 1 {
            return Ok(self.writer_of(i as u32) == Some(self.comm.rank));
        }
        for id in self.plan.graph.node_ids() {
            if let (Some(Op::Train { model, .. }), Some(p)) = (
                self.plan.graph.node(id).map(|n| &n.op),
                self.exec.placement(id),
            ) && *model as usize == i
            {
                let seats = comm::seating(self.exec, id)?;
                let c = comm::played_by(&seats, self.comm.rank).and_then(|d| p.coords(d));
                return Ok(c.is_some_and(|c| c.dp == 0));
            }
        }
        Ok(false)
    }

    /// The rank that writes model `m` into checkpoints: the lowest rank of its trainings'
    /// meshes.
    fn writer_of(&self, m: u32) -> Option<usize> {
        self.plan
            .graph
            .node_ids()
            .into_iter()
            .filter(|id| {
                matches!(self.plan.graph.node(*id).map(|n| &n.op), Some(Op::Train { model, .. }) if *model == m)
            })
            .filter_map(|id| self.exec.placement(id).map(|p| p.first as usize))
            .min()
    }

    /// The trained models' final directories (the latest checkpoint's).
    pub fn final_models(&self) -> Result<Vec<(String, PathBuf)>> {
        let Some((_, dir)) = checkpoint::latest(&self.options.run_dir)? else {
            return Ok(Vec::new());
        };
        Ok(self
            .plan
            .models
            .iter()
            .filter(|m| m.optimizer.is_some() && dir.join("models").join(&m.name).exists())
            .map(|m| (m.name.clone(), dir.join("models").join(&m.name)))
            .collect())
    }

    /// `samples.jsonl` lines of step `step` (0-based): prompt, completion, answer, reward and
    /// advantage of the first sample of the first `SAMPLES_PER_STEP` prompts of the rollout
    /// the policy learns from. The advantage is the loss's argument bound to a parameter `adv`
    /// (a per-token advantage, as PPO's, is given as its mean over the sample's tokens).
    pub(super) fn sample_lines(
        &self,
        step: i64,
        vals: &BTreeMap<NodeId, Val>,
    ) -> Vec<serde_json::Value> {
        let Some(r) = self.main_rollout else {
            return Vec::new();
        };
        let Some(Val::Rollout(rollout)) = vals.get(&r) else {
            return Vec::new();
        };
        let reward = match self.reward_node.and_then(|n| vals.get(&n)) {
            Some(Val::PerSample(v)) => Some(v.as_slice()),
            _ => None,
        };
        // The advantage: the argument of a loss on this rollout bound to a parameter `adv`
        // (what the standard losses call it).
        let mut adv: Option<&Val> = None;
        for id in self.plan.graph.node_ids() {
            let Some(Op::Loss { objective }) = self.plan.graph.node(id).map(|n| &n.op) else {
                continue;
            };
            let inputs = self.plan.graph.inputs(id);
            if inputs.first() == Some(&r)
                && let Some(k) = objective.input_named("adv")
                && let Some(v) = inputs.get(k + 1).and_then(|n| vals.get(n))
            {
                adv = Some(v);
                break;
            }
        }
        let mut out = Vec::new();
        let mut seen = BTreeSet::new();
        for (i, s) in rollout.samples.iter().enumerate() {
            if seen.len() == SAMPLES_PER_STEP {
                break;
            }
            if !seen.insert(s.prompt_index) {
                continue;
            }
            let record = rollout.records.get(s.prompt_index);
            let advantage = match adv {
                Some(Val::PerSample(v)) => v.get(i).copied(),
                Some(Val::PerToken(t)) if i + 1 < t.offsets.len() => {
                    let row = t.row(i);
                    Some(row.iter().sum::<f64>() / row.len().max(1) as f64)
                }
                _ => None,
            };
            let num = |x: Option<f64>| match x {
                Some(v) if v.is_finite() => serde_json::json!(v),
                _ => serde_json::Value::Null,
            };
            out.push(serde_json::json!({
                "step": step + 1,
                "prompt": record.map(|r| r.prompt.as_str()).unwrap_or(""),
                "completion": s.text,
                "answer": record.map(|r| r.answer.as_str()).unwrap_or(""),
                "reward": num(reward.and_then(|r| r.get(i).copied())),
                "advantage": num(advantage),
            }));
        }
        out
    }

    /// The mean over samples of Σ_t (logp − ref_logp), when the trained rollout has the
    /// log-probabilities of a trained model and of a frozen one.
    pub(super) fn kl_metric(&self, vals: &BTreeMap<NodeId, Val>) -> Option<f64> {
        let r = self.main_rollout?;
        let mut trained = None;
        let mut frozen = None;
        for id in self.plan.graph.consumers(r) {
            let node = self.plan.graph.node(id)?;
            if let Op::Logprobs { model } = node.op {
                let is_trained = self.slots.get(model as usize)?.opt.is_some();
                if is_trained && trained.is_none() {
                    trained = Some(id);
                } else if !is_trained && frozen.is_none() {
                    frozen = Some(id);
                }
            }
        }
        let (Some(Val::PerToken(a)), Some(Val::PerToken(b))) =
            (vals.get(&trained?), vals.get(&frozen?))
        else {
            return None;
        };
        let n = a.offsets.len().saturating_sub(1);
        if n == 0 {
            return None;
        }
        let total: f64 = a.values.iter().zip(&b.values).map(|(x, y)| x - y).sum();
        Some(total / n as f64)
    }
}

/// Appends one step's line to `metrics.jsonl` (non-finite values as `null`) and its scalars
/// to TensorBoard.
/// A step's metrics by name.
type Metrics = BTreeMap<String, f64>;

/// What each rank sends rank 0 after a step: its metrics (a non-finite value as `null`) and
/// its timeline spans.
#[derive(serde::Serialize, serde::Deserialize)]
struct StepReport {
    metrics: BTreeMap<String, Option<f64>>,
    spans: Vec<Span>,
    /// When the rank started the step, in seconds since the Unix epoch: its spans count from
    /// there, and rank 0 moves every rank's onto the earliest rank's start.
    started: f64,
}

/// A step's files, for [`StepFiles`].
enum FileJob {
    Step {
        step: i64,
        metrics: Metrics,
        /// Lines of `samples.jsonl`.
        samples: Vec<String>,
        /// Every rank's spans of the step, for `timeline.json`.
        spans: Option<Vec<Span>>,
        devices: usize,
    },
    /// Answers once every job sent before it is written.
    Flush(mpsc::Sender<()>),
}

/// Rank 0's files of each step — its lines of `metrics.jsonl`, TensorBoard's events and
/// `samples.jsonl`, and `timeline.json` — written in order on a thread of their own, so that
/// the next step does not wait for the disk (nor the other ranks for rank 0's writes). A
/// write that fails ends the run at the next step, with the error naming the file; `flush`
/// waits for everything sent (before a checkpoint), and `finish` (or dropping it, as a failed
/// run does) for everything, then ends the thread.
struct StepFiles {
    tx: Option<mpsc::Sender<FileJob>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl StepFiles {
    fn start(run_dir: &Path, mut tb: crate::exec::tensorboard::EventWriter) -> Result<StepFiles> {
        let (tx, rx) = mpsc::channel::<FileJob>();
        let metrics_path = run_dir.join("metrics.jsonl");
        let samples_path = run_dir.join("samples.jsonl");
        let timeline_path = run_dir.join("timeline.json");
        let thread = std::thread::Builder::new()
            .name("braid-run-files".into())
            .spawn(move || -> Result<()> {
                crate::device::yield_to_compute();
                for job in rx {
                    match job {
                        FileJob::Step {
                            step,
                            metrics,
                            samples,
                            spans,
                            devices,
                        } => {
                            write_metrics(&metrics_path, &mut tb, step, &metrics)?;
                            for line in &samples {
                                checkpoint::append_line(&samples_path, line)?;
                            }
                            if let Some(spans) = spans {
                                let json = braid_cost::sim::spans_to_chrome_trace(&spans, devices);
                                checkpoint::write_atomic(&timeline_path, json.as_bytes())?;
                            }
                        }
                        FileJob::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
                Ok(())
            })
            .map_err(|e| Error::invalid("run files", format!("cannot start their thread: {e}")))?;
        Ok(StepFiles {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues a job; the error of a write that failed before, if one did.
    fn send(&mut self, job: FileJob) -> Result<()> {
        let Some(tx) = self.tx.as_ref() else {
            return Err(stopped());
        };
        if tx.send(job).is_ok() {
            return Ok(());
        }
        // The thread stopped: a write failed.
        self.finish()?;
        Err(stopped())
    }

    /// Waits until every job sent so far is written.
    fn flush(&mut self) -> Result<()> {
        let (done_tx, done_rx) = mpsc::channel();
        self.send(FileJob::Flush(done_tx))?;
        if done_rx.recv().is_ok() {
            return Ok(());
        }
        self.finish()?;
        Err(stopped())
    }

    /// Writes everything sent and ends the thread: its first error, if a write failed.
    fn finish(&mut self) -> Result<()> {
        drop(self.tx.take());
        match self.thread.take().map(|t| t.join()) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err(Error::invalid(
                "run files",
                "the thread writing metrics.jsonl, samples.jsonl and timeline.json panicked",
            )),
        }
    }
}

/// A step's files sent after the thread writing them ended.
fn stopped() -> Error {
    Error::invalid(
        "run files",
        "metrics.jsonl, samples.jsonl and timeline.json are no longer written (an earlier write failed)",
    )
}

impl Drop for StepFiles {
    fn drop(&mut self) {
        // A run that failed still writes the steps it completed.
        let _ = self.finish();
    }
}

fn write_metrics(
    path: &Path,
    tb: &mut crate::exec::tensorboard::EventWriter,
    step: i64,
    metrics: &BTreeMap<String, f64>,
) -> Result<()> {
    let mut line = serde_json::Map::new();
    line.insert("step".into(), serde_json::json!(step));
    for (k, v) in metrics {
        line.insert(
            k.clone(),
            if v.is_finite() {
                serde_json::json!(v)
            } else {
                serde_json::Value::Null
            },
        );
    }
    checkpoint::append_line(path, &serde_json::Value::Object(line).to_string())?;
    let scalars: Vec<(&str, f64)> = metrics.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    tb.scalars(step, &scalars)
}

pub(super) fn mean_std(x: &[f64]) -> (f64, f64) {
    if x.is_empty() {
        return (0.0, 0.0);
    }
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Lengths in tokens as a histogram in the planner's format (`LEN COUNT` per line, `#`
/// comments), under a comment saying `what` they are: `braid plan FILE --gen-lengths
/// RUN_DIR/lengths.txt` plans with the observed generated lengths, `--prompt-lengths
/// RUN_DIR/prompt-lengths.txt` with the observed prompts.
pub(super) fn length_histogram(what: &str, lengths: &[usize]) -> String {
    let mut counts: BTreeMap<usize, u64> = BTreeMap::new();
    for &l in lengths {
        *counts.entry(l.max(1)).or_default() += 1;
    }
    let mut out = format!("# {what}: {} (LEN COUNT)\n", lengths.len());
    for (l, c) in counts {
        out.push_str(&format!("{l} {c}\n"));
    }
    out
}

/// What identifies a run: a hash (64-bit FNV-1a) of its plan's JSON form, which holds the
/// program's graph, models, data, settings and every planning decision.
pub fn fingerprint(plan: &ExecPlan) -> String {
    let text = plan.to_json();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(n: i64) -> FileJob {
        FileJob::Step {
            step: n,
            metrics: [("loss".to_string(), n as f64)].into_iter().collect(),
            samples: vec![format!("{{\"step\":{n}}}")],
            spans: Some(Vec::new()),
            devices: 1,
        }
    }

    #[test]
    fn step_files_are_written_in_order_and_a_failed_write_is_reported_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("braid-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let tb = crate::exec::tensorboard::EventWriter::create(&dir.join("tensorboard")).unwrap();
        let mut files = StepFiles::start(&dir, tb).unwrap();
        for n in 1..=3 {
            files.send(step(n)).unwrap();
        }
        files.flush().unwrap();
        let lines: Vec<i64> = std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_i64()
                    .unwrap()
            })
            .collect();
        assert_eq!(lines, [1, 2, 3]);
        assert!(dir.join("timeline.json").exists());
        // samples.jsonl cannot be appended to: the run learns it at its next step or its end.
        std::fs::remove_file(dir.join("samples.jsonl")).unwrap();
        std::fs::create_dir(dir.join("samples.jsonl")).unwrap();
        let failed = (4..=40).find_map(|n| files.send(step(n)).err());
        let e = failed.unwrap_or_else(|| files.finish().unwrap_err());
        assert!(e.to_string().contains("samples.jsonl"), "{e}");
        // Once failed, it stays failed.
        assert!(files.send(step(41)).is_err());
        assert!(files.flush().is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
