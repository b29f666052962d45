#!/usr/bin/env python3
"""Reference values of the standard library's newer losses, written from their papers'
formulas with NumPy, independently of Braid: the loss of a mini-batch and its gradient with
respect to every token's log-probability, derived by hand (CISPO's weight is a constant for
the gradient, so a numerical derivative would not do).

Reads one JSON object on stdin:
  {"loss": "gspo" | "dapo" | "cispo", "lengths": [...], "logp": [...], "old_logp": [...],
   "adv": [...] (one per sample), "clip_low": x, "clip_high": y}
and prints {"loss": L, "grad": [...]}. Used by runtime/tests/losses.rs."""

import json
import sys

import numpy as np


def segments(lengths):
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    return [(int(s), int(s + n)) for s, n in zip(starts, lengths)]


def gspo(logp, old, adv, lengths, lo, hi):
    """GSPO (Zheng et al., 2025): s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), and
    J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - lo, 1 + hi) A_i); the loss is -J."""
    n = len(lengths)
    loss = 0.0
    grad = np.zeros_like(logp)
    for i, (a, b) in enumerate(segments(lengths)):
        s = np.exp(np.sum(logp[a:b] - old[a:b]) / (b - a))
        clipped = min(max(s, 1.0 - lo), 1.0 + hi)
        unclipped_term = s * adv[i]
        clipped_term = clipped * adv[i]
        loss += -min(unclipped_term, clipped_term) / n
        # d s / d logp_t = s / |y_i|; the clipped branch is flat outside the range.
        inside = 1.0 - lo < s < 1.0 + hi
        if unclipped_term < clipped_term or inside:
            grad[a:b] = -adv[i] * s / (b - a) / n
    return loss, grad


def dapo(logp, old, adv_tok, lo, hi):
    """DAPO (Yu et al., 2025): J = 1/sum|o_i| sum_i sum_t min(r A, clip(r, 1 - lo, 1 + hi) A),
    token-level over the whole batch; the loss is -J."""
    t = len(logp)
    r = np.exp(logp - old)
    clipped = np.clip(r, 1.0 - lo, 1.0 + hi)
    unclipped_term = r * adv_tok
    clipped_term = clipped * adv_tok
    loss = -np.sum(np.minimum(unclipped_term, clipped_term)) / t
    active = (unclipped_term < clipped_term) | ((r > 1.0 - lo) & (r < 1.0 + hi))
    grad = np.where(active, -adv_tok * r / t, 0.0)
    return loss, grad


def cispo(logp, old, adv_tok, lo, hi):
    """CISPO (MiniMax-M1, 2025): J = 1/sum|o_i| sum_i sum_t sg(clip(r, 1 - lo, 1 + hi)) A log pi;
    the weight is a constant for the gradient; the loss is -J."""
    t = len(logp)
    w = np.clip(np.exp(logp - old), 1.0 - lo, 1.0 + hi)
    loss = -np.sum(w * adv_tok * logp) / t
    grad = -w * adv_tok / t
    return loss, grad


def main():
    q = json.load(sys.stdin)
    lengths = np.array(q["lengths"], dtype=np.int64)
    logp = np.array(q["logp"], dtype=np.float64)
    old = np.array(q["old_logp"], dtype=np.float64)
    adv = np.array(q["adv"], dtype=np.float64)
    adv_tok = np.repeat(adv, lengths)
    lo, hi = q["clip_low"], q["clip_high"]
    if q["loss"] == "gspo":
        loss, grad = gspo(logp, old, adv, lengths, lo, hi)
    elif q["loss"] == "dapo":
        loss, grad = dapo(logp, old, adv_tok, lo, hi)
    elif q["loss"] == "cispo":
        loss, grad = cispo(logp, old, adv_tok, lo, hi)
    else:
        sys.exit(f"unknown loss {q['loss']!r}")
    json.dump({"loss": float(loss), "grad": [float(g) for g in grad]}, sys.stdout)


if __name__ == "__main__":
    main()
