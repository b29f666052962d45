//! Real-valued problems: what `braid sim pipeline` reads. Profiled durations and memory are
//! fractional (`"fwd": 0.37`, `"mem_per_microbatch": 1.95`), while the solver works on integer
//! ticks so that its comparisons and its stop at the lower bound are exact. A [`PipelineSpec`]
//! is converted to a [`PipelineProblem`] on a decimal grid that represents every input value
//! exactly where one exists (10^d ticks per unit, d ≤ 6: integers stay integers, `1.95`
//! becomes 195 hundredths), and the solver's answer is converted back
//! ([`RealSchedule`]). Values with more than six decimals are rounded to millionths, and
//! [`Grid::rounded`] says so.

use serde::{Deserialize, Serialize};

use super::{
    DeviceSchedule, FusedSchedule, Kind, PipelineModel, PipelineProblem, ProblemError,
    SearchOptions, SearchStats,
};

/// One trained model of a real-valued problem (the fields of [`PipelineModel`]).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub pp: usize,
    pub microbatches: usize,
    /// Per-stage forward and backward durations, in any time unit.
    pub fwd: f64,
    pub bwd: f64,
    /// Activation memory a stage holds per micro-batch, in any unit.
    #[serde(default = "one")]
    pub mem_per_microbatch: f64,
}

fn one() -> f64 {
    1.0
}

/// A problem with real-valued durations and memory (the JSON `braid sim pipeline` reads).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    pub stages: usize,
    pub models: Vec<ModelSpec>,
    #[serde(default)]
    pub search: SearchOptions,
}

/// How a spec's values map to the solver's ticks: `value = ticks / per_unit`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Grid {
    pub time_ticks_per_unit: u64,
    pub memory_ticks_per_unit: u64,
    /// Some value had more than six decimals and was rounded to the nearest millionth.
    pub rounded: bool,
}

/// The largest value a tick count may take (the solver's own cap on durations).
const MAX_TICKS: f64 = (1u64 << 40) as f64;

/// The finest decimal grid needed: the smallest `10^d` (d ≤ 6) on which every value is an
/// integer, within a relative 1e-9 (binary fractions of decimals are not exact), and whether
/// some value had to be rounded. The grid is coarsened when the largest value would exceed the
/// solver's range.
fn decimal_grid(values: &[f64]) -> (u64, bool) {
    let largest = values.iter().copied().fold(0.0, f64::max);
    let on_grid = |scale: f64| {
        values.iter().all(|&v| {
            let t = v * scale;
            (t - t.round()).abs() <= 1e-9 * t.abs().max(1.0)
        })
    };
    let mut scale = 1u64;
    for _ in 0..=6 {
        if largest * scale as f64 > MAX_TICKS {
            return (scale / 10, true);
        }
        if on_grid(scale as f64) {
            return (scale, false);
        }
        scale *= 10;
    }
    (scale / 10, true)
}

impl PipelineSpec {
    /// Parses and validates a spec from JSON text.
    pub fn from_json(text: &str) -> Result<PipelineSpec, ProblemError> {
        serde_json::from_str(text).map_err(|e| ProblemError(e.to_string()))
    }

    /// The integer problem the solver runs, and its grid. Every duration and memory figure must
    /// be positive and finite; the shape rules are [`PipelineProblem::validate`]'s.
    pub fn to_problem(&self) -> Result<(PipelineProblem, Grid), ProblemError> {
        for (i, m) in self.models.iter().enumerate() {
            for (field, v) in [
                ("fwd", m.fwd),
                ("bwd", m.bwd),
                ("mem_per_microbatch", m.mem_per_microbatch),
            ] {
                if !v.is_finite() || v <= 0.0 {
                    return Err(ProblemError(format!(
                        "models[{i}].{field} must be a positive number, got {v}"
                    )));
                }
            }
        }
        let times: Vec<f64> = self.models.iter().flat_map(|m| [m.fwd, m.bwd]).collect();
        let mems: Vec<f64> = self.models.iter().map(|m| m.mem_per_microbatch).collect();
        let (time_scale, time_rounded) = decimal_grid(&times);
        let (mem_scale, mem_rounded) = decimal_grid(&mems);
        let ticks = |v: f64, scale: u64, field: &str, i: usize| -> Result<u64, ProblemError> {
            let t = (v * scale as f64).round();
            if t > MAX_TICKS {
                return Err(ProblemError(format!(
                    "models[{i}].{field} is too large ({v})"
                )));
            }
            // A value far below the others rounds up to one tick rather than to nothing.
            Ok((t as u64).max(1))
        };
        let mut models = Vec::with_capacity(self.models.len());
        for (i, m) in self.models.iter().enumerate() {
            models.push(PipelineModel {
                name: m.name.clone(),
                pp: m.pp,
                microbatches: m.microbatches,
                fwd: ticks(m.fwd, time_scale, "fwd", i)?,
                bwd: ticks(m.bwd, time_scale, "bwd", i)?,
                mem_per_microbatch: ticks(
                    m.mem_per_microbatch,
                    mem_scale,
                    "mem_per_microbatch",
                    i,
                )?,
            });
        }
        let problem = PipelineProblem {
            stages: self.stages,
            models,
            search: self.search.clone(),
        };
        problem.validate()?;
        Ok((
            problem,
            Grid {
                time_ticks_per_unit: time_scale,
                memory_ticks_per_unit: mem_scale,
                rounded: time_rounded || mem_rounded,
            },
        ))
    }
}

/// A whole number as an integer, any other as a float.
fn number<S: serde::Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    if v.fract() == 0.0 && v.abs() < 9.0e15 {
        s.serialize_i64(*v as i64)
    } else {
        s.serialize_f64(*v)
    }
}

/// One scheduled subtask, in the spec's time unit.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RealTask {
    pub model: usize,
    pub replica: usize,
    pub microbatch: usize,
    pub kind: Kind,
    #[serde(serialize_with = "number")]
    pub start: f64,
    #[serde(serialize_with = "number")]
    pub end: f64,
}

/// The subtasks one device runs, in order, with its peak memory in the spec's unit.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RealDevice {
    pub device: usize,
    #[serde(serialize_with = "number")]
    pub peak_memory: f64,
    pub tasks: Vec<RealTask>,
}

/// [`FusedSchedule`] in the spec's units (field order is the JSON order).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RealSchedule {
    #[serde(serialize_with = "number")]
    pub latency: f64,
    #[serde(serialize_with = "number")]
    pub lower_bound: f64,
    #[serde(serialize_with = "number")]
    pub peak_memory: f64,
    #[serde(serialize_with = "number")]
    pub serial_1f1b_latency: f64,
    #[serde(serialize_with = "number")]
    pub greedy_latency: f64,
    #[serde(serialize_with = "number")]
    pub greedy_peak_memory: f64,
    pub grid: Grid,
    pub search: SearchStats,
    pub schedule: Vec<RealDevice>,
}

impl RealSchedule {
    /// The JSON form; numbers that are whole print as integers (`372`, not `372.0`), so that
    /// a problem given in integers reads as it did before real values were accepted.
    pub fn to_json(&self) -> Result<String, ProblemError> {
        serde_json::to_string_pretty(self).map_err(|e| ProblemError(e.to_string()))
    }

    /// The solver's answer on `grid`, in the spec's units.
    pub fn new(s: &FusedSchedule, grid: Grid) -> RealSchedule {
        let t = |x: u64| x as f64 / grid.time_ticks_per_unit as f64;
        let m = |x: u64| x as f64 / grid.memory_ticks_per_unit as f64;
        let device = |d: &DeviceSchedule| RealDevice {
            device: d.device,
            peak_memory: m(d.peak_memory),
            tasks: d
                .tasks
                .iter()
                .map(|k| RealTask {
                    model: k.model,
                    replica: k.replica,
                    microbatch: k.microbatch,
                    kind: k.kind,
                    start: t(k.start),
                    end: t(k.end),
                })
                .collect(),
        };
        RealSchedule {
            latency: t(s.latency),
            lower_bound: t(s.lower_bound),
            peak_memory: m(s.peak_memory),
            serial_1f1b_latency: t(s.serial_1f1b_latency),
            greedy_latency: t(s.greedy_latency),
            greedy_peak_memory: m(s.greedy_peak_memory),
            grid,
            search: s.search.clone(),
            schedule: s.schedule.iter().map(device).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::solve;
    use super::*;

    fn spec(fwd: [f64; 2], bwd: [f64; 2], mem: [f64; 2]) -> PipelineSpec {
        PipelineSpec {
            stages: 4,
            models: (0..2)
                .map(|i| ModelSpec {
                    name: None,
                    pp: if i == 0 { 4 } else { 2 },
                    microbatches: 4,
                    fwd: fwd[i],
                    bwd: bwd[i],
                    mem_per_microbatch: mem[i],
                })
                .collect(),
            search: SearchOptions::default(),
        }
    }

    #[test]
    fn integers_stay_on_the_unit_grid() {
        let (p, g) = spec([5.0, 4.0], [10.0, 8.0], [1.0, 1.0])
            .to_problem()
            .unwrap();
        assert_eq!((g.time_ticks_per_unit, g.memory_ticks_per_unit), (1, 1));
        assert!(!g.rounded);
        assert_eq!((p.models[0].fwd, p.models[1].bwd), (5, 8));
    }

    #[test]
    fn decimals_get_the_finest_grid_that_holds_them_exactly() {
        let (p, g) = spec([0.5, 0.25], [1.0, 0.5], [1.95, 1.0])
            .to_problem()
            .unwrap();
        assert_eq!(g.time_ticks_per_unit, 100);
        assert_eq!(g.memory_ticks_per_unit, 100);
        assert!(!g.rounded);
        assert_eq!(
            (
                p.models[0].fwd,
                p.models[1].fwd,
                p.models[0].mem_per_microbatch
            ),
            (50, 25, 195)
        );
        let (_, g) = spec([1.0 / 3.0, 1.0], [1.0, 1.0], [1.0, 1.0])
            .to_problem()
            .unwrap();
        assert_eq!(g.time_ticks_per_unit, 1_000_000);
        assert!(g.rounded);
    }

    /// Scaling every duration by a decimal factor scales the schedule by it: the solver sees
    /// the same integer problem.
    #[test]
    fn a_scaled_problem_has_the_scaled_schedule() {
        let whole = spec([5.0, 4.0], [10.0, 8.0], [2.0, 3.0]);
        let tenth = spec([0.5, 0.4], [1.0, 0.8], [0.2, 0.3]);
        let solve_real = |s: &PipelineSpec| {
            let (p, g) = s.to_problem().unwrap();
            RealSchedule::new(&solve(&p).unwrap(), g)
        };
        let (a, b) = (solve_real(&whole), solve_real(&tenth));
        assert_eq!(b.latency, a.latency / 10.0);
        assert_eq!(b.lower_bound, a.lower_bound / 10.0);
        assert_eq!(b.peak_memory, a.peak_memory / 10.0);
        for (da, db) in a.schedule.iter().zip(&b.schedule) {
            for (ta, tb) in da.tasks.iter().zip(&db.tasks) {
                assert_eq!((tb.start, tb.end), (ta.start / 10.0, ta.end / 10.0));
            }
        }
    }

    #[test]
    fn non_positive_or_non_finite_values_name_their_field() {
        let e = spec([5.0, 0.0], [10.0, 8.0], [1.0, 1.0])
            .to_problem()
            .unwrap_err();
        assert!(
            e.0.contains("models[1].fwd must be a positive number"),
            "{e}"
        );
        let e = spec([5.0, 4.0], [10.0, 8.0], [f64::NAN, 1.0])
            .to_problem()
            .unwrap_err();
        assert!(e.0.contains("models[0].mem_per_microbatch"), "{e}");
    }
}
