//! Streaming generation (inter-stage fusion on one machine): the engine generates on one
//! thread while the inference calls that read the rollout run on micro-batches of finished
//! samples on this one. On a GPU the two threads also queue their kernels on different CUDA
//! streams — generation on the default stream, streamed inference on one of c10's pool — so
//! that the device runs them concurrently instead of one after the other (c10's current stream
//! is per thread, so the generation thread is not affected).

use super::*;

impl<'p> Executor<'p> {
    /// Generates a rollout; the nodes that read it directly run on micro-batches of finished
    /// samples in this thread while generation continues in another.
    pub(super) fn generate(
        &mut self,
        id: NodeId,
        inputs: &[NodeId],
        vals: &BTreeMap<NodeId, Val>,
        seed: u64,
    ) -> Result<Generated> {
        let Some(Op::Generate { model, params }) = self.plan.graph.node(id).map(|n| &n.op) else {
            return Err(Error::invalid(
                "plan",
                format!("{id} is not a generate node"),
            ));
        };
        let model = *model as usize;
        let Some(Val::Prompts {
            records,
            chat_template,
        }) = inputs.first().and_then(|n| vals.get(n))
        else {
            return Err(Error::invalid("plan", format!("{id}: no prompts")));
        };
        let tokenizer = &self.slots[model].tokenizer;
        let mut prompt_ids = Vec::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            let ids = if *chat_template {
                let text = tokenizer.apply_chat_template(
                    &[ChatMessage {
                        role: "user".into(),
                        content: r.prompt.clone(),
                    }],
                    true,
                )?;
                tokenizer.encode(&text, false)?
            } else {
                tokenizer.encode(&r.prompt, true)?
            };
            if ids.is_empty() {
                return Err(Error::invalid(
                    format!("prompt {i}"),
                    format!("`{}` encodes to no tokens", r.prompt),
                ));
            }
            prompt_ids.push(ids);
        }
        let sampling = SamplingParams {
            max_new_tokens: params.max_new_tokens.max(1) as usize,
            greedy: params.greedy,
            temperature: params.temperature as f32,
            top_k: params.top_k.max(0) as usize,
            top_p: params.top_p as f32,
            seed,
            n: params.n.max(1) as usize,
            stop: Vec::new(),
            stop_at_eos: true,
        };
        let temperature = f64::from(sampling.logprob_temperature());
        // The plan's streamed consumers, each with the finished samples it takes per pass.
        let consumers: Vec<(NodeId, usize)> = self
            .exec
            .streamed(id)
            .into_iter()
            .map(|(c, chunk)| (c, chunk.max(1) as usize))
            .collect();
        let total = prompt_ids.len() * sampling.n;
        let threads = self.options.threads;
        let mut stats = GenStats::default();
        let mut samples: Vec<Option<(Sample, Rollout)>> = vec![None; total];
        // Per consumer: per-sample results, filled as micro-batches finish.
        let mut partial: BTreeMap<NodeId, Vec<Option<PerSampleOut>>> = consumers
            .iter()
            .map(|(c, _)| (*c, vec![None; total]))
            .collect();
        let n = sampling.n;
        let engine = EngineOptions {
            speculate: SpeculateMode::from_plan(&self.exec.speculation(id), &self.options.base_dir),
            ..EngineOptions::default()
        };
        // Split borrows: generation gets the replica (or the model when nothing streams).
        let mut gen_model: Option<&mut Model> = None;
        let mut tok: Option<&Tokenizer> = None;
        let mut others: Vec<(usize, &Model)> = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            let Slot {
                model: m,
                replica,
                tokenizer,
                ..
            } = s;
            if i == model {
                tok = Some(tokenizer);
                // A replica exists only when a streamed consumer runs on this model.
                match (replica, consumers.is_empty()) {
                    (Some(r), false) => {
                        gen_model = Some(r);
                        others.push((i, m));
                    }
                    _ => gen_model = Some(m),
                }
            } else {
                others.push((i, m));
            }
        }
        let (Some(gen_model), Some(tok)) = (gen_model, tok) else {
            return Err(Error::invalid("plan", "no model to generate with"));
        };
        let plan = self.plan;
        // Streamed inference's own CUDA stream, made current on this thread for the streaming
        // window (its guard waits for the stream's work when dropped).
        let infer_stream = match self.options.device {
            Device::Cuda(i) if !consumers.is_empty() => Some(crate::cuda::Stream::from_pool(i)?),
            _ => None,
        };
        let t_gen = Instant::now();
        let (tx, rx) = mpsc::channel::<Result<Sample>>();
        let result: Result<()> = std::thread::scope(|scope| {
            let prompts = prompt_ids.clone();
            let sampling = sampling.clone();
            let handle = scope.spawn(move || -> f64 {
                crate::device::set_cpu_threads(threads);
                let model: &Model = gen_model;
                match generate_stream(model, tok, prompts, sampling, engine) {
                    Ok(stream) => {
                        for item in stream {
                            if tx.send(item).is_err() {
                                break;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
                t_gen.elapsed().as_secs_f64()
            });
            // Per consumer, the first sample of its next micro-batch. Micro-batches are runs of
            // consecutive samples of the rollout, each run as soon as all of its samples have
            // finished: the same micro-batches the call runs without streaming, so streaming
            // changes when it computes, never what (whatever the threads' timing).
            let mut next: Vec<usize> = vec![0; consumers.len()];
            let mut finished = vec![false; total];
            let mut outcome: Result<()> = Ok(());
            let stream_guard = match &infer_stream {
                Some(s) => Some(s.make_current()?),
                None => None,
            };
            let mut run_chunk = |k: usize,
                                 range: std::ops::Range<usize>,
                                 samples: &Vec<Option<(Sample, Rollout)>>,
                                 stats: &mut GenStats|
             -> Result<()> {
                if range.is_empty() {
                    return Ok(());
                }
                let (c, chunk) = consumers[k];
                let t0 = Instant::now();
                let seqs: Vec<Rollout> = range
                    .clone()
                    .filter_map(|i| samples[i].as_ref().map(|(_, r)| r.clone()))
                    .collect();
                let Some(node) = plan.graph.node(c) else {
                    return Err(Error::invalid("plan", format!("{c} is not a node")));
                };
                let Some(m) = node.op.model() else {
                    return Err(Error::invalid("plan", format!("{c} runs no model")));
                };
                let Some((_, mm)) = others.iter().find(|(i, _)| *i == m as usize) else {
                    return Err(Error::invalid("plan", format!("{c}: model busy")));
                };
                let opts = InferOptions {
                    micro_batch: chunk,
                    temperature: temperature as f32,
                };
                let out = infer_per_sample(mm, &node.op, &seqs, &opts)?;
                let dst = partial
                    .get_mut(&c)
                    .ok_or_else(|| Error::invalid("plan", format!("{c}: no result buffer")))?;
                for (i, o) in range.zip(out) {
                    dst[i] = Some(o);
                }
                let start = t0.duration_since(t_gen).as_secs_f64();
                let end = t_gen.elapsed().as_secs_f64();
                stats.infer_seconds += end - start;
                stats.chunks.push((start, end));
                Ok(())
            };
            'receive: for item in rx.iter() {
                let sample = match item {
                    Ok(s) => s,
                    Err(e) => {
                        outcome = Err(e);
                        break;
                    }
                };
                let slot = sample.prompt_index * n + sample.sample_index;
                let r = Rollout::from_sample(&prompt_ids[sample.prompt_index], &sample);
                if slot >= samples.len() {
                    continue;
                }
                samples[slot] = Some((sample, r));
                finished[slot] = true;
                for k in 0..consumers.len() {
                    let chunk = consumers[k].1;
                    loop {
                        let range = next[k]..(next[k] + chunk).min(total);
                        if range.is_empty() || !finished[range.clone()].iter().all(|f| *f) {
                            break;
                        }
                        next[k] = range.end;
                        if let Err(e) = run_chunk(k, range, &samples, &mut stats) {
                            outcome = Err(e);
                            break 'receive;
                        }
                    }
                }
            }
            drop(rx);
            drop(stream_guard);
            let gen_seconds = handle.join().unwrap_or(0.0);
            stats.gen_seconds = gen_seconds;
            outcome?;
            // When every sample has finished, every micro-batch has run; a rollout that lost
            // samples is reported below.
            // Inference is hidden under generation only where a chunk's interval overlaps the
            // generation thread's (which ends when it has handed over the last sample).
            stats.hidden_seconds = stats
                .chunks
                .iter()
                .map(|(a, b)| (b.min(gen_seconds) - a).max(0.0))
                .sum();
            Ok(())
        });
        result?;
        let mut out_samples = Vec::with_capacity(total);
        for (i, s) in samples.into_iter().enumerate() {
            let Some((sample, rollout)) = s else {
                return Err(Error::invalid(
                    "generation",
                    format!("sample {i} of the rollout never finished"),
                ));
            };
            out_samples.push(GenSample {
                prompt_index: sample.prompt_index,
                rollout,
                text: sample.text,
            });
        }
        let rollout = Arc::new(RolloutData {
            samples: out_samples,
            records: records.clone(),
            max_new_tokens: params.max_new_tokens,
            temperature,
        });
        let mut streamed = Vec::new();
        for (c, rows) in partial {
            let rows: Vec<PerSampleOut> = rows.into_iter().flatten().collect();
            if rows.len() != total {
                return Err(Error::invalid(
                    "plan",
                    format!("{c}: missing streamed results"),
                ));
            }
            let Some(node) = self.plan.graph.node(c) else {
                continue;
            };
            streamed.push((c, collect_rows(&node.op, rows)));
        }
        Ok((rollout, streamed, stats))
    }
}

/// A rollout, the streamed consumers' results, and timings.
pub(super) type Generated = (Arc<RolloutData>, Vec<(NodeId, Val)>, GenStats);

#[derive(Debug, Default)]
pub(super) struct GenStats {
    pub(super) gen_seconds: f64,
    pub(super) infer_seconds: f64,
    /// Inference time spent while generation was still running.
    pub(super) hidden_seconds: f64,
    /// Each streamed chunk's (start, end), in seconds from the start of generation.
    pub(super) chunks: Vec<(f64, f64)>,
}

impl GenStats {
    pub(super) fn hidden_share(&self) -> f64 {
        if self.infer_seconds <= 0.0 {
            0.0
        } else {
            self.hidden_seconds / self.infer_seconds
        }
    }
}
