#!/usr/bin/env python3
"""Compares the metrics of two sets of runs, as dumped by `tests/run.rs` with
`BRAID_TEST_METRICS_DIR=DIR cargo test --test run`: for every run present in both
directories, every non-timing metric of every step. Prints each difference and exits with
status 1 when any value differs by more than `--tol` (default 0: bit-identical)."""

import argparse
import json
import pathlib
import sys


def load(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def comparable(key):
    return not key.startswith("time/") and key != "tokens_per_s"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("before", type=pathlib.Path)
    ap.add_argument("after", type=pathlib.Path)
    ap.add_argument("--tol", type=float, default=0.0)
    args = ap.parse_args()
    worst = 0.0
    failed = False
    names = sorted(p.name for p in args.before.glob("*.jsonl"))
    for name in names:
        b = args.before / name
        a = args.after / name
        if not a.exists():
            print(f"{name}: missing after")
            failed = True
            continue
        lb, la = load(b), load(a)
        if len(lb) != len(la):
            print(f"{name}: {len(lb)} steps before, {len(la)} after")
            failed = True
            continue
        diffs = 0
        for step, (x, y) in enumerate(zip(lb, la), 1):
            for k in sorted(set(x) | set(y)):
                if not comparable(k):
                    continue
                if k not in x or k not in y:
                    print(f"{name} step {step}: `{k}` only {'before' if k in x else 'after'}")
                    failed = True
                    continue
                d = abs(x[k] - y[k])
                worst = max(worst, d)
                if d > args.tol or (args.tol == 0.0 and x[k] != y[k]):
                    diffs += 1
                    print(f"{name} step {step}: {k} {x[k]!r} -> {y[k]!r} (|d| = {d:.3g})")
                    failed = True
        print(f"{name}: {len(lb)} steps, {'same' if diffs == 0 else f'{diffs} differences'}")
    print(f"largest difference: {worst:.3g}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
