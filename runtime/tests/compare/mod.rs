//! What the tests comparing a parallel model with one process share: the fixture models, the
//! agreement tolerance and the distance they measure.
#![allow(dead_code)] // Each test binary uses part of it.

use std::path::PathBuf;

use braid_runtime::{Head, LoadOptions, Model};
use tch::{Kind, Tensor};

/// Agreement in f32: at most 1e-5 apart, relative to the reference tensor's largest magnitude
/// where that exceeds 1 (sums in another order differ by a few ulps of their size).
pub const TOLERANCE: f64 = 1e-5;

/// A fixture model directory of this crate (made by `scripts/make_fixtures.py`).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Fixture `name` with `head`, in f32 on the CPU.
pub fn load(name: &str, head: Head) -> Model {
    let options = LoadOptions {
        head,
        ..LoadOptions::default()
    };
    Model::load(&fixture(name), &options).expect("a fixture model loads")
}

/// The largest difference of `b` from the reference `a`, scaled by `a`'s largest magnitude
/// where that exceeds 1.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    let a = a.to_kind(Kind::Double);
    let scale = a.abs().max().double_value(&[]).max(1.0);
    (a - b.to_kind(Kind::Double)).abs().max().double_value(&[]) / scale
}
