//! Evaluation during a run (the run's `eval` setting, `Plan::eval`): the trained policy
//! answers every record of the held-out dataset with the evaluation's sampling (greedy by
//! default), the run's reward (the `fn` or reward model whose mean is `reward_mean`) scores the
//! answers, and `eval/reward_mean`, `eval/reward_std`, `eval/accuracy` (the share of answers
//! whose final number is the record's answer, when every held-out record has one) and
//! `eval/response_length` are returned for `metrics.jsonl` and TensorBoard. The same seed is
//! used at every evaluation, so successive evaluations differ only by the policy's weights.
//! This module must not print.

use super::*;
use braid_ir::graph::EvalSpec;
use braid_ir::kernel::host::answer_matches;

/// The seed of every evaluation's sampling (fixed, see the module's doc).
const EVAL_SEED: u64 = 0xE7A1_5EED;

impl<'p> Executor<'p> {
    /// Whether the run evaluates after `done` steps (0: before the first).
    pub(super) fn evaluates_at(&self, done: i64) -> bool {
        match &self.plan.eval {
            None => false,
            Some(e) => done == 0 || done % e.every.max(1) == 0 || done == self.total_steps,
        }
    }

    /// One evaluation of the current policy on the held-out prompts.
    pub fn evaluate(&mut self) -> Result<BTreeMap<String, f64>> {
        let Some(spec) = self.plan.eval.clone() else {
            return Err(Error::invalid("eval", "the run has no `eval` setting"));
        };
        let (rollout_id, reward_id) = match (self.main_rollout, self.reward_node) {
            (Some(r), Some(w)) => (r, w),
            _ => {
                return Err(Error::invalid(
                    "eval",
                    "the run's pipeline has no reward on the trained rollout to evaluate with",
                ));
            }
        };
        let model = match self.plan.graph.node(rollout_id).map(|n| &n.op) {
            Some(Op::Generate { model, .. }) => *model as usize,
            _ => {
                return Err(Error::invalid(
                    "eval",
                    "the trained rollout is not generated",
                ));
            }
        };
        let rollout = self.eval_rollout(&spec, model)?;
        let reward = self.plan.graph.node(reward_id).map(|n| n.op.clone());
        let mut vals: BTreeMap<NodeId, Val> = BTreeMap::new();
        vals.insert(rollout_id, Val::Rollout(rollout.clone()));
        let inputs = self.plan.graph.inputs(reward_id);
        let scores = match reward {
            Some(Op::Kernel { args, .. }) => {
                if args
                    .iter()
                    .any(|a| matches!(a, Operand::Input(p) if *p != 0))
                {
                    return Err(Error::invalid(
                        "eval",
                        "the reward `fn` reads values other than the sample, which an evaluation does not compute",
                    ));
                }
                let k = self.kernels.get(&reward_id).cloned().ok_or_else(|| {
                    Error::invalid("plan", format!("kernel {reward_id} was not compiled"))
                })?;
                run_kernel(&k, &args, &inputs, &vals)?
            }
            Some(op @ Op::Score { model }) => {
                let seqs = self.sequences_of(reward_id, model, &rollout)?;
                // The reward model's micro-batches, as the plan sizes them for the run's own
                // rollout, applied to the held-out set.
                let micro = self.micro_size(reward_id, seqs.len());
                self.infer(&op, model, &seqs, rollout.temperature, micro)?
            }
            _ => {
                return Err(Error::invalid(
                    "eval",
                    "the run's reward is not a `fn` or a reward model",
                ));
            }
        };
        let Val::PerSample(scores) = scores else {
            return Err(Error::invalid(
                "eval",
                "the reward is not one number per sample",
            ));
        };
        let mut m = BTreeMap::new();
        let (mean, std) = mean_std(&scores);
        m.insert("eval/reward_mean".to_string(), mean);
        m.insert("eval/reward_std".to_string(), std);
        let lengths: Vec<f64> = rollout.lengths().iter().map(|&l| l as f64).collect();
        m.insert("eval/response_length".to_string(), mean_std(&lengths).0);
        if rollout.records.iter().all(|r| !r.answer.is_empty()) {
            let right = rollout
                .samples
                .iter()
                .filter(|s| {
                    rollout
                        .records
                        .get(s.prompt_index)
                        .is_some_and(|r| answer_matches(&s.text, &r.answer))
                })
                .count();
            m.insert(
                "eval/accuracy".to_string(),
                right as f64 / rollout.samples.len().max(1) as f64,
            );
        }
        Ok(m)
    }

    /// Every held-out record answered by the policy in slot `model`.
    fn eval_rollout(&self, spec: &EvalSpec, model: usize) -> Result<Arc<RolloutData>> {
        let d = &self.datasets[spec.dataset as usize];
        let slot = &self.slots[model];
        let tok = &slot.tokenizer;
        let mut prompts = Vec::with_capacity(d.records.len());
        for r in &d.records {
            prompts.push(prompt_ids(tok, r, d.chat_template)?);
        }
        let p = &spec.params;
        let sampling = SamplingParams {
            max_new_tokens: p.max_new_tokens.max(1) as usize,
            greedy: p.greedy,
            temperature: p.temperature as f32,
            top_k: p.top_k.max(0) as usize,
            top_p: p.top_p as f32,
            seed: EVAL_SEED ^ self.plan.seed as u64,
            n: p.n.max(1) as usize,
            stop: Vec::new(),
            stop_at_eos: true,
        };
        let temperature = f64::from(sampling.logprob_temperature());
        let out = crate::generation::engine::generate(
            slot.whole()?,
            tok,
            prompts.clone(),
            sampling,
            EngineOptions::default(),
        )?;
        let samples = out
            .into_iter()
            .map(|s| GenSample {
                prompt_index: s.prompt_index,
                rollout: Rollout {
                    prompt: prompts[s.prompt_index].clone(),
                    completion: s.token_ids.clone(),
                },
                text: s.text,
            })
            .collect();
        Ok(Arc::new(RolloutData {
            samples,
            records: d.records.clone(),
            temperature,
        }))
    }
}
