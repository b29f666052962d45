//! Long-tail migration at run time (the second half of RLHFuse's inter-stage fusion): once no
//! more than `R_t` samples of a generation are still decoding anywhere, the replicas the plan
//! releases hand their unfinished samples to the replicas it keeps, and the released ranks'
//! cores go to the streamed inference the plan placed on them.
//!
//! How the ranks agree without a collective: every generating replica adds the samples it
//! finishes to one counter in the run's store (`Store::add`), and reads it back after any step
//! in which it finished samples or holds no more than `R_t` itself (the global count can be at
//! most `R_t` only then: every sample a replica holds is unfinished). A released replica that
//! sees the count at `R_t` or below (or has nothing left) sends its unfinished samples — each
//! with its random stream's state and its tokens so far, its KV cache row or nothing, in which
//! case the receiver prefills the prompt and tokens again — to the kept replica it is paired
//! with, and relays them back as they finish there, so that the rest of the executor sees each
//! sample come from the replica that owns it (the streaming routes, the gathers and the
//! metrics stay as they are). A kept replica that sees the count at `R_t` or below takes the
//! samples of every replica paired with it (those see the same count by their next step), and
//! waits for that moment when it runs out of samples of its own. A migrated sample continues
//! with the same generator state and the same cache, so its text is the one it would have had
//! where it started.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use crate::dist::{ProcessGroup, Store};
use crate::error::{Error, Result};
use crate::generation::engine::{Generation, Migrant, Sample};

use super::values::{finish_code, finish_of};

/// One generation's migration, as this rank takes part in it.
pub(super) struct Tail {
    /// The counter of finished samples (a connection of its own: the generation thread uses
    /// it).
    pub(super) counter: Store,
    pub(super) key: String,
    /// Samples in the generation, over every replica.
    pub(super) total: usize,
    /// Migrate when no more than this many are unfinished.
    pub(super) threshold: usize,
    /// Started samples take their KV cache along (else they are prefilled again).
    pub(super) kv: bool,
    pub(super) role: Role,
    /// This rank.
    pub(super) rank: usize,
    /// Whether giving samples to an idle kept replica before the tail pays.
    pub(super) realloc: Realloc,
}

impl Tail {
    /// The counter of released replica `rank`'s unfinished samples.
    fn load_key(&self, rank: usize) -> String {
        format!("{}/load/{rank}", self.key)
    }

    /// The counter of requests for samples made to released replica `rank`.
    fn ask_key(&self, rank: usize) -> String {
        format!("{}/ask/{rank}", self.key)
    }
}

/// What a message of migrants is: samples given before the tail on request, or a tail.
const GIFT: i64 = 0;
const TAIL: i64 = 1;

/// The cost model's view of sample reallocation (RLHFSpec) for one generation: before the
/// tail, a kept replica that has run out of samples asks the paired replica with the most for
/// some, which gives half of them when its own decode steps over the work expected to remain,
/// against its and the receiver's steps side by side plus the hand-over, say so.
#[derive(Clone, Debug)]
pub(crate) struct Realloc {
    pub(super) cost: braid_cost::cost::CostModel,
    pub(super) shape: braid_cost::cost::ModelShape,
    pub(super) prompt_len: u64,
    /// Lengths drawn from the plan's distribution (at most `max_new_tokens`), ascending: what
    /// remains of a sample with `l` tokens is estimated from those above `l`.
    pub(super) lengths: Vec<u64>,
    pub(super) across_nodes: bool,
}

impl Realloc {
    /// The plan's view for a generation of `model` with `max_new` tokens at most.
    pub(super) fn for_plan(
        exec: &braid_ir::exec_plan::ExecPlan,
        shape: &braid_cost::cost::ModelShape,
        max_new: u64,
        seed: u64,
    ) -> Realloc {
        let mut rng = braid_cost::prng::Rng::new(seed);
        let mut lengths: Vec<u64> = (0..512)
            .map(|_| {
                exec.workload
                    .lengths
                    .sample(&mut rng)
                    .clamp(1, max_new.max(1))
            })
            .collect();
        lengths.sort_unstable();
        Realloc {
            cost: exec.cluster.cost_model(),
            shape: shape.clone(),
            prompt_len: exec.workload.prompt_len,
            lengths,
            across_nodes: exec.cluster.nodes > 1,
        }
    }

    /// Tokens a sample with `l` tokens is expected to generate still.
    fn remaining(&self, l: usize) -> f64 {
        let above: Vec<u64> = self
            .lengths
            .iter()
            .copied()
            .filter(|&x| x as usize > l)
            .collect();
        if above.is_empty() {
            return 1.0;
        }
        above.iter().sum::<u64>() as f64 / above.len() as f64 - l as f64
    }

    /// How many of `pending` unfinished samples (the running ones with `running` tokens each,
    /// the others not started) to give an idle replica: half, when that pays, else none.
    pub(super) fn donation(&self, pending: usize, running: &[usize], kv: bool) -> usize {
        let give = pending / 2;
        if give == 0 {
            return 0;
        }
        let mut lens: Vec<usize> = running.to_vec();
        lens.resize(pending.max(running.len()), 0);
        let steps = lens.iter().map(|&l| self.remaining(l)).sum::<f64>() / lens.len() as f64;
        let context = self.prompt_len + (lens.iter().sum::<usize>() / lens.len().max(1)) as u64;
        let one = braid_cost::cost::Layout {
            dp: 1,
            tp: 1,
            pp: 1,
        };
        let step = |b: usize| {
            self.cost
                .decode_step_time(&self.shape, one, b as u64, context)
        };
        let saved = steps * (step(pending) - step(pending - give).max(step(give)));
        let d = &self.cost.device;
        let (bw, latency) = if self.across_nodes {
            (d.inter_node_bandwidth, d.inter_node_latency)
        } else {
            (d.intra_node_bandwidth, d.intra_node_latency)
        };
        let moving = if kv {
            let bytes =
                (give as u64 * context * self.shape.kv_bytes_per_token(self.cost.dtype_bytes))
                    as f64;
            latency + bytes / (bw * d.network_efficiency).max(1.0)
        } else {
            latency
                + self
                    .cost
                    .prefill_time(&self.shape, one, give as u64, context)
        };
        if saved > moving { give } else { 0 }
    }
}

/// What this rank's replica does when the tail migrates.
pub(super) enum Role {
    /// Keeps its samples and takes those of the replicas paired with it: their ranks and the
    /// groups of two to them.
    Keeps(Vec<(usize, ProcessGroup)>),
    /// Hands its unfinished samples to the replica on this rank (over this group of two),
    /// then relays them back as they finish.
    Releases(usize, Box<ProcessGroup>),
}

/// What migration did on this rank.
#[derive(Clone, Debug, Default)]
pub(super) struct TailStats {
    /// Seconds from the start of generation to the migration (`None`: it did not happen).
    pub(super) at: Option<f64>,
    /// Seconds spent sending or receiving the samples (and building their cache rows).
    pub(super) seconds: f64,
    /// Samples a released replica handed over, and their bytes (KV caches, prompts, tokens
    /// and log-probabilities).
    pub(super) samples: usize,
    pub(super) bytes: usize,
    /// Samples a kept replica took, and their bytes (each counted once over the world).
    pub(super) received: usize,
    pub(super) received_bytes: usize,
    /// Tokens the kept replica had to prefill again (samples moved without their cache).
    pub(super) prefill_tokens: usize,
    /// This rank's replica kept its samples (else it released them).
    pub(super) kept: bool,
    /// Samples a kept replica was given before the tail, a released one gave, and the seconds
    /// those hand-overs took.
    pub(super) reallocated: usize,
    pub(super) given: usize,
    pub(super) realloc_seconds: f64,
}

/// The groups of two a tail used, by peer rank, handed back after the generation.
pub(super) type TailGroups = Vec<(usize, ProcessGroup)>;

/// Runs generation `engine` to the end on this thread, sending each finished sample (numbered
/// `prompt × n + sample`, its prompt index made the batch's) to `tx`, and migrating its tail
/// when `tail` says so. Returns the generation's seconds, what migration did, and the groups.
pub(super) fn run(
    mut engine: Generation<'_>,
    mut tail: Option<Tail>,
    n: usize,
    tx: &mpsc::Sender<Result<(usize, Sample)>>,
    t0: Instant,
) -> Result<(TailStats, TailGroups)> {
    let mut stats = TailStats {
        kept: matches!(tail.as_ref().map(|t| &t.role), Some(Role::Keeps(_))),
        ..TailStats::default()
    };
    // Released: handed over; kept: every paired replica's tail taken.
    let mut migrated = false;
    // Adopted samples by number: the index in `Keeps` of the replica they go back to.
    let mut owners: BTreeMap<usize, usize> = BTreeMap::new();
    let peers = match tail.as_ref().map(|t| &t.role) {
        Some(Role::Keeps(p)) => p.len(),
        _ => 0,
    };
    // Kept: per paired replica, whether its tail arrived (it relays what comes back only
    // after handing its tail over), the finished samples held for it until then, and
    // whether it declined a request.
    let mut tail_in = vec![false; peers];
    let mut held: Vec<Vec<(usize, Sample)>> = (0..peers).map(|_| Vec::new()).collect();
    let mut declined = vec![false; peers];
    // Released: requests answered, and samples given before the tail.
    let mut answered = 0i64;
    let mut given = 0usize;
    if let Some(t) = &tail
        && matches!(t.role, Role::Releases(..))
    {
        t.counter
            .add(&t.load_key(t.rank), engine.pending() as i64)?;
    }
    loop {
        let pending = engine.pending();
        let waiting_for_tail = tail.as_ref().is_some_and(|t| match &t.role {
            Role::Keeps(p) => !migrated && !p.is_empty(),
            Role::Releases(..) => !migrated,
        });
        if pending == 0 && !waiting_for_tail {
            break;
        }
        let done = if pending > 0 {
            engine.step()?
        } else {
            Vec::new()
        };
        let finished = done.len();
        for mut s in done {
            s.prompt_index = engine.batch_index(s.prompt_index);
            let slot = s.prompt_index * n + s.sample_index;
            match (owners.get(&slot), tail.as_ref().map(|t| &t.role)) {
                (Some(&k), Some(Role::Keeps(p))) => {
                    if tail_in[k] {
                        send_sample(&p[k].1, slot, &s)?;
                    } else {
                        held[k].push((slot, s));
                    }
                }
                _ => {
                    if tx.send(Ok((slot, s))).is_err() {
                        // The step failed elsewhere: stop generating.
                        return Ok((stats, give_back(tail)));
                    }
                }
            }
        }
        let Some(t) = tail.as_mut().filter(|_| !migrated) else {
            continue;
        };
        let local = engine.pending();
        // The world's unfinished samples, read when they can be at the threshold.
        let mut global = usize::MAX;
        if finished > 0 || local <= t.threshold {
            let done_so_far = t.counter.add(&t.key, finished as i64)?;
            global = t
                .total
                .saturating_sub(usize::try_from(done_so_far).unwrap_or(0));
        }
        match &t.role {
            Role::Releases(_, g) => {
                if finished > 0 {
                    t.counter.add(&t.load_key(t.rank), -(finished as i64))?;
                }
                if global <= t.threshold || local == 0 {
                    let start = Instant::now();
                    stats.at = Some(start.duration_since(t0).as_secs_f64());
                    let moving = engine.release(t.kv)?;
                    stats.samples = moving.len();
                    stats.bytes += send_migrants(g, &moving, TAIL)?;
                    stats.seconds = start.elapsed().as_secs_f64();
                    migrated = true;
                    // Each comes back once it finishes where it went.
                    for _ in 0..moving.len() + given {
                        let (slot, s) = recv_sample(g, n)?;
                        if tx.send(Ok((slot, s))).is_err() {
                            break;
                        }
                    }
                    continue;
                }
                // The kept replica ran out of samples and asks for some of these.
                let asks = t.counter.add(&t.ask_key(t.rank), 0)?;
                if asks > answered {
                    answered = asks;
                    let start = Instant::now();
                    let d = t.realloc.donation(local, &engine.running_lengths(), t.kv);
                    let moving = engine.release_some(d, t.kv)?;
                    stats.bytes += send_migrants(g, &moving, GIFT)?;
                    stats.realloc_seconds += start.elapsed().as_secs_f64();
                    t.counter.add(&t.load_key(t.rank), -(moving.len() as i64))?;
                    given += moving.len();
                    stats.given += moving.len();
                }
            }
            Role::Keeps(p) => {
                let layout = engine.kv_layout();
                let mut take = |k: usize,
                                engine: &mut Generation<'_>,
                                stats: &mut TailStats|
                 -> Result<(usize, bool)> {
                    let (moved, kind, bytes) = recv_migrants(&p[k].1, layout)?;
                    stats.received_bytes += bytes;
                    for m in &moved {
                        owners.insert(m.batch_index * n + m.sample_index, k);
                        if m.kv.is_none() && !m.tokens.is_empty() {
                            stats.prefill_tokens += m.prompt.len() + m.tokens.len() - 1;
                        }
                    }
                    let count = moved.len();
                    engine.adopt(moved)?;
                    Ok((count, kind == TAIL))
                };
                if global <= t.threshold {
                    let start = Instant::now();
                    stats.at = Some(start.duration_since(t0).as_secs_f64());
                    for k in 0..p.len() {
                        if tail_in[k] {
                            continue;
                        }
                        let (count, is_tail) = take(k, &mut engine, &mut stats)?;
                        if !is_tail {
                            return Err(Error::invalid(
                                "migration",
                                format!("rank {} sent samples nobody asked for", p[k].0),
                            ));
                        }
                        stats.received += count;
                        tail_in[k] = true;
                        for (slot, s) in held[k].drain(..) {
                            send_sample(&p[k].1, slot, &s)?;
                        }
                    }
                    stats.seconds = start.elapsed().as_secs_f64();
                    migrated = true;
                    continue;
                }
                if local > 0 {
                    continue;
                }
                // Out of samples before the tail: ask the paired replica with the most
                // unfinished ones (which gives some if the cost model says it pays).
                let mut busiest: Option<(usize, i64)> = None;
                for k in (0..p.len()).filter(|&k| !tail_in[k] && !declined[k]) {
                    let load = t.counter.add(&t.load_key(p[k].0), 0)?;
                    if load >= 2 && busiest.is_none_or(|b| load > b.1) {
                        busiest = Some((k, load));
                    }
                }
                let Some((k, _)) = busiest else {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                };
                let start = Instant::now();
                t.counter.add(&t.ask_key(p[k].0), 1)?;
                let (count, is_tail) = take(k, &mut engine, &mut stats)?;
                if is_tail {
                    // It had reached its own hand-over: this is its tail.
                    stats
                        .at
                        .get_or_insert(start.duration_since(t0).as_secs_f64());
                    stats.received += count;
                    tail_in[k] = true;
                    for (slot, s) in held[k].drain(..) {
                        send_sample(&p[k].1, slot, &s)?;
                    }
                    if tail_in.iter().all(|x| *x) {
                        migrated = true;
                    }
                } else {
                    stats.reallocated += count;
                    stats.realloc_seconds += start.elapsed().as_secs_f64();
                    if count == 0 {
                        declined[k] = true;
                    }
                }
            }
        }
    }
    Ok((stats, give_back(tail)))
}

fn give_back(tail: Option<Tail>) -> TailGroups {
    match tail.map(|t| t.role) {
        Some(Role::Keeps(peers)) => peers,
        Some(Role::Releases(peer, g)) => vec![(peer, *g)],
        None => Vec::new(),
    }
}

/// Whether started samples of a model should take their KV cache along rather than be
/// prefilled again where they land: the cost model's time to send `kv_bytes` between two
/// devices against its time to prefill `tokens` on one.
pub(super) fn carry_kv(
    cost: &braid_cost::cost::CostModel,
    shape: &braid_cost::cost::ModelShape,
    samples: u64,
    context: u64,
    across_nodes: bool,
) -> bool {
    let d = &cost.device;
    let (bw, latency) = if across_nodes {
        (d.inter_node_bandwidth, d.inter_node_latency)
    } else {
        (d.intra_node_bandwidth, d.intra_node_latency)
    };
    let bytes = (samples * context * shape.kv_bytes_per_token(cost.dtype_bytes)) as f64;
    let send = latency + bytes / (bw * d.network_efficiency).max(1.0);
    let layout = braid_cost::cost::Layout {
        dp: 1,
        tp: 1,
        pp: 1,
    };
    let prefill = cost.prefill_time(shape, layout, samples.max(1), context.max(1));
    send <= prefill
}

/// Peer of a group of two.
fn peer(g: &ProcessGroup) -> usize {
    1 - g.rank()
}

fn ints(t: &Tensor) -> Result<Vec<i64>> {
    Vec::<i64>::try_from(t).map_err(Error::Torch)
}

/// Sends migrants over a group of two: a count and what they are (`GIFT` or `TAIL`), then per
/// migrant a header (batch index,
/// sample, prompt and token counts, generator state, cache length or -1) and its parts.
/// Returns the bytes sent.
fn send_migrants(g: &ProcessGroup, moving: &[Migrant], kind: i64) -> Result<usize> {
    let to = peer(g);
    g.send(&Tensor::from_slice(&[moving.len() as i64, kind]), to, 0)?;
    let mut bytes = 16;
    for m in moving {
        let kv_len =
            m.kv.as_ref()
                .and_then(|(k, _)| k.first())
                .map_or(-1, |t| t.size().get(1).copied().unwrap_or(0));
        let header = [
            m.batch_index as i64,
            m.sample_index as i64,
            m.prompt.len() as i64,
            m.tokens.len() as i64,
            m.rng as i64,
            kv_len,
        ];
        g.send(&Tensor::from_slice(&header), to, 1)?;
        g.send(&Tensor::from_slice(&m.prompt), to, 2)?;
        bytes += 48 + 8 * m.prompt.len();
        if !m.tokens.is_empty() {
            g.send(&Tensor::from_slice(&m.tokens), to, 3)?;
            g.send(&Tensor::from_slice(&m.logprobs), to, 4)?;
            bytes += 12 * m.tokens.len();
        }
        if let Some((keys, values)) = &m.kv
            && kv_len > 0
        {
            let parts: Vec<Tensor> = keys.iter().chain(values).map(|t| t.reshape([-1])).collect();
            g.send(&Tensor::cat(&parts, 0), to, 5)?;
            bytes += m.kv_bytes();
        }
    }
    Ok(bytes)
}

/// Receives what `send_migrants` sent, the caches as `layout` (layers, key/value heads, head
/// width, kind) says. Returns them, what they are, and the bytes received.
fn recv_migrants(
    g: &ProcessGroup,
    (layers, kv_heads, head_dim, kind): (usize, i64, i64, Kind),
) -> Result<(Vec<Migrant>, i64, usize)> {
    let from = peer(g);
    let cpu = tch::Device::Cpu;
    let mut head = Tensor::zeros([2], (Kind::Int64, cpu));
    g.recv(&mut head, from, 0)?;
    let head = ints(&head)?;
    let (count, what) = (head[0], head[1]);
    if !(0..=1 << 24).contains(&count) {
        return Err(Error::invalid(
            "migration",
            format!("rank {from} announced {count} samples"),
        ));
    }
    let mut out = Vec::with_capacity(count as usize);
    let mut bytes = 16;
    for _ in 0..count {
        let mut header = Tensor::zeros([6], (Kind::Int64, cpu));
        g.recv(&mut header, from, 1)?;
        let h = ints(&header)?;
        let (plen, ntok, kv_len) = (h[2].max(0), h[3].max(0), h[5]);
        let mut prompt = Tensor::zeros([plen], (Kind::Int64, cpu));
        g.recv(&mut prompt, from, 2)?;
        bytes += 48 + 8 * plen as usize;
        let mut tokens = Tensor::zeros([ntok], (Kind::Int64, cpu));
        let mut logprobs = Tensor::zeros([ntok], (Kind::Float, cpu));
        if ntok > 0 {
            g.recv(&mut tokens, from, 3)?;
            g.recv(&mut logprobs, from, 4)?;
            bytes += 12 * ntok as usize;
        }
        let kv = if kv_len > 0 {
            let per = kv_heads * kv_len * head_dim;
            let mut flat = Tensor::zeros([2 * layers as i64 * per], (kind, cpu));
            g.recv(&mut flat, from, 5)?;
            bytes += flat.numel() * kind.elt_size_in_bytes();
            let mut parts: Vec<Tensor> = (0..2 * layers as i64)
                .map(|i| {
                    flat.narrow(0, i * per, per)
                        .reshape([kv_heads, kv_len, head_dim])
                })
                .collect();
            let values = parts.split_off(layers);
            Some((parts, values))
        } else {
            None
        };
        out.push(Migrant {
            batch_index: h[0].max(0) as usize,
            sample_index: h[1].max(0) as usize,
            prompt: ints(&prompt)?,
            tokens: ints(&tokens)?,
            logprobs: Vec::<f32>::try_from(&logprobs).map_err(Error::Torch)?,
            rng: h[4] as u64,
            kv,
        });
    }
    Ok((out, what, bytes))
}

/// Sends one finished sample (numbered `slot`) to the other rank of a group of two: a header
/// (number, token count, log-prob count, text bytes, how it finished), then each part that is
/// not empty.
pub(super) fn send_sample(g: &ProcessGroup, slot: usize, sample: &Sample) -> Result<()> {
    let to = peer(g);
    let header = Tensor::from_slice(&[
        slot as i64,
        sample.token_ids.len() as i64,
        sample.logprobs.len() as i64,
        sample.text.len() as i64,
        finish_code(&sample.finish),
    ]);
    g.send(&header, to, 10)?;
    if !sample.token_ids.is_empty() {
        g.send(&Tensor::from_slice(&sample.token_ids), to, 11)?;
    }
    if !sample.logprobs.is_empty() {
        g.send(&Tensor::from_slice(&sample.logprobs), to, 12)?;
    }
    if !sample.text.is_empty() {
        g.send(&Tensor::from_slice(sample.text.as_bytes()), to, 13)?;
    }
    Ok(())
}

/// Receives what `send_sample` sent: the sample's number and the sample (`n` samples per
/// prompt), exactly as the engine produced it.
pub(super) fn recv_sample(g: &ProcessGroup, n: usize) -> Result<(usize, Sample)> {
    let from = peer(g);
    let cpu = tch::Device::Cpu;
    let mut header = Tensor::zeros([5], (Kind::Int64, cpu));
    g.recv(&mut header, from, 10)?;
    let h = ints(&header)?;
    let (slot, ntok, nlp, ntext) = (h[0].max(0), h[1].max(0), h[2].max(0), h[3].max(0));
    let mut ids = Tensor::zeros([ntok], (Kind::Int64, cpu));
    if ntok > 0 {
        g.recv(&mut ids, from, 11)?;
    }
    let mut lps = Tensor::zeros([nlp], (Kind::Float, cpu));
    if nlp > 0 {
        g.recv(&mut lps, from, 12)?;
    }
    let mut text = Tensor::zeros([ntext], (Kind::Uint8, cpu));
    if ntext > 0 {
        g.recv(&mut text, from, 13)?;
    }
    let slot = slot as usize;
    let text: Vec<u8> = Vec::<u8>::try_from(&text).map_err(Error::Torch)?;
    Ok((
        slot,
        Sample {
            prompt_index: slot / n.max(1),
            sample_index: slot % n.max(1),
            token_ids: ints(&ids)?,
            logprobs: Vec::<f32>::try_from(&lps).map_err(Error::Torch)?,
            text: String::from_utf8(text)
                .map_err(|e| Error::invalid("generation", format!("a sample's text: {e}")))?,
            finish: finish_of(h[4]),
        },
    ))
}

impl super::Executor<'_> {
    /// Records what migrating generation `id`'s tail did this step (metrics, and a span on
    /// this rank's timeline from `g0`, the generation's start in the step), then re-chooses
    /// the next iteration's migration from the lengths this one produced, unless pinned.
    pub(super) fn record_tail(
        &mut self,
        step: i64,
        id: braid_ir::graph::NodeId,
        g0: f64,
        stats: &super::stream::GenStats,
        rollout: &super::RolloutData,
        m: &mut BTreeMap<String, f64>,
    ) -> Result<()> {
        let Some(state) = self.tails.get(&id).cloned() else {
            return Ok(());
        };
        let t = &stats.tail;
        match state.current {
            Some(ch) => {
                m.insert("migrate/threshold".into(), ch.threshold as f64);
                m.insert("migrate/kept".into(), ch.kept as f64);
            }
            None => {
                m.insert("migrate/threshold".into(), 0.0);
            }
        }
        m.insert(
            "migrate/happened".into(),
            f64::from(u8::from(t.at.is_some())),
        );
        m.insert("migrate/samples".into(), t.received as f64);
        m.insert("migrate/bytes".into(), t.received_bytes as f64);
        m.insert("migrate/prefill_tokens".into(), t.prefill_tokens as f64);
        m.insert("migrate/seconds".into(), t.seconds);
        m.insert("migrate/kv".into(), f64::from(u8::from(state.kv)));
        m.insert("migrate/reallocated".into(), t.reallocated as f64);
        if let Some(at) = t.at {
            m.insert("migrate/at_s".into(), at);
            let (what, n, bytes) = if t.kept {
                ("took", t.received, t.received_bytes)
            } else {
                ("handed over", t.samples, t.bytes)
            };
            let label = format!(
                "{}: {what} {n} unfinished sample(s), {:.1} KB, {}",
                self.call_name(id),
                bytes as f64 / 1e3,
                if state.kv {
                    "with their KV caches"
                } else {
                    "prefilled again"
                }
            );
            self.timeline.push(braid_cost::sim::Span {
                device: self.comm.rank,
                iteration: step as u32,
                task: format!("{id} migrate"),
                stage: "migrate".into(),
                label,
                start: g0 + at,
                end: g0 + at + t.seconds,
            });
        }
        if state.pinned {
            return Ok(());
        }
        let Some(tuner) = self.options.tail_tuner.clone() else {
            return Ok(());
        };
        let lengths: Vec<u64> = rollout.lengths().iter().map(|&l| l as u64).collect();
        let next = (tuner.0)(id, &lengths, state.planned.kept)
            .map_err(|e| Error::invalid("migration", format!("re-choosing R_t: {e}")))?;
        if let Some(s) = self.tails.get_mut(&id) {
            s.current = next.map(|(threshold, kept)| super::TailChoice {
                threshold,
                kept: kept.clamp(1, s.planned.kept),
            });
        }
        Ok(())
    }
}

/// The generations whose tails this run migrates (`comm::migrates`) with the plan's choice
/// (and what decides reallocation before the tail):
/// started samples carry their KV cache when `kv` says so, or, by default, when the cost
/// model finds sending the plan's tail cheaper than prefilling it again.
pub(super) fn tail_states(
    exec: &braid_ir::exec_plan::ExecPlan,
    kv: Option<bool>,
    gen_lengths: bool,
) -> Result<BTreeMap<braid_ir::graph::NodeId, super::TailState>> {
    use braid_ir::graph::Op;
    let mut out = BTreeMap::new();
    for (id, m) in &exec.decisions.migrations {
        if !super::comm::migrates(exec, *id) {
            continue;
        }
        let Some(Op::Generate { model, params }) = exec.plan.graph.node(*id).map(|n| &n.op) else {
            continue;
        };
        let Some(shape) = exec.shapes.get(*model as usize) else {
            continue;
        };
        // A draft model's cache would have to move with the samples (`--gen-lengths` turns
        // speculation off).
        if !gen_lengths
            && matches!(
                exec.speculation(*id),
                braid_ir::graph::Speculation::Draft { .. }
            )
        {
            return Err(Error::invalid(
                "plan",
                format!(
                    "{id} migrates its tail and drafts with a draft model, whose cache does not \
                     migrate; pin `migrate off` or another `speculate` mode"
                ),
            ));
        }
        let max_new = params.max_new_tokens.max(1) as u64;
        let kv = kv.unwrap_or_else(|| {
            carry_kv(
                &exec.cluster.cost_model(),
                shape,
                m.threshold,
                exec.workload.prompt_len + max_new / 2,
                exec.cluster.nodes > 1,
            )
        });
        let planned = super::TailChoice {
            threshold: m.threshold,
            kept: m.to_instances,
        };
        out.insert(
            *id,
            super::TailState {
                current: Some(planned),
                planned,
                pinned: m.pinned,
                kv,
                realloc: Realloc::for_plan(exec, shape, max_new, exec.seed),
            },
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use braid_cost::cluster::ClusterSpec;
    use braid_cost::cost::ModelShape;

    fn realloc(cluster: &str, lengths: Vec<u64>) -> Realloc {
        Realloc {
            cost: ClusterSpec::parse(cluster).unwrap().cost_model(),
            shape: ModelShape::preset_for_path("llama-7b").unwrap(),
            prompt_len: 128,
            lengths,
            across_nodes: false,
        }
    }

    /// Reallocation pays where splitting the batch shortens the decode steps (half the KV
    /// reads, and at a large batch half the compute, on the other device) by more than the
    /// hand-over costs over the tokens expected to remain; not when little work remains, and
    /// not for a single sample.
    #[test]
    fn reallocation_gives_half_only_where_the_cost_model_says_it_pays() {
        let long: Vec<u64> = (1..=512).collect();
        let r = realloc("1x8xH100", long.clone());
        assert_eq!(r.donation(1024, &vec![10; 1024], true), 512);
        assert_eq!(r.donation(4, &[10; 4], true), 2);
        assert_eq!(r.donation(1, &[10], true), 0);
        // Every sample is about to end: nothing to gain.
        let short = realloc("1x8xH100", vec![11; 512]);
        assert_eq!(short.donation(1024, &vec![10; 1024], true), 0);
        assert_eq!(short.donation(4, &[10; 4], false), 0);
        // Expected remaining tokens from the lengths above what a sample has.
        assert!((r.remaining(0) - 256.5).abs() < 1e-9);
        assert!((r.remaining(500) - 6.5).abs() < 1e-9);
        assert_eq!(short.remaining(20), 1.0);
    }
}
