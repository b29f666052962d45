//! Streaming generation (inter-stage fusion): the engine generates this rank's block of the
//! prompts on one thread while the inference calls that read the rollout run on micro-batches
//! of finished samples on this one. Samples a consumer on another rank needs are sent to it as
//! they finish (one thread per peer, each with a group of its own), and samples this rank's
//! consumers need from other ranks arrive the same way (RLHFuse's sample-level inter-stage
//! fusion, across processes). At the end every rank gathers the whole rollout and every
//! streamed result.
//!
//! On a GPU the streamed inference on this thread queues its kernels on a CUDA stream of its
//! own (one of c10's pool), while generation uses the default stream, so that the device runs
//! them concurrently instead of one after the other (c10's current stream is per thread, so
//! the other threads are not affected).

use super::*;
use crate::dist::ProcessGroup;
use braid_ir::exec_plan::Placement;
use comm::{prompt_block, replica_tp_ranks, sample_block, sample_source};
use migrate::{Tail, TailGroups, TailStats};
use std::time::Duration;

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
            let ids = tokens::prompt_ids(tokenizer, r, *chat_template)?;
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
        let n = sampling.n;
        let prompts = prompt_ids.len();
        let total = prompts * n;
        let rank = self.comm.rank;
        let gp = *self
            .exec
            .placement(id)
            .ok_or_else(|| Error::invalid("plan", format!("{id} has no placement")))?;
        // This rank's share of the generation: a block of the prompts, when it is one of the
        // generation's data-parallel replicas.
        let mine = gp
            .coords(rank as u64)
            .map(|c| prompt_block(prompts, gp.dp as usize, c.dp as usize))
            .unwrap_or(0..0);
        // The plan's streamed consumers with a replica on this rank: the block of samples it
        // takes and the samples per forward pass.
        let mut consumers: Vec<(NodeId, usize, std::ops::Range<usize>)> = Vec::new();
        // For each other rank, the samples this one generates that a consumer there needs.
        let mut dests: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        // For each other rank, the samples it generates that a consumer here needs.
        let mut sources: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (c, chunk) in self.streamed(id) {
            let Some(cp) = self.exec.placement(c) else {
                continue;
            };
            let dp = cp.dp.max(1) as usize;
            for k in 0..dp {
                let block = sample_block(total, dp, k);
                // Every tensor rank of the consumer's replica reads the samples.
                for at in replica_tp_ranks(cp, k) {
                    for s in block.clone() {
                        let src = sample_source(&gp, prompts, n, s, at);
                        if src == rank && at != rank {
                            dests.entry(at).or_default().push(s);
                        }
                        if at == rank && src != rank {
                            sources.entry(src).or_default().push(s);
                        }
                    }
                    if at == rank {
                        consumers.push((c, chunk.max(1) as usize, block.clone()));
                    }
                }
            }
        }
        // The shares the generation and each consumer here run on.
        let gen_share = self.share_of(id)?;
        let mut consumer_shares = Vec::new();
        for (c, _, _) in &consumers {
            consumer_shares.push(self.share_of(*c)?.unwrap_or(Share::WHOLE));
        }
        // Tensor-parallel consumers run their micro-batches in one order on every rank of their
        // group (their layers' collectives must match): by the last sample they read, then
        // the consumer, each once all its samples have arrived.
        let ordered = consumer_shares.iter().any(|s| s.tp > 1);
        let mut queue: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        if ordered {
            for (k, (_, chunk, block)) in consumers.iter().enumerate() {
                let mut a = block.start;
                while a < block.end {
                    let b = (a + chunk).min(block.end);
                    queue.push((k, a..b));
                    a = b;
                }
            }
            queue.sort_by_key(|(k, r)| (r.end, *k));
        }
        for v in dests.values_mut().chain(sources.values_mut()) {
            v.sort_unstable();
            v.dedup();
        }
        let threads = self.options.threads;
        let mut stats = GenStats::default();
        let mut samples: Vec<Option<(Sample, Rollout)>> = vec![None; total];
        // Per consumer here: per-sample results, filled as micro-batches finish.
        let mut partial: BTreeMap<NodeId, Vec<Option<PerSampleOut>>> = consumers
            .iter()
            .map(|(c, _, _)| (*c, vec![None; total]))
            .collect();
        let engine = EngineOptions {
            // Imposed lengths mask end-of-sequence tokens, which draft verification does not:
            // the planner's speculation is off under them (`braid run` says so, and refuses a
            // pinned one).
            speculate: if self.options.gen_lengths.is_some() {
                SpeculateMode::Off
            } else {
                SpeculateMode::from_plan(&self.exec.speculation(id), &self.options.base_dir)
            },
            first_prompt: mine.start,
            lengths: self
                .options
                .gen_lengths
                .clone()
                .map(|dist| TargetLengths { dist, seed }),
            ..EngineOptions::default()
        };
        let mut tail = self.tail(id, &gp, prompts, total)?;
        // The groups the samples travel on, one per direction and peer, each for one thread.
        let mut send_groups = Vec::new();
        for &dst in dests.keys() {
            send_groups.push((dst, self.comm.take_stream(id, rank, dst)?));
        }
        let mut recv_groups = Vec::new();
        for &src in sources.keys() {
            recv_groups.push((src, self.comm.take_stream(id, src, rank)?));
        }
        let streams_here = !consumers.is_empty();
        if streams_here {
            // A step without streaming may have left the replica behind its share's copy.
            self.slots[model].refresh_stale_replica()?;
        }
        // Split borrows: generation gets its share's copy, or the replica of it when a streamed
        // consumer here runs on that copy; the consumers get the other copies.
        let mut gen_model: Option<&mut Model> = None;
        let mut tok: Option<&Tokenizer> = None;
        let mut others: Vec<(usize, Share, &Model, &Tokenizer)> = Vec::new();
        let retokenize = &self.retokenize;
        for (i, s) in self.slots.iter_mut().enumerate() {
            let Slot {
                model: m,
                home,
                views,
                replica,
                replica_share,
                tokenizer,
                ..
            } = s;
            if i == model {
                tok = Some(tokenizer);
            }
            let mut copies: Vec<(Share, &mut Model)> = m
                .as_mut()
                .map(|m| (*home, m))
                .into_iter()
                .chain(views.iter_mut().map(|(s, m)| (*s, m)))
                .collect();
            if i == model
                && !mine.is_empty()
                && let Some(gs) = gen_share
            {
                match replica.as_mut() {
                    Some(r) if *replica_share == gs && streams_here => gen_model = Some(r),
                    _ => {
                        if let Some(at) = copies.iter().position(|(s, _)| *s == gs) {
                            gen_model = Some(copies.remove(at).1);
                        }
                    }
                }
            }
            for (sh, m) in copies {
                others.push((i, sh, m, tokenizer));
            }
        }
        let Some(tok) = tok else {
            return Err(Error::invalid("plan", format!("{id}: no model {model}")));
        };
        if gen_model.as_ref().is_some_and(|m| m.is_released()) {
            return Err(Error::invalid(
                "plan",
                format!("{id}: its model's copy was released and no reshard refilled it"),
            ));
        }
        if !mine.is_empty() && gen_model.is_none() {
            return Err(Error::invalid(
                "plan",
                format!("{id}: model {model} is not on rank {rank}"),
            ));
        }
        let plan = self.plan;
        // Streamed inference's own CUDA stream, current on this thread for the streaming window
        // (the guard waits for the stream's work when it is dropped, after the window).
        let stream_guard = match self.options.device {
            Device::Cuda(i) if !consumers.is_empty() => {
                Some(crate::cuda::Stream::from_pool(i)?.make_current()?)
            }
            _ => None,
        };
        let t_gen = Instant::now();
        // Every finished sample reaches this thread by one channel: from the generation
        // thread for this rank's own, from a receiving thread per peer for the others'.
        let (tx, rx) = mpsc::channel::<Result<(usize, Sample)>>();
        // Samples this rank generates that other ranks need go to one sending thread per peer.
        let mut out_tx: BTreeMap<usize, mpsc::Sender<(usize, Arc<Sample>)>> = BTreeMap::new();
        let mut tail_groups = TailGroups::default();
        let result: Result<(Peers, Peers)> = std::thread::scope(|scope| {
            let mut senders = Vec::new();
            for (dst, group) in send_groups {
                let order = dests.get(&dst).cloned().unwrap_or_default();
                let (stx, srx) = mpsc::channel::<(usize, Arc<Sample>)>();
                out_tx.insert(dst, stx);
                senders.push(scope.spawn(move || -> Result<(usize, ProcessGroup)> {
                    send_samples(&group, &order, srx)?;
                    Ok((dst, group))
                }));
            }
            let mut receivers = Vec::new();
            for (src, group) in recv_groups {
                let order = sources.get(&src).cloned().unwrap_or_default();
                let tx = tx.clone();
                receivers.push(scope.spawn(move || -> Result<(usize, ProcessGroup)> {
                    recv_samples(&group, &order, n, prompts, &tx)?;
                    Ok((src, group))
                }));
            }
            // This rank's own samples that other ranks read go to their sending threads from
            // a thread of their own, the moment the engine hands them over: forwarded from
            // this thread, they would wait for the micro-batch it is computing, and the peer
            // with them.
            let gen_tx = if out_tx.is_empty() {
                tx.clone()
            } else {
                let (gtx, grx) = mpsc::channel::<Result<(usize, Sample)>>();
                let tx = tx.clone();
                let out_tx = std::mem::take(&mut out_tx);
                let (dests, mine) = (&dests, mine.clone());
                scope.spawn(move || {
                    for item in grx {
                        if let Ok((slot, sample)) = &item
                            && mine.contains(&sample.prompt_index)
                        {
                            let shared = Arc::new(sample.clone());
                            for (dst, stx) in &out_tx {
                                if dests
                                    .get(dst)
                                    .is_some_and(|v| v.binary_search(slot).is_ok())
                                {
                                    let _ = stx.send((*slot, shared.clone()));
                                }
                            }
                        }
                        if tx.send(item).is_err() {
                            // This thread stopped receiving (the step failed): stop forwarding.
                            break;
                        }
                    }
                });
                gtx
            };
            let generator = gen_model.map(|gm| {
                let tx = gen_tx;
                let prompts_part = prompt_ids[mine.clone()].to_vec();
                let sampling = sampling.clone();
                let tail = tail.take();
                scope.spawn(move || -> (f64, TailStats, TailGroups) {
                    crate::device::set_cpu_threads(threads);
                    let m: &Model = gm;
                    let out = generate_stream(m, tok, prompts_part, sampling, engine)
                        .and_then(|g| migrate::run(g, tail, n, &tx, t_gen));
                    let (ts, groups) = out.unwrap_or_else(|e| {
                        let _ = tx.send(Err(e));
                        (TailStats::default(), TailGroups::default())
                    });
                    (t_gen.elapsed().as_secs_f64(), ts, groups)
                })
            });
            drop(tx);
            // Per consumer here, the first sample of its next micro-batch. Micro-batches
            // are runs of consecutive samples of its block, each run as soon as all of its
            // samples have finished: the same micro-batches the call runs without
            // streaming, so streaming changes when it computes, never what (whatever the
            // threads' timing).
            let mut next: Vec<usize> = consumers.iter().map(|c| c.2.start).collect();
            let mut finished = vec![false; total];
            let mut q = 0usize;
            let mut outcome: Result<()> = Ok(());
            let mut run_chunk = |k: usize,
                                 range: std::ops::Range<usize>,
                                 samples: &Vec<Option<(Sample, Rollout)>>,
                                 stats: &mut GenStats|
             -> Result<()> {
                if range.is_empty() {
                    return Ok(());
                }
                let (c, chunk, _) = consumers[k].clone();
                let t0 = Instant::now();
                let Some(node) = plan.graph.node(c) else {
                    return Err(Error::invalid("plan", format!("{c} is not a node")));
                };
                let Some(m) = node.op.model() else {
                    return Err(Error::invalid("plan", format!("{c} runs no model")));
                };
                let share = consumer_shares[k];
                let Some((_, _, mm, mtok)) = others
                    .iter()
                    .find(|(i, sh, _, _)| *i == m as usize && *sh == share)
                else {
                    return Err(Error::invalid("plan", format!("{c}: model busy")));
                };
                if mm.is_released() {
                    return Err(Error::invalid(
                        "plan",
                        format!("{c}: its model's copy was released and no reshard refilled it"),
                    ));
                }
                let seqs = sequences(
                    retokenize.contains(&c),
                    mtok,
                    records,
                    range.clone().filter_map(|i| {
                        samples[i]
                            .as_ref()
                            .map(|(s, r)| (s.prompt_index, s.text.as_str(), r))
                    }),
                )?;
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
                let (slot, sample) = match item {
                    Ok(s) => s,
                    Err(e) => {
                        outcome = Err(e);
                        break;
                    }
                };
                if slot >= samples.len() {
                    continue;
                }
                let r = Rollout::from_sample(&prompt_ids[sample.prompt_index], &sample);
                samples[slot] = Some((sample, r));
                finished[slot] = true;
                if ordered {
                    while let Some((k, range)) = queue.get(q).cloned() {
                        if !finished[range.clone()].iter().all(|f| *f) {
                            break;
                        }
                        q += 1;
                        if let Err(e) = run_chunk(k, range, &samples, &mut stats) {
                            outcome = Err(e);
                            break 'receive;
                        }
                    }
                    continue;
                }
                for k in 0..consumers.len() {
                    let (chunk, end) = (consumers[k].1, consumers[k].2.end);
                    loop {
                        let range = next[k]..(next[k] + chunk).min(end);
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
            let gen_seconds = match generator {
                Some(h) => {
                    let (secs, ts, groups) = h.join().map_err(|_| {
                        Error::invalid("generation", "the generation thread panicked")
                    })?;
                    stats.tail = ts;
                    tail_groups = groups;
                    secs
                }
                None => 0.0,
            };
            stats.gen_seconds = gen_seconds;
            let mut sent = Vec::new();
            for h in senders {
                let r = h
                    .join()
                    .map_err(|_| Error::invalid("generation", "a sending thread panicked"))?;
                match r {
                    Ok(g) => sent.push(g),
                    Err(e) if outcome.is_ok() => outcome = Err(e),
                    Err(_) => {}
                }
            }
            let mut received = Vec::new();
            for h in receivers {
                let r = h
                    .join()
                    .map_err(|_| Error::invalid("generation", "a receiving thread panicked"))?;
                match r {
                    Ok(g) => received.push(g),
                    Err(e) if outcome.is_ok() => outcome = Err(e),
                    Err(_) => {}
                }
            }
            outcome?;
            // Inference is hidden under generation only where a chunk's interval overlaps
            // the generation thread's (which ends when it has handed over the last sample).
            stats.hidden_seconds = stats
                .chunks
                .iter()
                .map(|(a, b)| (b.min(gen_seconds) - a).max(0.0))
                .sum();
            Ok((sent, received))
        });
        drop(stream_guard);
        if let Some(g) = tail_groups.decider {
            self.comm.put_decider(id, g);
        }
        for (peer, g) in tail_groups.peers {
            self.comm.put_tail(id, rank, peer, g);
        }
        let (sent, received) = result?;
        stats.exchange_start = t_gen.elapsed().as_secs_f64();

        for (dst, g) in sent {
            self.comm.put_stream(id, rank, dst, g);
        }
        for (src, g) in received {
            self.comm.put_stream(id, src, rank, g);
        }
        // Every rank takes the whole rollout, and every streamed result, from the ranks that
        // made them (a tensor-parallel group's first rank speaks for it).
        let leads = gen_share.is_some_and(|s| s.leads(rank));
        let mine_samples: Vec<(usize, Sample)> = samples
            .iter()
            .filter(|_| leads)
            .enumerate()
            .filter_map(|(i, s)| match s {
                Some((sample, _)) if mine.contains(&sample.prompt_index) => {
                    Some((i, sample.clone()))
                }
                _ => None,
            })
            .collect();
        stats.tokens = mine_samples.iter().map(|(_, s)| s.token_ids.len()).sum();
        // The rollout and every streamed call's rows, in one exchange.
        let streamed_calls: Vec<NodeId> = self.streamed(id).into_iter().map(|(c, _)| c).collect();
        let mut mine_rows = Vec::with_capacity(streamed_calls.len());
        for &c in &streamed_calls {
            let mut rows = partial.remove(&c).unwrap_or_else(|| vec![None; total]);
            if !self.share_of(c)?.is_some_and(|s| s.leads(rank)) {
                rows = vec![None; total];
            }
            mine_rows.push(rows);
        }
        let (everyone, gathered) =
            gather_with_rows(&self.comm, Some(encode_samples(&mine_samples)), mine_rows)?;
        for part in everyone {
            for (i, sample) in decode_samples(&part)? {
                if i < total && samples[i].is_none() {
                    let r = Rollout::from_sample(&prompt_ids[sample.prompt_index], &sample);
                    samples[i] = Some((sample, r));
                }
            }
        }
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
            temperature,
        });
        let mut streamed = Vec::new();
        for (c, rows) in streamed_calls.into_iter().zip(gathered) {
            if rows.iter().any(Option::is_none) {
                return Err(Error::invalid(
                    "plan",
                    format!("{c}: missing streamed results"),
                ));
            }
            let Some(node) = self.plan.graph.node(c) else {
                continue;
            };
            streamed.push((
                c,
                collect_rows(&node.op, rows.into_iter().flatten().collect()),
            ));
        }
        Ok((rollout, streamed, stats))
    }

    /// This rank's part in the sample exchange of generation `id` (on `gp`, `prompts` prompts,
    /// `total` samples) this iteration: its tail migrates when the current choice says so
    /// (released replica `r` to kept replica `r mod kept`), and samples are reallocated
    /// before it unless reallocation is off.
    fn tail(
        &mut self,
        id: NodeId,
        gp: &Placement,
        prompts: usize,
        total: usize,
    ) -> Result<Option<Tail>> {
        let Some(state) = self.tails.get(&id).cloned() else {
            return Ok(None);
        };
        let dp = gp.dp.max(1) as usize;
        // Every replica must generate something to take part (a batch of fewer prompts than
        // replicas leaves some idle: those do not exchange samples).
        if dp < 2 || (0..dp).any(|k| prompt_block(prompts, dp, k).is_empty()) {
            return Ok(None);
        }
        let (threshold, kept) = match state.current {
            Some(ch) if (ch.kept as usize) < dp && ch.threshold > 0 => {
                (ch.threshold as usize, (ch.kept as usize).max(1))
            }
            _ => (0, dp),
        };
        // The ranks that run inference streamed under this generation: a replica with one of
        // them does not ask for samples (it is not idle).
        let busy: Vec<usize> = self
            .streamed(id)
            .iter()
            .filter_map(|(c, _)| self.exec.placement(*c))
            .flat_map(|p| p.first as usize..(p.first + p.count) as usize)
            .collect();
        let asks_of = |k: usize| !replica_tp_ranks(gp, k).iter().any(|r| busy.contains(r));
        // Only replicas that keep their samples ask; when none may, nobody looks for requests.
        let realloc = state.realloc.clone().filter(|_| (0..kept).any(asks_of));
        if threshold == 0 && realloc.is_none() {
            return Ok(None);
        }
        let rank = self.comm.rank;
        let Some(c) = gp.coords(rank as u64) else {
            return Ok(None);
        };
        let (me, tp_rank) = (c.dp as usize, c.tp as usize);
        let mut peers = BTreeMap::new();
        for r in (0..dp).filter(|&r| r != me) {
            let pr = replica_tp_ranks(gp, r)[tp_rank];
            peers.insert(r, (pr, self.comm.take_tail(id, rank, pr)?));
        }
        let decider = if gp.tp > 1 {
            Some(self.comm.take_decider(id).ok_or_else(|| {
                Error::invalid(
                    "plan",
                    format!("rank {rank}: no replica group for {id}'s sample exchange"),
                )
            })?)
        } else {
            None
        };
        let asks = asks_of(me);
        self.tail_round += 1;
        Ok(Some(Tail {
            counter: self.comm.counter()?,
            key: format!("braid/tail/{}/{id}", self.tail_round),
            total,
            threshold,
            kv: state.kv,
            me,
            replicas: dp,
            kept,
            tp_rank,
            peers,
            decider,
            realloc,
            asks,
            timeout: self
                .options
                .dist
                .as_ref()
                .map_or(Duration::from_secs(600), |d| d.timeout),
        }))
    }
}

/// Sends the samples `order` names (ascending) to the group's other rank, in that order, as
/// they arrive on `from`. Every sample that is ready when the next one in order arrives goes
/// in the same message (a length, then the samples' bytes): samples finishing together cost
/// two messages, not two per sample, and a message's latency (about half a millisecond on
/// Gloo over loopback) is paid once. Order on both sides is the samples' order, so a send
/// never waits for a receive the peer has not reached yet.
fn send_samples(
    group: &ProcessGroup,
    order: &[usize],
    from: mpsc::Receiver<(usize, Arc<Sample>)>,
) -> Result<()> {
    let peer = 1 - group.rank();
    let mut waiting: BTreeMap<usize, Arc<Sample>> = BTreeMap::new();
    let mut at = 0usize;
    while at < order.len() {
        while !waiting.contains_key(&order[at]) {
            match from.recv() {
                Ok((i, s)) => {
                    waiting.insert(i, s);
                }
                // The step failed elsewhere: stop sending.
                Err(_) => return Ok(()),
            }
        }
        // Whatever else has finished meanwhile joins this message.
        while let Ok((i, s)) = from.try_recv() {
            waiting.insert(i, s);
        }
        let mut batch: Vec<(usize, Sample)> = Vec::new();
        while let Some(s) = order.get(at).and_then(|w| waiting.remove(w)) {
            batch.push((order[at], (*s).clone()));
            at += 1;
        }
        let bytes = encode_samples(&batch);
        group.send(&Tensor::from_slice(&[bytes.len() as i64]), peer, 0)?;
        group.send(&Tensor::from_slice(&bytes), peer, 1)?;
    }
    Ok(())
}

/// Receives the samples `order` names from the group's other rank, in that order (in the
/// messages [`send_samples`] makes), and hands each to `to` exactly as the generating engine
/// produced it.
fn recv_samples(
    group: &ProcessGroup,
    order: &[usize],
    n: usize,
    prompts: usize,
    to: &mpsc::Sender<Result<(usize, Sample)>>,
) -> Result<()> {
    let peer = 1 - group.rank();
    let mut at = 0usize;
    while at < order.len() {
        let mut len = Tensor::zeros([1], (Kind::Int64, Device::Cpu));
        group.recv(&mut len, peer, 0)?;
        let len = len.int64_value(&[0]);
        if len <= 0 {
            return Err(Error::invalid(
                "generation",
                format!("rank {peer} announced a message of {len} bytes of samples"),
            ));
        }
        let mut bytes = Tensor::zeros([len], (Kind::Uint8, Device::Cpu));
        group.recv(&mut bytes, peer, 1)?;
        let bytes: Vec<u8> = Vec::<u8>::try_from(&bytes).map_err(Error::Torch)?;
        let batch = decode_samples(&bytes)?;
        if batch.is_empty() {
            return Err(Error::invalid(
                "generation",
                format!("rank {peer} sent a message without samples"),
            ));
        }
        for (slot, mut sample) in batch {
            if order.get(at) != Some(&slot) {
                return Err(Error::invalid(
                    "generation",
                    format!(
                        "rank {peer} sent sample {slot} where sample {:?} was due",
                        order.get(at)
                    ),
                ));
            }
            at += 1;
            let prompt = slot / n.max(1);
            if prompt >= prompts {
                return Err(Error::invalid(
                    "generation",
                    format!("sample {slot} is not in the batch"),
                ));
            }
            sample.prompt_index = prompt;
            sample.sample_index = slot % n.max(1);
            if to.send(Ok((slot, sample))).is_err() {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Every rank's results of one consumer merged: each rank holds the samples of its replica.
pub(super) fn gather_rows(comm: &Comm, rows: Rows) -> Result<Rows> {
    let (_, mut out) = gather_with_rows(comm, None, vec![rows])?;
    Ok(out.pop().unwrap_or_default())
}

/// One call's results on every sample of a rollout (`None`: not known on this rank yet).
pub(super) type Rows = Vec<Option<PerSampleOut>>;

/// [`gather_rows`] of several calls' rows, with a message of this rank's before them
/// (`first`, e.g. its samples of a rollout), in one exchange among all ranks: every rank's
/// `first` by rank, and each call's rows filled in from every rank's.
pub(super) fn gather_with_rows(
    comm: &Comm,
    first: Option<Vec<u8>>,
    calls: Vec<Rows>,
) -> Result<(Vec<Vec<u8>>, Vec<Rows>)> {
    if comm.is_single() {
        return Ok((first.into_iter().collect(), calls));
    }
    let lead = usize::from(first.is_some());
    let mut parts: Vec<Vec<u8>> = first.into_iter().collect();
    for rows in &calls {
        let mine: Vec<(usize, PerSampleOut)> = rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.clone().map(|r| (i, r)))
            .collect();
        parts.push(encode_rows(&mine));
    }
    let mut out = calls;
    let mut firsts = Vec::new();
    for message in comm.all_gather_bytes(encode_parts(&parts))? {
        let got = decode_parts(&message)?;
        if got.len() != out.len() + lead {
            return Err(Error::invalid(
                "exchange",
                format!(
                    "a peer sent {} messages where {} were expected",
                    got.len(),
                    out.len() + lead
                ),
            ));
        }
        let mut got = got.into_iter();
        if lead == 1 {
            firsts.extend(got.next());
        }
        for (rows, part) in out.iter_mut().zip(got) {
            for (i, r) in decode_rows(&part)? {
                if i < rows.len() && rows[i].is_none() {
                    rows[i] = Some(r);
                }
            }
        }
    }
    Ok((firsts, out))
}

/// Stream groups by peer rank, handed back after their threads end.
type Peers = Vec<(usize, ProcessGroup)>;

/// A rollout, the streamed consumers' results, and timings.
pub(super) type Generated = (Arc<RolloutData>, Vec<(NodeId, Val)>, GenStats);

#[derive(Debug, Default)]
pub(super) struct GenStats {
    pub(super) gen_seconds: f64,
    /// Tokens this rank generated.
    pub(super) tokens: usize,
    pub(super) infer_seconds: f64,
    /// Inference time spent while generation was still running.
    pub(super) hidden_seconds: f64,
    /// Each streamed chunk's (start, end), in seconds from the start of generation.
    pub(super) chunks: Vec<(f64, f64)>,
    /// What long-tail migration did on this rank.
    pub(super) tail: TailStats,
    /// When, in seconds from the start of generation, every thread of the generation had
    /// ended (the last sample sent to, and received from, the other ranks) and the exchange
    /// of the rollout and the streamed results among all ranks began.
    pub(super) exchange_start: f64,
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
