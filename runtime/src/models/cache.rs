//! The key/value cache of a batch of sequences being decoded.
//!
//! Layout: per layer, keys and values of shape `[rows, kv_heads, capacity, head_dim]`, and one
//! length per row. Row `r` holds valid entries at positions `0..len(r)`; entries at or beyond
//! `len(r)` are stale and always masked out by the attention mask, which is what makes three
//! things cheap: right-padded batched prefill (pad tokens leave stale entries past the row's
//! length), rows of different lengths in one batch (continuous batching), and rolling a row
//! back (speculative decoding: `truncate` only lowers the length). The cache position of a
//! token equals its position id. This module must not run the model; `Model::forward_cached`
//! writes into it.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// Growth granularity of the cache capacity, in positions: growing re-allocates every layer, so
/// it grows in steps rather than per token.
const CAPACITY_STEP: i64 = 64;

/// Keys and values of a batch of sequences, one row per sequence.
pub struct KvCache {
    pub(crate) keys: Vec<Tensor>,
    pub(crate) values: Vec<Tensor>,
    lens: Vec<i64>,
    capacity: i64,
    kv_heads: i64,
    head_dim: i64,
    kind: Kind,
    device: Device,
}

impl KvCache {
    /// An empty cache of `rows` rows for a model of the given shape.
    pub fn new(
        layers: usize,
        kv_heads: i64,
        head_dim: i64,
        rows: usize,
        kind: Kind,
        device: Device,
    ) -> Self {
        let rows_i = i64::try_from(rows).unwrap_or(i64::MAX);
        let make = || Tensor::zeros([rows_i, kv_heads, 0, head_dim], (kind, device));
        KvCache {
            keys: (0..layers).map(|_| make()).collect(),
            values: (0..layers).map(|_| make()).collect(),
            lens: vec![0; rows],
            capacity: 0,
            kv_heads,
            head_dim,
            kind,
            device,
        }
    }

    /// Number of rows (sequences).
    pub fn rows(&self) -> usize {
        self.lens.len()
    }

    /// The valid length of every row.
    pub fn lens(&self) -> &[i64] {
        &self.lens
    }

    /// The element type of keys and values: the model's dtype.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Positions allocated per row.
    pub fn capacity(&self) -> i64 {
        self.capacity
    }

    /// Rolls row `row` back to `len` positions (speculative decoding rejects drafted tokens
    /// this way). The entries past `len` become stale and are overwritten by later appends.
    pub fn truncate(&mut self, row: usize, len: i64) -> Result<()> {
        match self.lens.get_mut(row) {
            Some(l) if len >= 0 && len <= *l => {
                *l = len;
                Ok(())
            }
            Some(l) => Err(Error::invalid(
                "KvCache::truncate",
                format!("length {len} outside 0..={l}"),
            )),
            None => Err(Error::invalid("KvCache::truncate", format!("no row {row}"))),
        }
    }

    pub(crate) fn advance(&mut self, valid: &[i64]) {
        for (l, v) in self.lens.iter_mut().zip(valid) {
            *l += v;
        }
    }

    /// Makes room for `needed` positions per row.
    pub(crate) fn reserve(&mut self, needed: i64) {
        if needed <= self.capacity {
            return;
        }
        let want = needed.max(self.capacity * 2);
        let new_cap = (want + CAPACITY_STEP - 1) / CAPACITY_STEP * CAPACITY_STEP;
        let extra = new_cap - self.capacity;
        let rows = self.rows() as i64;
        let pad = Tensor::zeros(
            [rows, self.kv_heads, extra, self.head_dim],
            (self.kind, self.device),
        );
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            *t = Tensor::cat(&[&*t, &pad], 2);
        }
        self.capacity = new_cap;
    }

    /// Keeps only the listed rows, in the listed order (finished sequences leave the batch).
    pub fn retain_rows(&mut self, keep: &[usize]) {
        if keep.len() == self.rows() && keep.iter().enumerate().all(|(i, &r)| i == r) {
            return;
        }
        let idx: Vec<i64> = keep.iter().map(|&r| r as i64).collect();
        let idx = Tensor::from_slice(&idx).to_device(self.device);
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            *t = t.index_select(0, &idx);
        }
        self.lens = keep.iter().map(|&r| self.lens[r]).collect();
    }

    /// Row `row`'s valid keys and values, one `[kv_heads, len, head_dim]` tensor per layer
    /// each: what a migrated sample carries to another engine.
    pub fn row_parts(&self, row: usize) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let Some(&len) = self.lens.get(row) else {
            return Err(Error::invalid(
                "KvCache::row_parts",
                format!("no row {row}"),
            ));
        };
        let part = |t: &Tensor| t.get(row as i64).narrow(1, 0, len).contiguous();
        Ok((
            self.keys.iter().map(part).collect(),
            self.values.iter().map(part).collect(),
        ))
    }

    /// A one-row cache holding `keys` and `values` (one `[kv_heads, len, head_dim]` tensor per
    /// layer each, as [`KvCache::row_parts`] gives them), for a model whose caches have this
    /// one's layers, heads and kind: a migrated sample's row, ready for [`KvCache::push_rows`].
    pub fn row_from_parts(&self, keys: Vec<Tensor>, values: Vec<Tensor>) -> Result<KvCache> {
        let bad = |what: String| Err(Error::invalid("a migrated sample's KV cache", what));
        if keys.len() != self.keys.len() || values.len() != self.values.len() {
            return bad(format!(
                "{} layers of keys and {} of values, the model has {}",
                keys.len(),
                values.len(),
                self.keys.len()
            ));
        }
        let len = keys
            .first()
            .map_or(0, |k| k.size().get(1).copied().unwrap_or(0));
        for t in keys.iter().chain(&values) {
            if t.size() != [self.kv_heads, len, self.head_dim] {
                return bad(format!(
                    "a layer of shape {:?}, expected [{}, {len}, {}]",
                    t.size(),
                    self.kv_heads,
                    self.head_dim
                ));
            }
        }
        let up = |t: Tensor| t.to_kind(self.kind).to_device(self.device).unsqueeze(0);
        Ok(KvCache {
            keys: keys.into_iter().map(up).collect(),
            values: values.into_iter().map(up).collect(),
            lens: vec![len],
            capacity: len,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            kind: self.kind,
            device: self.device,
        })
    }

    /// Layers, key/value heads and the head width.
    pub fn layout(&self) -> (usize, i64, i64) {
        (self.keys.len(), self.kv_heads, self.head_dim)
    }

    /// Appends copies of rows of `src` (a row may be listed several times: the `n` samples of a
    /// prompt share one prefill this way).
    pub fn push_rows(&mut self, src: &KvCache, src_rows: &[usize]) {
        if src_rows.is_empty() {
            return;
        }
        let longest = src_rows.iter().map(|&r| src.lens[r]).max().unwrap_or(0);
        self.reserve(longest);
        let idx: Vec<i64> = src_rows.iter().map(|&r| r as i64).collect();
        let idx = Tensor::from_slice(&idx).to_device(self.device);
        let take = src.capacity.min(self.capacity);
        let n = src_rows.len() as i64;
        for (dst, s) in self
            .keys
            .iter_mut()
            .zip(&src.keys)
            .chain(self.values.iter_mut().zip(&src.values))
        {
            let rows = s.index_select(0, &idx).narrow(2, 0, take);
            let rows = if take < self.capacity {
                let pad = Tensor::zeros(
                    [n, self.kv_heads, self.capacity - take, self.head_dim],
                    (self.kind, self.device),
                );
                Tensor::cat(&[&rows, &pad], 2)
            } else {
                rows
            };
            *dst = Tensor::cat(&[&*dst, &rows], 0);
        }
        self.lens.extend(src_rows.iter().map(|&r| src.lens[r]));
    }
}
