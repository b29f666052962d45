//! Compute nodes: inference calls run after generation, `fn` kernels through the JIT,
//! element-wise arithmetic and `by_prompt`.

use super::*;

impl<'p> Executor<'p> {
    /// Sequences per forward pass of call `id` over `n` sequences: each data-parallel
    /// replica's share of `n` split into the plan's micro-batch count for the call.
    pub(super) fn micro_size(&self, id: NodeId, n: usize) -> usize {
        let (dp, mb) = self.exec.placement(id).map_or((1, 1), |p| {
            (p.dp.max(1) as usize, p.microbatches.max(1) as usize)
        });
        n.div_ceil(dp).div_ceil(mb).max(1)
    }

    /// Runs inference call `id` (a `logprobs`, `values` or `score` node) on a rollout's
    /// sequences as planned: each data-parallel replica of its mesh on its block of the
    /// sequences, in the plan's micro-batches. On one process that is the call's value; on
    /// several, this rank's rows, which every rank gathers when a later node first reads them
    /// (`Executor::gather_pending`, all the calls it reads in one exchange) — so that calls placed on disjoint ranks run at the same
    /// time, as the plan has them, instead of each waiting for the other's results.
    pub(super) fn infer_call(
        &mut self,
        id: NodeId,
        op: &Op,
        model: u32,
        seqs: &[Rollout],
        temperature: f64,
    ) -> Result<Inferred> {
        let micro = self.micro_size(id, seqs.len());
        if self.comm.is_single() {
            return Ok(Inferred::Value(self.infer(
                op,
                model,
                seqs,
                temperature,
                micro,
            )?));
        }
        let p = *self
            .exec
            .placement(id)
            .ok_or_else(|| Error::invalid("plan", format!("{id} has no placement")))?;
        if p.pp > 1 {
            return Ok(Inferred::Rows(self.infer_pipelined(
                id,
                op,
                model,
                seqs,
                temperature,
                micro,
                &p,
            )?));
        }
        let mut rows: Vec<Option<PerSampleOut>> = vec![None; seqs.len()];
        if let (Some(c), Some(share)) = (p.coords(self.comm.rank as u64), self.share_of(id)?) {
            let block = comm::sample_block(seqs.len(), p.dp.max(1) as usize, c.dp as usize);
            let opts = InferOptions {
                micro_batch: micro,
                temperature: temperature as f32,
            };
            // Every tensor rank of the replica computes (their layers talk); the first one's
            // results are gathered.
            let out = infer_per_sample(
                self.slots[model as usize].copy(share)?,
                op,
                &seqs[block.clone()],
                &opts,
            )?;
            if share.leads(self.comm.rank) {
                for (i, o) in block.zip(out) {
                    rows[i] = Some(o);
                }
            }
        }
        Ok(Inferred::Rows(rows))
    }

    /// An inference call through pipeline stages: each replica's lane of stages runs its block
    /// of the sequences, micro-batch by micro-batch, forward through the stages
    /// (`Pipeline::forward_all`), and its last stage computes the call's numbers from the final
    /// hidden states. Returns this rank's rows (gathered later, as for [`Executor::infer_call`]).
    #[allow(clippy::too_many_arguments)]
    fn infer_pipelined(
        &mut self,
        id: NodeId,
        op: &Op,
        model: u32,
        seqs: &[Rollout],
        temperature: f64,
        micro: usize,
        p: &braid_ir::exec_plan::Placement,
    ) -> Result<Vec<Option<PerSampleOut>>> {
        let rank = self.comm.rank;
        let mut rows: Vec<Option<PerSampleOut>> = vec![None; seqs.len()];
        if let (Some(c), Some(share)) = (p.coords(rank as u64), self.share_of(id)?) {
            let block = comm::sample_block(seqs.len(), p.dp.max(1) as usize, c.dp as usize);
            let part = &seqs[block.clone()];
            let m = self.slots[model as usize].copy(share)?;
            let pipe = self.infer_pipes.get_mut(&id).ok_or_else(|| {
                Error::invalid("plan", format!("{id}: rank {rank} has no pipeline stage"))
            })?;
            let opts = InferOptions {
                micro_batch: micro.max(1),
                temperature: temperature as f32,
            };
            let micro_batches: Vec<crate::models::pipeline::MicroBatch> = part
                .chunks(opts.micro_batch)
                .map(|chunk| {
                    let refs: Vec<&Rollout> = chunk.iter().collect();
                    let (ids, mask) = infer::pad_batch(&refs, 0, m.device());
                    crate::models::pipeline::MicroBatch { ids, mask }
                })
                .collect();
            if let Some(hidden) = pipe.forward_all(m, &micro_batches)? {
                let mut it = hidden.into_iter();
                let mut next = |_: &[&Rollout]| {
                    it.next().ok_or_else(|| {
                        Error::invalid("pipeline", "fewer hidden states than micro-batches")
                    })
                };
                let out = infer_per_sample_with(m, op, part, &opts, &mut next)?;
                if share.leads(rank) {
                    for (i, o) in block.zip(out) {
                        rows[i] = Some(o);
                    }
                }
            }
        }
        Ok(rows)
    }

    /// The sequences inference call `id` on `model` reads from a whole rollout (see
    /// `tokens::sequences`).
    pub(super) fn sequences_of(
        &self,
        id: NodeId,
        model: u32,
        r: &RolloutData,
    ) -> Result<Vec<Rollout>> {
        let tok = &self.slots[model as usize].tokenizer;
        sequences(
            self.retokenize.contains(&id),
            tok,
            &r.records,
            r.samples
                .iter()
                .map(|s| (s.prompt_index, s.text.as_str(), &s.rollout)),
        )
    }

    /// Runs a `logprobs`, `values` or `score` node on sequences, `micro` per forward pass.
    pub(super) fn infer(
        &self,
        op: &Op,
        model: u32,
        seqs: &[Rollout],
        temperature: f64,
        micro: usize,
    ) -> Result<Val> {
        let slot = &self.slots[model as usize];
        let opts = InferOptions {
            micro_batch: micro.max(1),
            temperature: temperature as f32,
        };
        Ok(collect_rows(
            op,
            infer_per_sample(slot.whole()?, op, seqs, &opts)?,
        ))
    }
}

/// What an inference call leaves on this rank (see [`Executor::infer_call`]).
pub(super) enum Inferred {
    /// The call's whole value (one process).
    Value(Val),
    /// This rank's rows (`None` for the rows other replicas compute), to be gathered.
    Rows(Vec<Option<PerSampleOut>>),
}

pub(super) fn infer_per_sample(
    model: &Model,
    op: &Op,
    seqs: &[Rollout],
    opts: &InferOptions,
) -> Result<Vec<PerSampleOut>> {
    let mut forward = |batch: &[&Rollout]| {
        let (ids, mask) = infer::pad_batch(batch, 0, model.device());
        model.hidden_states(&ids, Some(&mask))
    };
    infer_per_sample_with(model, op, seqs, opts, &mut forward)
}

/// [`infer_per_sample`] with each micro-batch's final hidden states from `hidden`.
pub(super) fn infer_per_sample_with(
    model: &Model,
    op: &Op,
    seqs: &[Rollout],
    opts: &InferOptions,
    hidden: &mut infer::HiddenOf<'_>,
) -> Result<Vec<PerSampleOut>> {
    Ok(match op {
        Op::Logprobs { .. } => infer::logprobs_with(model, seqs, opts, hidden)?
            .into_iter()
            .map(PerSampleOut::Tokens)
            .collect(),
        Op::Values { .. } => infer::values_with(model, seqs, opts, hidden)?
            .into_iter()
            .map(PerSampleOut::Tokens)
            .collect(),
        Op::Score { .. } => infer::score_with(model, seqs, opts, hidden)?
            .into_iter()
            .map(PerSampleOut::Scalar)
            .collect(),
        other => {
            return Err(Error::invalid(
                "plan",
                format!("`{}` is not an inference call", other.name()),
            ));
        }
    })
}

pub(super) fn run_kernel(
    k: &CompiledKernel,
    args: &[Operand],
    inputs: &[NodeId],
    vals: &BTreeMap<NodeId, Val>,
) -> Result<Val> {
    let r = rollout_of(vals, inputs.first())?;
    let lengths = r.lengths();
    let groups: Vec<i64> = r.samples.iter().map(|s| s.prompt_index as i64).collect();
    let texts: Vec<SampleText> = r
        .samples
        .iter()
        .map(|s| {
            let rec = r.records.get(s.prompt_index);
            SampleText {
                prompt: rec.map(|x| x.prompt.clone()).unwrap_or_default(),
                completion: s.text.clone(),
                answer: rec.map(|x| x.answer.clone()).unwrap_or_default(),
                // Only the fields the plan's kernels read were kept when the data was loaded.
                fields: rec.map(|x| x.fields.clone()).unwrap_or_default(),
            }
        })
        .collect();
    let kernel = k.kernel();
    let mut kargs: Vec<Arg<'_>> = Vec::with_capacity(args.len());
    for (i, a) in args.iter().enumerate() {
        let kind = kernel.params.get(i).copied();
        kargs.push(match (a, kind) {
            (_, Some(ParamKind::Sample)) => Arg::Sample,
            (Operand::Const(c), Some(ParamKind::Scalar(t))) => match (c, t) {
                (Const::Int(x), ScalarTy::Int) => Arg::Int(*x),
                (Const::Bool(x), ScalarTy::Bool) => Arg::Bool(*x),
                (c, ScalarTy::Float) => Arg::Float(c.as_f64().unwrap_or(0.0)),
                (c, _) => {
                    return Err(Error::invalid(
                        "plan",
                        format!("constant {c} does not fit kernel parameter {i}"),
                    ));
                }
            },
            (Operand::Input(p), _) => match inputs.get(*p as usize).and_then(|n| vals.get(n)) {
                Some(Val::PerToken(t)) => Arg::PerToken(Ragged {
                    values: &t.values,
                    offsets: &t.offsets,
                }),
                Some(Val::PerSample(s)) => Arg::PerSample(s),
                Some(Val::Rollout(_)) => Arg::Sample,
                _ => {
                    return Err(Error::invalid(
                        "plan",
                        format!("kernel operand ${p} has no value"),
                    ));
                }
            },
            (Operand::Const(c), _) => {
                return Err(Error::invalid(
                    "plan",
                    format!("constant {c} passed to a non-scalar kernel parameter"),
                ));
            }
        });
    }
    let batch = Batch {
        n_samples: r.samples.len(),
        lengths: Some(&lengths),
        groups: Some(&groups),
        texts: Some(&texts),
    };
    let out = k
        .run(&batch, &kargs)
        .map_err(|e| Error::invalid(format!("fn `{}`", kernel.name), e.to_string()))?;
    Ok(match out {
        Output::PerSample(v) => Val::PerSample(v),
        Output::PerToken { values, offsets } => Val::PerToken(Tokens { values, offsets }),
    })
}

/// A value of an element-wise operation: per sample `i`, token `t`.
pub(super) enum Elem<'a> {
    C(f64),
    S(&'a [f64]),
    T(&'a Tokens),
}

impl Elem<'_> {
    pub(super) fn at(&self, i: usize, t: usize) -> f64 {
        match self {
            Elem::C(c) => *c,
            Elem::S(s) => s.get(i).copied().unwrap_or(0.0),
            Elem::T(tk) => tk.row(i).get(t).copied().unwrap_or(0.0),
        }
    }
}

pub(super) fn elem<'a>(
    a: &Operand,
    inputs: &[NodeId],
    vals: &'a BTreeMap<NodeId, Val>,
) -> Result<Elem<'a>> {
    Ok(match a {
        Operand::Const(c) => Elem::C(
            c.as_f64()
                .ok_or_else(|| Error::invalid("plan", format!("{c} is not a number")))?,
        ),
        Operand::Input(p) => match inputs.get(*p as usize).and_then(|n| vals.get(n)) {
            Some(Val::PerSample(s)) => Elem::S(s),
            Some(Val::PerToken(t)) => Elem::T(t),
            _ => return Err(Error::invalid("plan", format!("operand ${p} has no value"))),
        },
    })
}

pub(super) fn arith(
    op: ArithOp,
    args: &[Operand],
    inputs: &[NodeId],
    vals: &BTreeMap<NodeId, Val>,
) -> Result<Val> {
    let r = rollout_of(vals, inputs.first())?;
    let es: Vec<Elem<'_>> = args
        .iter()
        .map(|a| elem(a, inputs, vals))
        .collect::<Result<_>>()?;
    let f = |i: usize, t: usize| -> f64 {
        let a = es[0].at(i, t);
        let b = es.get(1).map_or(0.0, |e| e.at(i, t));
        match op {
            ArithOp::Add => a + b,
            ArithOp::Sub => a - b,
            ArithOp::Mul => a * b,
            ArithOp::Div => a / b,
            ArithOp::Neg => -a,
        }
    };
    let n = r.samples.len();
    if es.iter().any(|e| matches!(e, Elem::T(_))) {
        let mut values = Vec::new();
        let mut offsets = vec![0];
        for (i, len) in r.lengths().into_iter().enumerate() {
            for t in 0..len {
                values.push(f(i, t));
            }
            offsets.push(values.len());
        }
        Ok(Val::PerToken(Tokens { values, offsets }))
    } else {
        Ok(Val::PerSample((0..n).map(|i| f(i, 0)).collect()))
    }
}

pub(super) fn by_prompt(inputs: &[NodeId], vals: &BTreeMap<NodeId, Val>) -> Result<Val> {
    let like = rollout_of(vals, inputs.first())?;
    let from = rollout_of(vals, inputs.get(2))?;
    let Some(Val::PerSample(v)) = inputs.get(1).and_then(|n| vals.get(n)) else {
        return Err(Error::invalid("plan", "by_prompt needs a per-sample value"));
    };
    let mut first_of: BTreeMap<usize, f64> = BTreeMap::new();
    for (i, s) in from.samples.iter().enumerate() {
        first_of
            .entry(s.prompt_index)
            .or_insert(v.get(i).copied().unwrap_or(0.0));
    }
    let mut out = Vec::with_capacity(like.samples.len());
    for s in &like.samples {
        out.push(first_of.get(&s.prompt_index).copied().ok_or_else(|| {
            Error::invalid(
                "by_prompt",
                format!(
                    "prompt {} has no sample in the other rollout",
                    s.prompt_index
                ),
            )
        })?);
    }
    Ok(Val::PerSample(out))
}
