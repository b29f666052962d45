//! The values that flow along the task graph's edges during a step: prompts, rollouts,
//! per-token and per-sample numbers, and losses waiting for their `train`.

use super::*;

/// One generated sample with its prompt.
#[derive(Debug, Clone)]
pub(super) struct GenSample {
    pub(super) prompt_index: usize,
    pub(super) rollout: Rollout,
    pub(super) text: String,
}

/// A finished rollout, samples ordered by (prompt, sample).
#[derive(Debug)]
pub(super) struct RolloutData {
    pub(super) samples: Vec<GenSample>,
    pub(super) records: Vec<Record>,
    /// The temperature the log-probabilities of this rollout are computed at.
    pub(super) temperature: f64,
}

impl RolloutData {
    pub(super) fn lengths(&self) -> Vec<usize> {
        self.samples
            .iter()
            .map(|s| s.rollout.completion.len())
            .collect()
    }
}

/// Per-token values of a rollout: values plus offsets (sample i is `offsets[i]..offsets[i+1]`).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Tokens {
    pub(super) values: Vec<f64>,
    pub(super) offsets: Vec<usize>,
}

impl Tokens {
    pub(super) fn from_rows(rows: &[Vec<f32>]) -> Tokens {
        let mut values = Vec::new();
        let mut offsets = vec![0];
        for r in rows {
            values.extend(r.iter().map(|&x| f64::from(x)));
            offsets.push(values.len());
        }
        Tokens { values, offsets }
    }

    pub(super) fn row(&self, i: usize) -> &[f64] {
        &self.values[self.offsets[i]..self.offsets[i + 1]]
    }
}

/// An input of a loss's objective, resolved.
#[derive(Debug, Clone)]
pub(super) enum LossArg {
    Tokens(Tokens),
    Samples(Vec<f64>),
    /// The trained model's own log-probabilities before its update, taken (detached) from the
    /// training forward pass: see `Executor::reused`.
    CurrentLogp,
}

/// A loss waiting for its `train`: the objective (from the plan) and its inputs.
#[derive(Debug, Clone)]
pub(super) struct LossTerm {
    pub(super) node: NodeId,
    pub(super) args: Vec<LossArg>,
}

#[derive(Debug)]
pub(super) enum Val {
    Prompts {
        records: Vec<Record>,
        chat_template: bool,
    },
    Rollout(Arc<RolloutData>),
    PerToken(Tokens),
    PerSample(Vec<f64>),
    Loss(LossTerm),
    Unit,
}

#[derive(Debug, Clone)]
pub(super) enum PerSampleOut {
    Tokens(Vec<f32>),
    Scalar(f32),
}

/// An inference node's value from its per-sample results: one number per sample for `score`,
/// per-token values otherwise.
pub(super) fn collect_rows(op: &Op, rows: Vec<PerSampleOut>) -> Val {
    if let Op::Score { .. } = op {
        return Val::PerSample(
            rows.into_iter()
                .map(|r| match r {
                    PerSampleOut::Scalar(x) => f64::from(x),
                    PerSampleOut::Tokens(_) => 0.0,
                })
                .collect(),
        );
    }
    let rows: Vec<Vec<f32>> = rows
        .into_iter()
        .map(|r| match r {
            PerSampleOut::Tokens(t) => t,
            PerSampleOut::Scalar(x) => vec![x],
        })
        .collect();
    Val::PerToken(Tokens::from_rows(&rows))
}

pub(super) fn rollout_of(
    vals: &BTreeMap<NodeId, Val>,
    id: Option<&NodeId>,
) -> Result<Arc<RolloutData>> {
    match id.and_then(|i| vals.get(i)) {
        Some(Val::Rollout(r)) => Ok(r.clone()),
        _ => Err(Error::invalid("plan", "input 0 is not a rollout")),
    }
}
