//! The standard library: `.rlhf` sources of the standard pipelines and functions (embedded at
//! build time), and the one table of built-in signatures and docs that the checker, hover and
//! completion all read. Typing rules of polymorphic built-ins live in `braid-sema`; this crate
//! only declares names, parameters, defaults and documentation.

mod builtins;

pub use builtins::{
    BUILTINS, Builtin, BuiltinParam, CLUSTER_OPTIONS, DATASET_OPTIONS, DATASET_SOURCES, DEVICES,
    EVAL_OPTIONS, FIELD_OPTIONS, MODEL_OPTIONS, MODEL_OUTPUTS, MODEL_SOURCES, OptionSpec, Place,
    RUN_SETTINGS, SAMPLE_FIELDS, TRAINER_METRICS, builtin,
};

/// A standard-library module: `use std::NAME`.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    pub name: &'static str,
    pub source: &'static str,
}

/// Every module, in name order.
pub const MODULES: &[Module] = &[
    Module {
        name: "advantages",
        source: include_str!("../std/advantages.rlhf"),
    },
    Module {
        name: "grpo",
        source: include_str!("../std/grpo.rlhf"),
    },
    Module {
        name: "kl",
        source: include_str!("../std/kl.rlhf"),
    },
    Module {
        name: "losses",
        source: include_str!("../std/losses.rlhf"),
    },
    Module {
        name: "ppo",
        source: include_str!("../std/ppo.rlhf"),
    },
    Module {
        name: "reinforce_pp",
        source: include_str!("../std/reinforce_pp.rlhf"),
    },
    Module {
        name: "remax",
        source: include_str!("../std/remax.rlhf"),
    },
    Module {
        name: "rewards",
        source: include_str!("../std/rewards.rlhf"),
    },
    Module {
        name: "rloo",
        source: include_str!("../std/rloo.rlhf"),
    },
];

/// The source of `std::NAME`.
pub fn module(name: &str) -> Option<&'static Module> {
    MODULES.iter().find(|m| m.name == name)
}

/// The file name diagnostics show for `std::NAME`.
pub fn file_name(name: &str) -> String {
    format!("std/{name}.rlhf")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_std_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("std");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                e.unwrap()
                    .path()
                    .file_stem()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        on_disk.sort();
        let embedded: Vec<&str> = MODULES.iter().map(|m| m.name).collect();
        assert_eq!(on_disk, embedded);
    }
}
