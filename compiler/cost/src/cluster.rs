//! Cluster specs: `NODESxPER_NODExDEVICE` strings such as `32x8xH800` or `1x1xH100`, and
//! `cpu` for this machine's processor.
//!
//! This is the syntax of `--cluster` and the meaning of the `cluster { … }` item once the
//! checker has read it. It must not probe the machine: the CPU's FLOP/s is measured only when
//! the caller asks ([`crate::cost::measure_cpu_flops`]).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, DeviceKind, DeviceSpec};

/// A homogeneous cluster: `nodes` machines with `per_node` devices of one kind each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub nodes: u64,
    pub per_node: u64,
    pub device: DeviceKind,
}

/// A spec that does not parse; the message says what is wrong and what is expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterSpecError(pub String);

impl fmt::Display for ClusterSpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ClusterSpecError {}

const FORM: &str = "expected NODESxDEVICES_PER_NODExDEVICE (e.g. `32x8xH800`), `cpu` or `NxCPU` (N CPU processes, e.g. `4xcpu`)";

impl ClusterSpec {
    /// Parses `32x8xH800`, `1x1xH100`, `2X8Xa100-80g` (case-insensitive), `cpu` (one CPU
    /// process) or `4xcpu` (four CPU processes on one machine; `2x4xcpu` on two).
    pub fn parse(text: &str) -> Result<ClusterSpec, ClusterSpecError> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("cpu") {
            return Ok(ClusterSpec {
                nodes: 1,
                per_node: 1,
                device: DeviceKind::Cpu,
            });
        }
        let err = |what: String| Err(ClusterSpecError(format!("cluster `{t}`: {what}")));
        if t.is_empty() {
            return Err(ClusterSpecError(format!("empty cluster spec: {FORM}")));
        }
        let parts: Vec<&str> = t.splitn(3, ['x', 'X']).collect();
        // `4xcpu`: four CPU processes on one machine.
        let parts: Vec<&str> = match parts.as_slice() {
            [n, d] if d.eq_ignore_ascii_case("cpu") => vec!["1", n, d],
            _ => parts,
        };
        let [nodes, per_node, device] = parts.as_slice() else {
            return err(FORM.into());
        };
        let count = |s: &str, what: &str| -> Result<u64, ClusterSpecError> {
            match s.parse::<u64>() {
                Ok(0) => Err(ClusterSpecError(format!(
                    "cluster `{t}`: {what} must be at least 1"
                ))),
                Ok(n) if n > 1_000_000 => Err(ClusterSpecError(format!(
                    "cluster `{t}`: {n} {what} is more than this planner models"
                ))),
                Ok(n) => Ok(n),
                Err(_) => Err(ClusterSpecError(format!(
                    "cluster `{t}`: `{s}` is not a number of {what}; {FORM}"
                ))),
            }
        };
        let nodes = count(nodes, "nodes")?;
        let per_node = count(per_node, "devices per node")?;
        let Some(kind) = DeviceKind::parse(device) else {
            let known: Vec<&str> = DeviceKind::ALL.iter().map(|k| k.name()).collect();
            return err(format!(
                "unknown device `{device}`; known devices: {}",
                known.join(", ")
            ));
        };
        Ok(ClusterSpec {
            nodes,
            per_node,
            device: kind,
        })
    }

    pub fn devices(&self) -> u64 {
        self.nodes * self.per_node
    }

    /// The cost model for this cluster's devices, with the datasheet entry (for a CPU, the
    /// caller may pass a measured spec to [`CostModel::new`] instead).
    pub fn cost_model(&self) -> CostModel {
        self.cost_model_with(self.device.spec())
    }

    /// The cost model with an explicit device spec (e.g. [`DeviceSpec::cpu`] with measured
    /// FLOP/s).
    pub fn cost_model_with(&self, device: DeviceSpec) -> CostModel {
        CostModel::new(device, self.per_node)
    }
}

impl fmt::Display for ClusterSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.device == DeviceKind::Cpu && self.devices() == 1 {
            return f.write_str("cpu");
        }
        if self.device == DeviceKind::Cpu && self.nodes == 1 {
            return write!(f, "{}xcpu", self.per_node);
        }
        write!(f, "{}x{}x{}", self.nodes, self.per_node, self.device.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let c = ClusterSpec::parse("32x8xH800").expect("parses");
        assert_eq!((c.nodes, c.per_node, c.device), (32, 8, DeviceKind::H800));
        assert_eq!(c.devices(), 256);
        assert_eq!(c.to_string(), "32x8xH800");
        let one = ClusterSpec::parse("1x1xH100").expect("parses");
        assert_eq!(one.device, DeviceKind::H100);
        assert_eq!(one.to_string(), "1x1xH100-80G");
        assert_eq!(
            ClusterSpec::parse(" CPU ").expect("cpu").device,
            DeviceKind::Cpu
        );
        assert_eq!(
            ClusterSpec::parse("2X4Xa100-80g").expect("parses").device,
            DeviceKind::A100
        );
        let four = ClusterSpec::parse("4xcpu").expect("parses");
        assert_eq!(
            (four.nodes, four.per_node, four.device),
            (1, 4, DeviceKind::Cpu)
        );
        assert_eq!(four.to_string(), "4xcpu");
        assert_eq!(ClusterSpec::parse("2x2xcpu").expect("parses").devices(), 4);
        assert_eq!(
            ClusterSpec::parse("4x8xh200")
                .expect("parses")
                .cost_model()
                .devices_per_node,
            8
        );
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let cases = [
            ("", "empty cluster spec"),
            ("8xH100", "expected NODESxDEVICES_PER_NODExDEVICE"),
            ("0x8xH100", "nodes must be at least 1"),
            ("2x0xH100", "devices per node must be at least 1"),
            ("ax8xH100", "`a` is not a number of nodes"),
            ("2x-1xH100", "`-1` is not a number of devices per node"),
            (
                "2x8xV100",
                "unknown device `V100`; known devices: H100-80G, H200, H800, A100-80G, cpu",
            ),
            ("2x8x", "unknown device ``"),
            ("99999999x8xH100", "more than this planner models"),
        ];
        for (text, needle) in cases {
            let e = ClusterSpec::parse(text).expect_err(text);
            assert!(e.0.contains(needle), "{text}: {e}");
        }
    }
}
