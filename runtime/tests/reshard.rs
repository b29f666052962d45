//! Parameter reallocation on 4 Gloo ranks: every reshard between layouts drawn from
//! {dp 1–2, tp 1–2, pp 1–2}, on overlapping and disjoint meshes, run from the planner's own
//! transfer plan (`plan_reshard`), leaves every rank with exactly its slices of the whole
//! weights under the destination layout, bit for bit. The harness is `ranks/`.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod ranks;

use std::time::Duration;

use braid_cost::cost::ModelShape;
use braid_ir::exec_plan::Placement;
use braid_ir::settings::Head;
use braid_ir::transfer::{Param, dims, params, plan_reshard};
use braid_runtime::exec::realloc::{cut, run_plan, slices_of};
use ranks::{Ranks, child_rank, serial, world_group};
use tch::{Device, Kind, Tensor};

/// A small Llama-family shape whose vocabulary (97) no tensor-parallel degree divides.
fn shape(tied: bool) -> ModelShape {
    ModelShape {
        name: "reshard-test".into(),
        layers: 2,
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        intermediate: 64,
        vocab: 97,
        tied_embeddings: tied,
        declared_params: None,
    }
}

/// The whole parameter `p`, the same on every rank: seeded normal values.
fn whole(shape: &ModelShape, head: Head, p: Param) -> Tensor {
    let index = params(shape, head).iter().position(|q| *q == p).unwrap();
    tch::manual_seed(1000 + index as i64);
    let (r, c) = dims(shape, p);
    Tensor::randn([r as i64, c as i64], (Kind::Float, Device::Cpu))
}

/// Every placement of a layout with dp, tp, pp in 1..=2 on 4 devices, at offsets that give
/// both overlapping and disjoint pairs.
fn placements() -> Vec<Placement> {
    let mut out = Vec::new();
    for dp in 1..=2u64 {
        for tp in 1..=2u64 {
            for pp in 1..=2u64 {
                let count = dp * tp * pp;
                if count > 4 {
                    continue;
                }
                for first in (0..=4 - count).step_by(count as usize) {
                    out.push(Placement {
                        first,
                        count,
                        dp,
                        tp,
                        pp,
                        microbatches: 1,
                    });
                }
            }
        }
    }
    out
}

fn name(p: &Placement) -> String {
    format!(
        "dp {} tp {} pp {} on {}..{}",
        p.dp,
        p.tp,
        p.pp,
        p.first,
        p.first + p.count
    )
}

fn reshards_rank(rank: usize) {
    tch::set_num_threads(1);
    let world = world_group(Duration::from_secs(60), Duration::from_millis(200));
    let all = placements();
    let mut runs = 0;
    for (head, tied) in [(Head::Lm, false), (Head::Lm, true), (Head::Value, false)] {
        let shape = shape(tied);
        let full = |p: Param| Ok(whole(&shape, head, p));
        for from in &all {
            for to in &all {
                if from == to {
                    continue;
                }
                let plan = plan_reshard(&shape, head, from, to);
                let held = slices_of(&shape, head, from, rank as u64, &full).unwrap();
                let got = run_plan(&plan, &shape, head, from, to, &world, held, Kind::Float)
                    .unwrap_or_else(|e| panic!("{} → {}: {e}", name(from), name(to)));
                let want = slices_of(&shape, head, to, rank as u64, &full).unwrap();
                assert_eq!(
                    got.keys().collect::<Vec<_>>(),
                    want.keys().collect::<Vec<_>>(),
                    "{} → {}: rank {rank} holds other slices",
                    name(from),
                    name(to)
                );
                for (s, t) in &want {
                    assert!(
                        got[s].equal(t),
                        "{} → {}: rank {rank}'s {s:?} differs",
                        name(from),
                        name(to)
                    );
                    assert!(cut(&whole(&shape, head, s.param), s).unwrap().equal(t));
                }
                runs += 1;
            }
        }
    }
    println!("rank {rank}: {runs} reshards exact");
}

#[test]
fn every_reshard_between_small_layouts_on_4_ranks_is_exact() {
    if let Some(rank) = child_rank() {
        return reshards_rank(rank);
    }
    let _serial = serial();
    let mut ranks = Ranks::spawn(
        "every_reshard_between_small_layouts_on_4_ranks_is_exact",
        4,
        &[],
    );
    ranks.expect_all_success(Duration::from_secs(600));
    assert!(
        ranks.output(0).contains("reshards exact"),
        "{}",
        ranks.all_output()
    );
}
