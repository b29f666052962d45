//! What a run leaves behind: checkpoints and their restore, `metrics.jsonl` and TensorBoard,
//! the histogram of generated lengths, the run's fingerprint, and the metrics of a step.

use super::*;

impl<'p> Executor<'p> {
    /// Loads the trained models' weights of checkpoint `dir` (a `step-N` directory), without
    /// its optimizer state or data cursors: what `braid run --eval-only` evaluates.
    pub fn load_trained(&mut self, dir: &Path) -> Result<()> {
        for slot in self.slots.iter_mut() {
            if slot.opt.is_none() {
                continue;
            }
            let mdir = dir.join("models").join(&slot.spec.name);
            let loaded = Model::load(
                &mdir,
                &LoadOptions {
                    head: slot.model.head(),
                    dtype: Some(slot.model.kind()),
                    device: self.options.device,
                },
            )?;
            copy_weights(&mut slot.model, &loaded)?;
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
                "the checkpoint was made by a different plan (another program, other run settings, or planned for another target); resume with the run directory's own plan.json",
            ));
        }
        for slot in self.slots.iter_mut() {
            let Some(opt) = slot.opt.as_mut() else {
                continue;
            };
            let mdir = dir.join("models").join(&slot.spec.name);
            let loaded = Model::load(
                &mdir,
                &LoadOptions {
                    head: slot.model.head(),
                    dtype: Some(slot.model.kind()),
                    device: self.options.device,
                },
            )?;
            copy_weights(&mut slot.model, &loaded)?;
            opt.load(&checkpoint::optimizer_path(&dir, &slot.spec.name))?;
            if opt.has_masters() {
                // The weights the run continues from; the model's copy is rounded from them.
                opt.load_masters(&checkpoint::master_path(&dir, &slot.spec.name))?;
            }
            if let Some(r) = slot.replica.as_mut() {
                copy_weights(r, &slot.model)?;
            }
        }
        for (i, d) in self.plan.datasets.iter().enumerate() {
            self.cursors[i] = state.cursors.get(&d.name).copied().unwrap_or(0);
        }
        self.first_step = step;
        Ok(())
    }

    /// Runs the remaining steps, reporting each; writes checkpoints and `metrics.jsonl`.
    pub fn run(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Result<()> {
        std::fs::create_dir_all(&self.options.run_dir)
            .map_err(|e| Error::file(&self.options.run_dir, format!("cannot create: {e}")))?;
        let metrics_path = self.options.run_dir.join("metrics.jsonl");
        checkpoint::truncate_metrics(&metrics_path, self.first_step)?;
        let samples_path = self.options.run_dir.join("samples.jsonl");
        checkpoint::truncate_metrics(&samples_path, self.first_step)?;
        checkpoint::write_atomic(
            &self.options.run_dir.join("plan.txt"),
            self.plan.graph_text().as_bytes(),
        )?;
        checkpoint::write_atomic(
            &self.options.run_dir.join("plan.json"),
            self.exec.to_json().as_bytes(),
        )?;
        on_event(Event::Start {
            first_step: self.first_step,
            total: self.total_steps,
        });
        let every = self
            .options
            .checkpoint_every
            .unwrap_or(self.plan.checkpoint_every)
            .max(0);
        let mut lengths_seen: Vec<usize> = Vec::new();
        let mut tb = crate::exec::tensorboard::EventWriter::create(
            &self.options.run_dir.join("tensorboard"),
        )?;
        if self.first_step == 0 && self.evaluates_at(0) {
            // The policy before training: a line of its own, step 0.
            let metrics = self.evaluate()?;
            write_metrics(&metrics_path, &mut tb, 0, &metrics)?;
            on_event(Event::Eval {
                step: 0,
                metrics: &metrics,
            });
        }
        for step in self.first_step..self.total_steps {
            let (mut metrics, lengths) = self.step(step)?;
            let evaluated = self.evaluates_at(step + 1);
            if evaluated {
                metrics.extend(self.evaluate()?);
            }
            lengths_seen.extend(lengths);
            write_metrics(&metrics_path, &mut tb, step + 1, &metrics)?;
            for line in &self.last_samples {
                checkpoint::append_line(&samples_path, &line.to_string())?;
            }
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
            let done = step + 1;
            if (every > 0 && done % every == 0) || done == self.total_steps {
                let dir = self.checkpoint(done)?;
                on_event(Event::Checkpoint {
                    step: done,
                    dir: &dir,
                });
            }
        }
        if !lengths_seen.is_empty() {
            checkpoint::write_atomic(
                &self.options.run_dir.join("lengths.txt"),
                length_histogram(&lengths_seen).as_bytes(),
            )?;
        }
        Ok(())
    }

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
        let trained: Vec<(&str, &Model, &Tokenizer, &AdamW)> = self
            .slots
            .iter()
            .filter_map(|s| {
                s.opt
                    .as_ref()
                    .map(|o| (s.spec.name.as_str(), &s.model, &s.tokenizer, o))
            })
            .collect();
        checkpoint::save(&self.options.run_dir, &state, &trained)
    }

    /// The trained models' final directories (the latest checkpoint's).
    pub fn final_models(&self) -> Result<Vec<(String, PathBuf)>> {
        let Some((_, dir)) = checkpoint::latest(&self.options.run_dir)? else {
            return Ok(Vec::new());
        };
        Ok(self
            .slots
            .iter()
            .filter(|s| s.opt.is_some())
            .map(|s| (s.spec.name.clone(), dir.join("models").join(&s.spec.name)))
            .collect())
    }

    /// `samples.jsonl` lines of step `step` (0-based): prompt, completion, answer, reward and
    /// advantage of the first sample of the first `SAMPLES_PER_STEP` prompts of the rollout
    /// the policy learns from. The advantage is the loss's advantage operand (a per-token
    /// advantage, as PPO's, is given as its mean over the sample's tokens).
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
        // The advantage: the operand of a loss on this rollout that is an advantage.
        let mut adv: Option<&Val> = None;
        for id in self.plan.graph.node_ids() {
            let Some(Op::Loss { kind, args }) = self.plan.graph.node(id).map(|n| &n.op) else {
                continue;
            };
            let at = match kind {
                LossKind::Grpo => 2,
                LossKind::Ppo => 1,
                _ => continue,
            };
            let inputs = self.plan.graph.inputs(id);
            if let Some(Operand::Input(p)) = args.get(at)
                && let Some(v) = inputs.get(*p as usize).and_then(|n| vals.get(n))
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

/// The generated lengths as a histogram in the planner's format (`LEN COUNT` per line, `#`
/// comments): `braid plan FILE --gen-lengths RUN_DIR/lengths.txt` plans with the observed
/// distribution.
pub(super) fn length_histogram(lengths: &[usize]) -> String {
    let mut counts: BTreeMap<usize, u64> = BTreeMap::new();
    for &l in lengths {
        *counts.entry(l.max(1)).or_default() += 1;
    }
    let mut out = format!(
        "# generated lengths of the policy's rollouts: {} samples (LEN COUNT)\n",
        lengths.len()
    );
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
