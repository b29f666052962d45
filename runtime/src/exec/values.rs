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

/// How a sample finished, as a number for the wire.
pub(super) fn finish_code(f: &FinishReason) -> i64 {
    match f {
        FinishReason::Eos => 0,
        FinishReason::Stop => 1,
        FinishReason::Length => 2,
    }
}

pub(super) fn finish_of(code: i64) -> FinishReason {
    match code {
        0 => FinishReason::Eos,
        1 => FinishReason::Stop,
        _ => FinishReason::Length,
    }
}

/// A little-endian byte writer for the values ranks exchange.
#[derive(Default)]
struct Wire(Vec<u8>);

impl Wire {
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn i64s(&mut self, xs: &[i64]) {
        self.u64(xs.len() as u64);
        for x in xs {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    fn f32s(&mut self, xs: &[f32]) {
        self.u64(xs.len() as u64);
        for x in xs {
            self.0.extend_from_slice(&x.to_bits().to_le_bytes());
        }
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
}

/// Reads what [`Wire`] wrote; a short or malformed buffer is an error, never a panic.
struct Unwire<'a>(&'a [u8]);

impl Unwire<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(Error::invalid("exchange", "a peer's message is cut short"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self, elem: usize) -> Result<usize> {
        let n = self.u64()? as usize;
        if n.saturating_mul(elem) > self.0.len() {
            return Err(Error::invalid("exchange", "a peer's message is cut short"));
        }
        Ok(n)
    }
    fn i64s(&mut self) -> Result<Vec<i64>> {
        let n = self.len(8)?;
        (0..n).map(|_| self.u64().map(|x| x as i64)).collect()
    }
    fn f32s(&mut self) -> Result<Vec<f32>> {
        let n = self.len(4)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.take(4)?;
            let mut a = [0u8; 4];
            a.copy_from_slice(b);
            out.push(f32::from_bits(u32::from_le_bytes(a)));
        }
        Ok(out)
    }
    fn bytes(&mut self) -> Result<Vec<u8>> {
        let n = self.len(1)?;
        Ok(self.take(n)?.to_vec())
    }
}

/// Samples (with their index in the rollout) as bytes for another rank.
pub fn encode_samples(samples: &[(usize, Sample)]) -> Vec<u8> {
    let mut w = Wire::default();
    w.u64(samples.len() as u64);
    for (i, s) in samples {
        w.u64(*i as u64);
        w.u64(s.prompt_index as u64);
        w.u64(s.sample_index as u64);
        w.u64(finish_code(&s.finish) as u64);
        w.i64s(&s.token_ids);
        w.f32s(&s.logprobs);
        w.bytes(s.text.as_bytes());
    }
    w.0
}

/// The samples [`encode_samples`] wrote; a cut or malformed buffer is an error.
pub fn decode_samples(b: &[u8]) -> Result<Vec<(usize, Sample)>> {
    let mut r = Unwire(b);
    let n = r.len(1)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let i = r.u64()? as usize;
        let prompt_index = r.u64()? as usize;
        let sample_index = r.u64()? as usize;
        let finish = finish_of(r.u64()? as i64);
        let token_ids = r.i64s()?;
        let logprobs = r.f32s()?;
        let text = String::from_utf8(r.bytes()?)
            .map_err(|e| Error::invalid("exchange", format!("a sample's text: {e}")))?;
        out.push((
            i,
            Sample {
                prompt_index,
                sample_index,
                token_ids,
                logprobs,
                text,
                finish,
            },
        ));
    }
    Ok(out)
}

/// Per-sample inference results (with their sample's index) as bytes for another rank.
pub(super) fn encode_rows(rows: &[(usize, PerSampleOut)]) -> Vec<u8> {
    let mut w = Wire::default();
    w.u64(rows.len() as u64);
    for (i, r) in rows {
        w.u64(*i as u64);
        match r {
            PerSampleOut::Tokens(t) => {
                w.u64(0);
                w.f32s(t);
            }
            PerSampleOut::Scalar(x) => {
                w.u64(1);
                w.f32s(&[*x]);
            }
        }
    }
    w.0
}

pub(super) fn decode_rows(b: &[u8]) -> Result<Vec<(usize, PerSampleOut)>> {
    let mut r = Unwire(b);
    let n = r.len(1)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let i = r.u64()? as usize;
        let kind = r.u64()?;
        let v = r.f32s()?;
        out.push((
            i,
            match kind {
                0 => PerSampleOut::Tokens(v),
                _ => PerSampleOut::Scalar(v.first().copied().unwrap_or(0.0)),
            },
        ));
    }
    Ok(out)
}

/// Several messages as one, each kept whole: what one exchange among the ranks carries where
/// it would otherwise take one exchange (one or two collectives) per message.
pub(super) fn encode_parts(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut w = Wire::default();
    w.u64(parts.len() as u64);
    for p in parts {
        w.bytes(p);
    }
    w.0
}

/// The messages [`encode_parts`] wrote; a cut or malformed buffer is an error.
pub(super) fn decode_parts(b: &[u8]) -> Result<Vec<Vec<u8>>> {
    let mut r = Unwire(b);
    let n = r.len(8)?;
    (0..n).map(|_| r.bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cross_the_wire_whole() {
        let parts = vec![vec![1u8, 2, 3], Vec::new(), vec![9u8; 17]];
        let bytes = encode_parts(&parts);
        assert_eq!(decode_parts(&bytes).unwrap(), parts);
        assert!(decode_parts(&bytes[..bytes.len() - 1]).is_err());
        assert_eq!(
            decode_parts(&encode_parts(&[])).unwrap(),
            Vec::<Vec<u8>>::new()
        );
    }

    #[test]
    fn samples_and_rows_cross_the_wire_unchanged() {
        let s = Sample {
            prompt_index: 3,
            sample_index: 1,
            token_ids: vec![1, -2, 300],
            logprobs: vec![-0.5, f32::MIN_POSITIVE, -0.0],
            text: "héllo".into(),
            finish: FinishReason::Length,
        };
        let bytes = encode_samples(&[(7, s.clone())]);
        assert_eq!(decode_samples(&bytes).unwrap(), vec![(7, s)]);
        assert!(decode_samples(&bytes[..bytes.len() - 1]).is_err());
        let rows = vec![
            (0, PerSampleOut::Tokens(vec![1.5, -3.25])),
            (2, PerSampleOut::Scalar(0.125)),
        ];
        let back = decode_rows(&encode_rows(&rows)).unwrap();
        assert_eq!(format!("{back:?}"), format!("{rows:?}"));
        assert!(decode_rows(&[1, 2, 3]).is_err());
    }
}
