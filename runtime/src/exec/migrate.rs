//! Samples moving between the data-parallel replicas of a generation at run time: long-tail
//! migration (the second half of RLHFuse's inter-stage fusion) and sample reallocation
//! (RLHFSpec).
//!
//! **Migration.** Once no more than `R_t` samples are still decoding anywhere, the replicas the
//! plan releases (`kept..`) hand their unfinished samples to the replicas it keeps (released
//! replica `r` to kept replica `r mod kept`), and the released ranks' cores go to the streamed
//! inference the plan placed on them. **Reallocation.** Before that, a kept replica (every
//! replica, in a generation that does not migrate) that runs out of samples asks the replica
//! offering the most for some; that one gives half when the cost model says splitting them
//! pays (`Realloc::donation`).
//!
//! How the ranks agree without a collective over the world: every replica adds the samples it
//! finishes to one counter in the run's store (`Store::add`) and keeps its offer in another
//! (the samples it would give an idle replica now, by the cost model: none near its end, so
//! that replicas finishing together neither ask nor wait on each other); it reads the finished
//! count back after any step in which it finished samples or holds no more than `R_t` itself
//! (the global count can be at most `R_t` only then: every sample a replica holds is
//! unfinished). A request for samples is a numbered entry on the
//! donor's request counter, answered in the store with the count it gives (then the samples
//! follow over the two replicas' group); a replica that stops taking requests adds a large
//! constant to its counter, so that a request made after it is seen as refused and every one
//! made before is answered. Nobody waits on a peer that has not committed to the matching send:
//! an asker polls for its answer, a kept replica receives a released one's tail only once the
//! counter says that one will send it by its next step.
//!
//! Every sample keeps its owner, the replica that generated its prompt: where it finishes
//! elsewhere, the replica holding it posts it to the store for its owner, which emits it as if
//! it had finished there — so the streaming routes, the gathers and the metrics stay as they
//! are. A sample moves with its generator state and its cache (or is prefilled again where it
//! lands), so its text is the one it would have had where it started.
//!
//! A tensor-parallel replica takes part as one: its first rank reads and writes the counters
//! and decides, after every step, what the replica does next, and tells its other ranks over
//! the replica's group; each tensor rank sends its shard of a sample's cache (and its copy of
//! the sample) to the same tensor rank of the other replica.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use crate::dist::{ProcessGroup, Store};
use crate::error::{Error, Result};
use crate::generation::engine::{Generation, Migrant, Sample};

use super::values::{decode_samples, encode_samples};

/// One generation's sample exchange, as this rank takes part in it.
pub(super) struct Tail {
    /// The run's store (a connection of its own: the generation thread uses it).
    pub(super) counter: Store,
    /// This exchange's keys' prefix (one per generation and iteration).
    pub(super) key: String,
    /// Samples in the generation, over every replica.
    pub(super) total: usize,
    /// Migrate when no more than this many are unfinished (0: this iteration does not).
    pub(super) threshold: usize,
    /// Started samples take their KV cache along (else they are prefilled again).
    pub(super) kv: bool,
    /// This rank's replica, and the number of replicas.
    pub(super) me: usize,
    pub(super) replicas: usize,
    /// Replicas `0..kept` keep their samples at the tail; `kept..` release theirs.
    pub(super) kept: usize,
    /// This rank's tensor rank in its replica (0 decides for the replica).
    pub(super) tp_rank: usize,
    /// Per other replica: its rank of this tensor rank, and the group of two to it.
    pub(super) peers: BTreeMap<usize, (usize, ProcessGroup)>,
    /// The replica's group, when it is tensor-parallel.
    pub(super) decider: Option<ProcessGroup>,
    /// What decides reallocation before the tail (`None`: reallocation is off).
    pub(super) realloc: Option<Realloc>,
    /// This replica asks for samples when it runs out: none of its ranks runs inference
    /// streamed under the generation (a rank that does is not idle; its inference would wait
    /// for the samples it took).
    pub(super) asks: bool,
    /// The longest this rank waits for a peer without anything happening.
    pub(super) timeout: Duration,
}

impl Tail {
    fn done_key(&self) -> String {
        format!("{}/done", self.key)
    }

    /// The samples replica `r` would give an idle replica now (its offer).
    fn load_key(&self, r: usize) -> String {
        format!("{}/load/{r}", self.key)
    }

    /// Requests made to replica `r` (plus `CLOSED` once it takes no more).
    fn ask_key(&self, r: usize) -> String {
        format!("{}/ask/{r}", self.key)
    }

    /// Who made request `seq` to replica `r`.
    fn asker_key(&self, r: usize, seq: i64) -> String {
        format!("{}/ask/{r}/{seq}", self.key)
    }

    /// Replica `r`'s answer to request `seq`: the samples it gives, plus one (0: not yet).
    fn reply_key(&self, r: usize, seq: i64) -> String {
        format!("{}/reply/{r}/{seq}", self.key)
    }

    /// Finished samples posted for tensor rank `t` of their owner, replica `r`.
    fn back_key(&self, r: usize, t: usize) -> String {
        format!("{}/back/{r}/{t}", self.key)
    }

    fn back_item(&self, r: usize, t: usize, seq: i64) -> String {
        format!("{}/back/{r}/{t}/{seq}", self.key)
    }

    /// The replicas that hand their tails to this one.
    fn partners(&self) -> Vec<usize> {
        if self.threshold == 0 || self.me >= self.kept {
            return Vec::new();
        }
        (self.kept..self.replicas)
            .filter(|r| r % self.kept == self.me)
            .collect()
    }

    fn group(&self, r: usize) -> Result<&ProcessGroup> {
        self.peers.get(&r).map(|(_, g)| g).ok_or_else(|| {
            Error::invalid(
                "migration",
                format!("replica {}: no group to replica {r}", self.me),
            )
        })
    }

    fn rank_of(&self, r: usize) -> usize {
        self.peers.get(&r).map_or(usize::MAX, |(rank, _)| *rank)
    }
}

/// A migrant and its owner (the replica that generated its prompt).
type Owned = (Migrant, usize);

/// Added to a replica's request counter when it takes no more requests.
const CLOSED: i64 = 1 << 40;

/// What a message of migrants is: samples given on request, or a released replica's tail.
const GIFT: i64 = 0;
const TAIL: i64 = 1;

/// The cost model's view of sample reallocation (RLHFSpec) for one generation: before the
/// tail, a replica that has run out of samples asks the one holding the most for some, which
/// gives half of them when its own decode steps over the work expected to remain, against its
/// and the receiver's steps side by side plus the hand-over, say so.
#[derive(Clone, Debug)]
pub(crate) struct Realloc {
    pub(super) cost: braid_cost::cost::CostModel,
    pub(super) shape: braid_cost::cost::ModelShape,
    pub(super) prompt_len: u64,
    /// Lengths drawn from the plan's distribution (at most `max_new_tokens`), ascending: what
    /// remains of a sample with `l` tokens is estimated from those above `l`.
    pub(super) lengths: Vec<u64>,
    pub(super) across_nodes: bool,
    /// Seconds a hand-over took when this rank last gave samples in an earlier generation
    /// (measured: the send waits for the receiver), for `donation`.
    pub(super) handover: Option<f64>,
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
            cost: exec.cost_model(),
            shape: shape.clone(),
            prompt_len: exec.workload.prompt_len,
            lengths,
            across_nodes: exec.cluster.nodes > 1,
            handover: None,
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
    /// the others not started) to give an idle replica: half, when that pays, else none. The
    /// decode steps saved come from `measured` (this generation's own steps, `measured_step`)
    /// where there is one, else from the cost model; the hand-over's cost from `handover`,
    /// the last one measured, else from the cost model.
    pub(super) fn donation(
        &self,
        pending: usize,
        running: &[usize],
        kv: bool,
        measured: Option<(f64, f64)>,
        handover: Option<f64>,
    ) -> usize {
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
        // Side by side, the longer of the two halves' steps against the whole batch's; with a
        // measured line `fixed + per_row × rows`, that is `per_row × give` a step, and taking
        // the samples in costs the receiver about one step's fixed work.
        let (saved, adopting) = match measured {
            Some((fixed, per_row)) => (steps * per_row * give as f64, fixed),
            None => (
                steps * (step(pending) - step(pending - give).max(step(give))),
                0.0,
            ),
        };
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
        let moving = handover.unwrap_or(moving);
        if saved > moving + adopting { give } else { 0 }
    }
}

/// A decode step's seconds as a line in its rows, `(fixed, per row)`, fitted by least squares
/// to the plain steps of `log` (a generation's so far); `None` with fewer than 8 steps or rows
/// too alike to fit.
pub(super) fn measured_step(log: &[crate::generation::spec::StepRecord]) -> Option<(f64, f64)> {
    let pts: Vec<(f64, f64)> = log
        .iter()
        .filter(|r| r.draft_len == 0 && r.rows > 0)
        .map(|r| (r.rows as f64, r.secs))
        .collect();
    if pts.len() < 8 {
        return None;
    }
    let n = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx < 1.0 {
        return None;
    }
    let per_row = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>() / sxx;
    let per_row = per_row.max(0.0);
    Some(((my - per_row * mx).max(0.0), per_row))
}

/// What a replica does after a step, as its first rank decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    /// Decode on (or look again, when it holds nothing).
    Step,
    /// Look again in a moment (holding nothing, waiting for an answer or a tail).
    Wait,
    /// Hand every unfinished sample to the kept replica this one is paired with.
    Release,
    /// Give `count` samples to replica `to`, which asked.
    Give { to: usize, count: usize },
    /// Take the tails of the released replicas paired with this one.
    TakeTails,
    /// Take the samples replica `from` said it gives.
    TakeGift { from: usize },
    /// This replica's part is over (its own samples may still come back from elsewhere).
    Done,
}

impl Action {
    fn encode(self) -> [i64; 3] {
        match self {
            Action::Step => [0, 0, 0],
            Action::Wait => [1, 0, 0],
            Action::Release => [2, 0, 0],
            Action::Give { to, count } => [3, to as i64, count as i64],
            Action::TakeTails => [4, 0, 0],
            Action::TakeGift { from } => [5, from as i64, 0],
            Action::Done => [6, 0, 0],
        }
    }

    fn decode(a: &[i64]) -> Result<Action> {
        let arg = |i: usize| usize::try_from(a.get(i).copied().unwrap_or(-1)).ok();
        Ok(match (a.first().copied(), arg(1), arg(2)) {
            (Some(0), ..) => Action::Step,
            (Some(1), ..) => Action::Wait,
            (Some(2), ..) => Action::Release,
            (Some(3), Some(to), Some(count)) => Action::Give { to, count },
            (Some(4), ..) => Action::TakeTails,
            (Some(5), Some(from), _) => Action::TakeGift { from },
            (Some(6), ..) => Action::Done,
            _ => {
                return Err(Error::invalid(
                    "migration",
                    format!("the replica's first rank sent an unknown step {a:?}"),
                ));
            }
        })
    }
}

/// What a replica's first rank keeps track of to decide.
struct Lead {
    /// Requests to this replica answered so far.
    answered: i64,
    /// Replicas that gave nothing when asked (not asked again in this generation).
    declined: Vec<bool>,
    /// The request this replica waits on an answer to: the donor and the request's number.
    asking: Option<(usize, i64)>,
    /// The offer last written to the store.
    reported: i64,
    /// Takes no more requests.
    closed: bool,
    /// When something last happened (for the timeout on waits).
    progress: Instant,
    /// The world's unfinished samples last read.
    global: usize,
    /// Samples finished here and not yet added to the world's count.
    unreported: usize,
    /// When the store was last looked at.
    looked: Instant,
    /// How long the last look at the store took.
    look_cost: Duration,
    /// Seconds this replica's last hand-over of samples took.
    handover: Option<f64>,
}

/// How often a decoding replica looks at the store (requests, offers, the finished count), at
/// most.
const LOOK: Duration = Duration::from_millis(1);

/// The share of a decoding replica's time its looks at the store may take, at most.
const LOOK_SHARE: f64 = 0.05;

impl Lead {
    /// Adds the samples finished since the last report to the world's count, and reads it.
    /// Only a generation that migrates its tail counts (nothing else reads the count).
    fn report(&mut self, t: &Tail) -> Result<()> {
        if t.threshold == 0 {
            self.unreported = 0;
            return Ok(());
        }
        let done = t.counter.add(&t.done_key(), self.unreported as i64)?;
        self.unreported = 0;
        let global = t.total.saturating_sub(usize::try_from(done).unwrap_or(0));
        if global != self.global {
            self.progress = Instant::now();
        }
        self.global = global;
        Ok(())
    }

    /// Takes no more requests: answers every one made before with nothing and clears the
    /// offer (every finished sample reported first).
    fn close(&mut self, t: &Tail) -> Result<()> {
        if self.unreported > 0 {
            self.report(t)?;
        }
        if self.closed {
            return Ok(());
        }
        let made = t.counter.add(&t.ask_key(t.me), CLOSED)? - CLOSED;
        for seq in self.answered + 1..=made {
            t.counter.add(&t.reply_key(t.me, seq), 1)?;
        }
        self.answered = made.max(self.answered);
        t.counter.add(&t.load_key(t.me), -self.reported)?;
        self.reported = 0;
        self.closed = true;
        Ok(())
    }

    /// What the replica does next, after a step that finished `finished` of its samples.
    fn decide(
        &mut self,
        t: &Tail,
        engine: &Generation<'_>,
        finished: usize,
        tails_done: bool,
    ) -> Result<Action> {
        let local = engine.pending();
        self.unreported += finished;
        // While decoding, the store is looked at no more often than once per `LOOK`, nor more
        // often than keeps the looks within `LOOK_SHARE` of the replica's time (a tiny model's
        // decode step is shorter than a round trip to the store, which now and then takes
        // milliseconds on a busy host); at every step near the threshold and once out of
        // samples.
        let interval = LOOK.max(self.look_cost.mul_f64(1.0 / LOOK_SHARE - 1.0));
        let look = self.looked.elapsed() >= interval || local <= t.threshold || local == 0;
        if !look {
            return Ok(Action::Step);
        }
        let start = Instant::now();
        let action = self.look(t, engine, local, tails_done);
        self.looked = Instant::now();
        self.look_cost = self.looked.duration_since(start);
        action
    }

    /// `decide`, once it looks at the store: `local` samples are still decoding here.
    fn look(
        &mut self,
        t: &Tail,
        engine: &Generation<'_>,
        local: usize,
        tails_done: bool,
    ) -> Result<Action> {
        // What this replica would give an idle one now: asked only where it would give
        // some, an idle replica neither asks nor waits on one whose samples are nearly done.
        let offer = match t.realloc.as_ref() {
            Some(r) if local >= 2 && !self.closed => {
                let measured = measured_step(engine.step_log());
                let handover = self.handover.or(r.handover);
                r.donation(local, &engine.running_lengths(), t.kv, measured, handover) as i64
            }
            _ => 0,
        };
        if offer != self.reported && !self.closed {
            t.counter.add(&t.load_key(t.me), offer - self.reported)?;
            self.reported = offer;
        }
        if self.unreported > 0 || local <= t.threshold {
            self.report(t)?;
        }
        let global = self.global;
        let releases = t.me >= t.kept;
        if releases && (global <= t.threshold || local == 0) {
            self.close(t)?;
            return Ok(Action::Release);
        }
        // Answer the next request, if one was made.
        if let Some(r) = t.realloc.as_ref().filter(|_| !self.closed) {
            let asks = t.counter.add(&t.ask_key(t.me), 0)?;
            if asks > self.answered {
                let seq = self.answered + 1;
                let who = t.counter.get(&t.asker_key(t.me, seq), t.timeout)?;
                let to = std::str::from_utf8(&who)
                    .ok()
                    .and_then(|w| w.parse::<usize>().ok())
                    .filter(|&w| w < t.replicas && w != t.me)
                    .ok_or_else(|| {
                        Error::invalid("migration", format!("request {seq}: no asker"))
                    })?;
                let count = if local >= 2 {
                    let measured = measured_step(engine.step_log());
                    let handover = self.handover.or(r.handover);
                    r.donation(local, &engine.running_lengths(), t.kv, measured, handover)
                } else {
                    0
                };
                t.counter.add(&t.reply_key(t.me, seq), count as i64 + 1)?;
                self.answered = seq;
                self.progress = Instant::now();
                if count > 0 {
                    return Ok(Action::Give { to, count });
                }
            }
        }
        if releases {
            return Ok(Action::Step);
        }
        if let Some((donor, seq)) = self.asking {
            let answer = t.counter.add(&t.reply_key(donor, seq), 0)?;
            if answer == 0 {
                self.check_waited(t, &format!("an answer from replica {donor}"))?;
                return Ok(if local > 0 {
                    Action::Step
                } else {
                    Action::Wait
                });
            }
            self.asking = None;
            self.progress = Instant::now();
            if answer > 1 {
                return Ok(Action::TakeGift { from: donor });
            }
            self.declined[donor] = true;
        }
        if t.threshold > 0 && global <= t.threshold && !tails_done {
            return Ok(Action::TakeTails);
        }
        if local > 0 {
            return Ok(Action::Step);
        }
        // Out of samples: ask the replica offering the most (which gives some if the cost
        // model, on its state when asked, still says it pays).
        if t.realloc.is_some() && t.asks {
            let mut busiest: Option<(usize, i64)> = None;
            for x in (0..t.replicas).filter(|&x| x != t.me && !self.declined[x]) {
                let offer = t.counter.add(&t.load_key(x), 0)?;
                if offer >= 1 && busiest.is_none_or(|b| offer > b.1) {
                    busiest = Some((x, offer));
                }
            }
            if let Some((x, _)) = busiest {
                let seq = t.counter.add(&t.ask_key(x), 1)?;
                if seq > CLOSED {
                    self.declined[x] = true;
                } else {
                    t.counter
                        .set(&t.asker_key(x, seq), t.me.to_string().as_bytes())?;
                    self.asking = Some((x, seq));
                    self.progress = Instant::now();
                }
                return Ok(Action::Wait);
            }
        }
        if !tails_done {
            self.check_waited(t, "the tail's threshold")?;
            return Ok(Action::Wait);
        }
        self.close(t)?;
        Ok(Action::Done)
    }

    /// Fails when nothing happened for longer than the timeout while waiting for `what`.
    fn check_waited(&self, t: &Tail, what: &str) -> Result<()> {
        if self.progress.elapsed() > t.timeout {
            return Err(Error::invalid(
                "migration",
                format!(
                    "replica {} waited {:.0} s for {what} with nothing moving (a peer is stuck \
                     or gone)",
                    t.me,
                    t.timeout.as_secs_f64()
                ),
            ));
        }
        Ok(())
    }
}

/// What migration and reallocation did on this rank.
#[derive(Clone, Debug, Default)]
pub(super) struct TailStats {
    /// Seconds from the start of generation to the migration (`None`: it did not happen).
    pub(super) at: Option<f64>,
    /// Seconds spent sending or receiving the tail (and building its cache rows).
    pub(super) seconds: f64,
    /// Samples a released replica handed over, and their bytes (KV caches, prompts, tokens
    /// and log-probabilities).
    pub(super) samples: usize,
    pub(super) bytes: usize,
    /// Samples a kept replica took (each counted once over the world: on the replica's first
    /// rank), and the bytes this rank received.
    pub(super) received: usize,
    pub(super) received_bytes: usize,
    /// Tokens a replica had to prefill again (samples moved without their cache).
    pub(super) prefill_tokens: usize,
    /// This rank's replica kept its samples (else it released them).
    pub(super) kept: bool,
    /// Samples this replica was given before the tail, and gave, and the seconds those
    /// hand-overs took.
    pub(super) reallocated: usize,
    pub(super) given: usize,
    pub(super) realloc_seconds: f64,
    /// Seconds this replica's last hand-over of samples took (for the next decisions).
    pub(super) handover: Option<f64>,
}

/// The groups an exchange used, handed back after the generation: per peer rank, the group of
/// two, and the replica's group.
#[derive(Default)]
pub(super) struct TailGroups {
    pub(super) peers: Vec<(usize, ProcessGroup)>,
    pub(super) decider: Option<ProcessGroup>,
}

/// What every rank of a replica tracks of the exchange.
struct Held {
    /// Samples held here that belong to another replica: by number, their owner.
    owners: BTreeMap<usize, usize>,
    /// This replica's own samples finishing elsewhere, and how many have come back.
    away: usize,
    seen: i64,
}

impl Held {
    /// Emits a finished sample: to this rank's consumers when it is this replica's own, else
    /// to the store for its owner. `false`: nobody listens any more.
    fn finish(
        &mut self,
        t: Option<&Tail>,
        slot: usize,
        s: Sample,
        tx: &mpsc::Sender<Result<(usize, Sample)>>,
    ) -> Result<bool> {
        match (t, self.owners.remove(&slot)) {
            (Some(t), Some(owner)) if owner != t.me => {
                let seq = t.counter.add(&t.back_key(owner, t.tp_rank), 1)? - 1;
                t.counter.set(
                    &t.back_item(owner, t.tp_rank, seq),
                    &encode_samples(&[(slot, s)]),
                )?;
                Ok(true)
            }
            _ => Ok(tx.send(Ok((slot, s))).is_ok()),
        }
    }

    /// Emits the samples of this replica that finished elsewhere and were posted since the
    /// last look. Returns how many; `None`: nobody listens any more.
    fn collect(
        &mut self,
        t: &Tail,
        tx: &mpsc::Sender<Result<(usize, Sample)>>,
    ) -> Result<Option<usize>> {
        if self.away == 0 {
            return Ok(Some(0));
        }
        let posted = t.counter.add(&t.back_key(t.me, t.tp_rank), 0)?;
        let mut got = 0;
        while self.seen < posted {
            let key = t.back_item(t.me, t.tp_rank, self.seen);
            let bytes = t.counter.get(&key, t.timeout)?;
            // Its space in the store back: each is read once.
            t.counter.set(&key, &[])?;
            self.seen += 1;
            for (slot, s) in decode_samples(&bytes)? {
                self.away = self.away.saturating_sub(1);
                got += 1;
                if tx.send(Ok((slot, s))).is_err() {
                    return Ok(None);
                }
            }
        }
        Ok(Some(got))
    }

    /// Takes migrants in: their owners noted, this replica's own counted back.
    fn adopt(
        &mut self,
        t: &Tail,
        engine: &mut Generation<'_>,
        moved: Vec<Owned>,
        n: usize,
        stats: &mut TailStats,
    ) -> Result<usize> {
        let count = moved.len();
        let mut migrants = Vec::with_capacity(count);
        for (m, owner) in moved {
            if owner == t.me {
                self.away = self.away.saturating_sub(1);
            } else {
                self.owners
                    .insert(m.batch_index * n + m.sample_index, owner);
            }
            if m.kv.is_none() && !m.tokens.is_empty() {
                stats.prefill_tokens += m.prompt.len() + m.tokens.len() - 1;
            }
            migrants.push(m);
        }
        engine.adopt(migrants)?;
        Ok(count)
    }

    /// The owners of migrants about to leave (each forgotten here; this replica's own counted
    /// away).
    fn owners_of(&mut self, t: &Tail, moving: &[Migrant], n: usize) -> Vec<usize> {
        moving
            .iter()
            .map(|m| {
                let owner = self
                    .owners
                    .remove(&(m.batch_index * n + m.sample_index))
                    .unwrap_or(t.me);
                if owner == t.me {
                    self.away += 1;
                }
                owner
            })
            .collect()
    }
}

/// Runs generation `engine` to the end on this thread, sending each finished sample of this
/// replica (numbered `prompt × n + sample`, its prompt index made the batch's) to `tx`,
/// exchanging samples with the other replicas when `tail` says so. Returns what the exchange
/// did and the groups it used.
pub(super) fn run(
    mut engine: Generation<'_>,
    tail: Option<Tail>,
    n: usize,
    tx: &mpsc::Sender<Result<(usize, Sample)>>,
    t0: Instant,
) -> Result<(TailStats, TailGroups)> {
    let mut stats = TailStats {
        kept: tail.as_ref().is_none_or(|t| t.me < t.kept),
        ..TailStats::default()
    };
    let mut held = Held {
        owners: BTreeMap::new(),
        away: 0,
        seen: 0,
    };
    let Some(t) = tail else {
        while engine.pending() > 0 {
            for mut s in engine.step()? {
                s.prompt_index = engine.batch_index(s.prompt_index);
                let slot = s.prompt_index * n + s.sample_index;
                if !held.finish(None, slot, s, tx)? {
                    // The step failed elsewhere: stop generating.
                    return Ok((stats, TailGroups::default()));
                }
            }
        }
        return Ok((stats, TailGroups::default()));
    };
    let mut lead = (t.tp_rank == 0).then(|| Lead {
        answered: 0,
        declined: vec![false; t.replicas],
        asking: None,
        reported: 0,
        closed: false,
        progress: Instant::now(),
        global: usize::MAX,
        unreported: 0,
        looked: Instant::now(),
        look_cost: Duration::ZERO,
        handover: None,
    });
    let partners = t.partners();
    let mut tails_in: BTreeMap<usize, bool> = partners.iter().map(|&r| (r, false)).collect();
    let mut finished = 0usize;
    // The replica's part: decode, and do what its first rank decides after each step.
    loop {
        let tails_done = tails_in.values().all(|x| *x);
        let action = match lead.as_mut() {
            Some(l) => l.decide(&t, &engine, finished, tails_done)?,
            None => Action::Step,
        };
        let action = share(&t, action)?;
        finished = 0;
        match action {
            Action::Step => {
                if engine.pending() > 0 {
                    let done = engine.step()?;
                    finished = done.len();
                    for mut s in done {
                        s.prompt_index = engine.batch_index(s.prompt_index);
                        let slot = s.prompt_index * n + s.sample_index;
                        if !held.finish(Some(&t), slot, s, tx)? {
                            return Ok((stats, give_back(t)));
                        }
                    }
                }
            }
            Action::Wait => std::thread::sleep(Duration::from_millis(1)),
            Action::Release => {
                let start = Instant::now();
                stats.at = Some(start.duration_since(t0).as_secs_f64());
                let moving = engine.release(t.kv)?;
                let owners = held.owners_of(&t, &moving, n);
                stats.samples = moving.len();
                let to = t.me % t.kept.max(1);
                stats.bytes += send_migrants(t.group(to)?, &moving, &owners, TAIL)?;
                stats.seconds = start.elapsed().as_secs_f64();
                break;
            }
            Action::Give { to, count } => {
                let start = Instant::now();
                let moving = engine.release_some(count, t.kv)?;
                let owners = held.owners_of(&t, &moving, n);
                stats.bytes += send_migrants(t.group(to)?, &moving, &owners, GIFT)?;
                stats.given += moving.len();
                let took = start.elapsed().as_secs_f64();
                stats.realloc_seconds += took;
                stats.handover = Some(took);
                if let Some(l) = lead.as_mut() {
                    l.handover = Some(took);
                }
            }
            Action::TakeTails => {
                let start = Instant::now();
                stats.at = Some(start.duration_since(t0).as_secs_f64());
                for &r in &partners {
                    if tails_in.get(&r).copied().unwrap_or(true) {
                        continue;
                    }
                    let (moved, kind, bytes) = recv_migrants(t.group(r)?, engine.kv_layout())?;
                    if kind != TAIL {
                        return Err(Error::invalid(
                            "migration",
                            format!("rank {} sent samples nobody asked for", t.rank_of(r)),
                        ));
                    }
                    stats.received += held.adopt(&t, &mut engine, moved, n, &mut stats)?;
                    stats.received_bytes += bytes;
                    tails_in.insert(r, true);
                }
                stats.seconds = start.elapsed().as_secs_f64();
            }
            Action::TakeGift { from } => {
                let start = Instant::now();
                let (moved, kind, bytes) = recv_migrants(t.group(from)?, engine.kv_layout())?;
                if kind != GIFT {
                    return Err(Error::invalid(
                        "migration",
                        format!(
                            "rank {} sent its tail where it was asked for samples",
                            t.rank_of(from)
                        ),
                    ));
                }
                stats.reallocated += held.adopt(&t, &mut engine, moved, n, &mut stats)?;
                stats.received_bytes += bytes;
                stats.realloc_seconds += start.elapsed().as_secs_f64();
            }
            Action::Done => break,
        }
        if held.collect(&t, tx)?.is_none() {
            return Ok((stats, give_back(t)));
        }
    }
    // This replica's samples still finishing elsewhere come back through the store.
    let mut progress = Instant::now();
    while held.away > 0 {
        match held.collect(&t, tx)? {
            None => break,
            Some(0) => {
                if progress.elapsed() > t.timeout {
                    return Err(Error::invalid(
                        "migration",
                        format!(
                            "replica {}: {} of its samples did not come back within {:.0} s",
                            t.me,
                            held.away,
                            t.timeout.as_secs_f64()
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Some(_) => progress = Instant::now(),
        }
    }
    if t.tp_rank > 0 {
        // Samples counted once per replica, on its first rank; bytes on every rank (each
        // moves its own shard of the caches).
        stats.samples = 0;
        stats.received = 0;
        stats.prefill_tokens = 0;
        stats.reallocated = 0;
        stats.given = 0;
    }
    Ok((stats, give_back(t)))
}

/// The first rank's action, told to the replica's other ranks (the same action everywhere).
fn share(t: &Tail, action: Action) -> Result<Action> {
    let Some(g) = &t.decider else {
        return Ok(action);
    };
    let mut msg = Tensor::from_slice(&action.encode());
    g.broadcast(&mut msg, 0)?;
    Action::decode(&ints(&msg)?)
}

fn give_back(t: Tail) -> TailGroups {
    TailGroups {
        peers: t.peers.into_values().collect(),
        decider: t.decider,
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

/// Integers per migrant in the header: batch index, sample, prompt and token counts,
/// generator state, cache length (-1: none), owner.
const HEADER: usize = 7;

/// Sends migrants over a group of two in at most four messages whatever their number (each
/// message costs a round trip): the count, what they are (`GIFT` or `TAIL`) and the sizes of
/// the rest; every migrant's header, prompt and tokens as one integer tensor; their
/// log-probabilities as one float tensor; their caches as one tensor. Returns the bytes sent.
fn send_migrants(
    g: &ProcessGroup,
    moving: &[Migrant],
    owners: &[usize],
    kind: i64,
) -> Result<usize> {
    let to = peer(g);
    let mut ints: Vec<i64> = Vec::new();
    let mut logprobs: Vec<f32> = Vec::new();
    let mut caches: Vec<Tensor> = Vec::new();
    for (m, owner) in moving.iter().zip(owners) {
        let kv_len =
            m.kv.as_ref()
                .and_then(|(k, _)| k.first())
                .map_or(-1, |t| t.size().get(1).copied().unwrap_or(0));
        ints.extend_from_slice(&[
            m.batch_index as i64,
            m.sample_index as i64,
            m.prompt.len() as i64,
            m.tokens.len() as i64,
            m.rng as i64,
            kv_len,
            *owner as i64,
        ]);
        ints.extend_from_slice(&m.prompt);
        ints.extend_from_slice(&m.tokens);
        logprobs.extend_from_slice(&m.logprobs);
        if let Some((keys, values)) = &m.kv
            && kv_len > 0
        {
            caches.extend(keys.iter().chain(values).map(|t| t.reshape([-1])));
        }
    }
    // Through host memory: the groups are Gloo's (a GPU cache row lands on the receiver's
    // device in `KvCache::row_from_parts`).
    let cache = (!caches.is_empty()).then(|| Tensor::cat(&caches, 0).to_device(tch::Device::Cpu));
    let cache_len = cache.as_ref().map_or(0, |c| c.numel() as i64);
    let head = [
        moving.len() as i64,
        kind,
        ints.len() as i64,
        logprobs.len() as i64,
        cache_len,
    ];
    g.send(&Tensor::from_slice(&head), to, 0)?;
    let mut bytes = 8 * head.len();
    if !ints.is_empty() {
        g.send(&Tensor::from_slice(&ints), to, 1)?;
        bytes += 8 * ints.len();
    }
    if !logprobs.is_empty() {
        g.send(&Tensor::from_slice(&logprobs), to, 2)?;
        bytes += 4 * logprobs.len();
    }
    if let Some(c) = &cache {
        g.send(c, to, 3)?;
        bytes += c.numel() * c.kind().elt_size_in_bytes();
    }
    Ok(bytes)
}

/// Receives what `send_migrants` sent, the caches as `layout` (layers, key/value heads, head
/// width, kind) says. Returns them with their owners, what they are, and the bytes received;
/// sizes that do not add up are an error.
fn recv_migrants(
    g: &ProcessGroup,
    (layers, kv_heads, head_dim, kind): (usize, i64, i64, Kind),
) -> Result<(Vec<Owned>, i64, usize)> {
    let from = peer(g);
    let bad = |what: String| Error::invalid("migration", format!("rank {from}: {what}"));
    let cpu = tch::Device::Cpu;
    let mut head = Tensor::zeros([5], (Kind::Int64, cpu));
    g.recv(&mut head, from, 0)?;
    let head = ints(&head)?;
    let (count, what, n_ints, n_lp, n_cache) = (head[0], head[1], head[2], head[3], head[4]);
    let limit = 1i64 << 40;
    if !(0..=1 << 24).contains(&count)
        || [n_ints, n_lp, n_cache]
            .iter()
            .any(|n| !(0..limit).contains(n))
    {
        return Err(bad(format!(
            "announced {count} samples, sizes {n_ints}, {n_lp}, {n_cache}"
        )));
    }
    let mut all = Tensor::zeros([n_ints], (Kind::Int64, cpu));
    if n_ints > 0 {
        g.recv(&mut all, from, 1)?;
    }
    let mut lps = Tensor::zeros([n_lp], (Kind::Float, cpu));
    if n_lp > 0 {
        g.recv(&mut lps, from, 2)?;
    }
    let mut cache = Tensor::zeros([n_cache], (kind, cpu));
    if n_cache > 0 {
        g.recv(&mut cache, from, 3)?;
    }
    let bytes =
        40 + 8 * n_ints as usize + 4 * n_lp as usize + cache.numel() * kind.elt_size_in_bytes();
    let all = ints(&all)?;
    let lps = Vec::<f32>::try_from(&lps).map_err(Error::Torch)?;
    let (mut at, mut lp_at, mut kv_at) = (0usize, 0usize, 0i64);
    // The next `len` values of `from` at `*at` (moved past them), if there are as many.
    fn take<'a, T>(from: &'a [T], at: &mut usize, len: usize) -> Option<&'a [T]> {
        let part = from.get(*at..*at + len)?;
        *at += len;
        Some(part)
    }
    let mut out = Vec::with_capacity(count as usize);
    for i in 0..count {
        let h = take(&all, &mut at, HEADER)
            .ok_or_else(|| bad(format!("sample {i}'s header is cut")))?;
        let (plen, ntok, kv_len) = (h[2].max(0) as usize, h[3].max(0) as usize, h[5]);
        let (batch_index, sample_index, rng, owner) = (
            h[0].max(0) as usize,
            h[1].max(0) as usize,
            h[4] as u64,
            h[6].max(0) as usize,
        );
        let prompt = take(&all, &mut at, plen)
            .ok_or_else(|| bad(format!("sample {i}'s prompt is cut")))?
            .to_vec();
        let tokens = take(&all, &mut at, ntok)
            .ok_or_else(|| bad(format!("sample {i}'s tokens are cut")))?
            .to_vec();
        let logprobs = take(&lps, &mut lp_at, ntok)
            .ok_or_else(|| bad(format!("sample {i}'s log-probabilities are cut")))?
            .to_vec();
        let kv = if kv_len > 0 {
            let per = kv_heads * kv_len * head_dim;
            if kv_at + 2 * layers as i64 * per > n_cache {
                return Err(bad(format!("sample {i}'s cache is cut")));
            }
            let mut parts: Vec<Tensor> = (0..2 * layers as i64)
                .map(|l| {
                    cache
                        .narrow(0, kv_at + l * per, per)
                        .reshape([kv_heads, kv_len, head_dim])
                })
                .collect();
            kv_at += 2 * layers as i64 * per;
            let values = parts.split_off(layers);
            Some((parts, values))
        } else {
            None
        };
        out.push((
            Migrant {
                batch_index,
                sample_index,
                prompt,
                tokens,
                logprobs,
                rng,
                kv,
            },
            owner,
        ));
    }
    Ok((out, what, bytes))
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
        if let (Some(h), Some(s)) = (t.handover, self.tails.get_mut(&id))
            && let Some(r) = s.realloc.as_mut()
        {
            r.handover = Some(h);
        }
        if state.planned.is_none() {
            // Reallocation only: the plan does not migrate this generation.
            m.insert("migrate/reallocated".into(), t.reallocated as f64);
            return Ok(());
        }
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
        let Some(planned) = state.planned.filter(|_| !state.pinned) else {
            return Ok(());
        };
        let Some(tuner) = self.options.tail_tuner.clone() else {
            return Ok(());
        };
        let lengths: Vec<u64> = rollout.lengths().iter().map(|&l| l as u64).collect();
        let next = (tuner.0)(id, &lengths, planned.kept)
            .map_err(|e| Error::invalid("migration", format!("re-choosing R_t: {e}")))?;
        if let Some(s) = self.tails.get_mut(&id) {
            s.current = next.map(|(threshold, kept)| super::TailChoice {
                threshold,
                kept: kept.clamp(1, planned.kept),
            });
        }
        Ok(())
    }
}

/// The generations whose replicas exchange samples (`comm::reallocates`), with the plan's
/// migration choice (`None` where it does not migrate) and what decides reallocation before
/// the tail (`None` when `realloc` is off): started samples carry their KV cache when `kv`
/// says so, or, by default, when the cost model finds sending the plan's tail (or half a
/// replica's samples, without migration) cheaper than prefilling it again.
pub(super) fn tail_states(
    exec: &braid_ir::exec_plan::ExecPlan,
    kv: Option<bool>,
    gen_lengths: bool,
    realloc: bool,
) -> Result<BTreeMap<braid_ir::graph::NodeId, super::TailState>> {
    use braid_ir::graph::Op;
    let mut out = BTreeMap::new();
    for id in exec.plan.graph.node_ids() {
        if !super::comm::reallocates(exec, id) {
            continue;
        }
        let Some(Op::Generate { model, params }) = exec.plan.graph.node(id).map(|n| &n.op) else {
            continue;
        };
        let Some(shape) = exec.shapes.get(*model as usize) else {
            continue;
        };
        let m = exec.decisions.migrations.get(&id);
        if m.is_none() && !realloc {
            continue;
        }
        // A draft model's cache would have to move with the samples (`--gen-lengths` turns
        // speculation off).
        if !gen_lengths
            && matches!(
                exec.speculation(id),
                braid_ir::graph::Speculation::Draft { .. }
            )
        {
            if m.is_some() {
                return Err(Error::invalid(
                    "plan",
                    format!(
                        "{id} migrates its tail and drafts with a draft model, whose cache does \
                         not migrate; pin `migrate off` or another `speculate` mode"
                    ),
                ));
            }
            // Said at start by `braid run`: no reallocation for it.
            continue;
        }
        let max_new = params.max_new_tokens.max(1) as u64;
        let dp = exec.placement(id).map_or(1, |p| p.dp.max(1));
        let moving = match m {
            Some(m) => m.threshold,
            None => super::comm::generation_size(exec, id)
                .map_or(1, |(p, n)| (p * n) as u64 / dp / 2)
                .max(1),
        };
        let kv = kv.unwrap_or_else(|| {
            carry_kv(
                &exec.cost_model(),
                shape,
                moving,
                exec.workload.prompt_len + max_new / 2,
                exec.cluster.nodes > 1,
            )
        });
        let planned = m.map(|m| super::TailChoice {
            threshold: m.threshold,
            kept: m.to_instances,
        });
        out.insert(
            id,
            super::TailState {
                current: planned,
                planned,
                pinned: m.is_some_and(|m| m.pinned),
                kv,
                realloc: realloc.then(|| Realloc::for_plan(exec, shape, max_new, exec.seed)),
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
            handover: None,
        }
    }

    /// A line through a generation's plain steps: their fixed cost and cost per row; none from
    /// too few steps or from steps that all had the same rows.
    #[test]
    fn measured_steps_fit_a_line_in_the_rows() {
        use crate::generation::spec::StepRecord;
        let step = |rows: usize, secs: f64| StepRecord {
            rows,
            secs,
            ..StepRecord::default()
        };
        let log: Vec<StepRecord> = (1..=16)
            .map(|b| step(b, 0.002 + 0.0005 * b as f64))
            .collect();
        let (fixed, per_row) = measured_step(&log).unwrap();
        assert!((fixed - 0.002).abs() < 1e-9 && (per_row - 0.0005).abs() < 1e-9);
        assert_eq!(measured_step(&log[..7]), None);
        assert_eq!(measured_step(&vec![step(8, 0.01); 20]), None);
        let mut drafted = log.clone();
        for r in &mut drafted {
            r.draft_len = 4;
        }
        assert_eq!(measured_step(&drafted), None);
    }

    /// Reallocation pays where splitting the batch shortens the decode steps (half the KV
    /// reads, and at a large batch half the compute, on the other device) by more than the
    /// hand-over costs over the tokens expected to remain; not when little work remains, and
    /// not for a single sample.
    #[test]
    fn reallocation_gives_half_only_where_the_cost_model_says_it_pays() {
        let long: Vec<u64> = (1..=512).collect();
        let r = realloc("1x8xH100", long.clone());
        assert_eq!(r.donation(1024, &vec![10; 1024], true, None, None), 512);
        assert_eq!(r.donation(4, &[10; 4], true, None, None), 2);
        assert_eq!(r.donation(1, &[10], true, None, None), 0);
        // Every sample is about to end: nothing to gain.
        let short = realloc("1x8xH100", vec![11; 512]);
        assert_eq!(short.donation(1024, &vec![10; 1024], true, None, None), 0);
        assert_eq!(short.donation(4, &[10; 4], false, None, None), 0);
        // Measured steps decide where there are some: steps whose time does not grow with the
        // rows (a tiny model's fixed costs) gain nothing from splitting the batch; steps that
        // grow by a millisecond a row do.
        assert_eq!(r.donation(16, &[10; 16], true, Some((2e-3, 0.0)), None), 0);
        assert_eq!(r.donation(16, &[10; 16], true, Some((2e-3, 1e-3)), None), 8);
        // A hand-over measured slower than what splitting saves: nothing given.
        assert_eq!(
            r.donation(16, &[10; 16], true, Some((2e-3, 1e-3)), Some(10.0)),
            0
        );
        // Expected remaining tokens from the lengths above what a sample has.
        assert!((r.remaining(0) - 256.5).abs() < 1e-9);
        assert!((r.remaining(500) - 6.5).abs() < 1e-9);
        assert_eq!(short.remaining(20), 1.0);
    }
}
