//! Braid's runtime: models, the generation engine, inference, training and the executor of a
//! `Plan`. This is the only crate in the workspace that links libtorch (through `tch`); the
//! compiler crates never depend on it. See docs/runtime.md for how models, the engine and its
//! stream work, and the invariants with the tests that keep them.

pub mod attention;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod dist;
pub mod engine;
pub mod error;
pub mod exec;
pub mod gemm;
pub mod infer;
pub mod loss;
pub mod model;
pub mod optim;
pub mod rng;
pub mod sampling;
pub mod save;
pub mod spec;
mod step;
mod team;
pub mod tensorboard;
pub mod tiny;
pub mod tokenizer;
pub mod weights;

pub use cache::KvCache;
pub use config::{Arch, ModelConfig};
pub use engine::{
    EngineOptions, FinishReason, Generation, Sample, generate, generate_stream, spawn_generation,
};
pub use error::{Error, Result};
pub use infer::{InferOptions, Rollout, logprobs, score, values};
pub use model::{Head, LoadOptions, Model};
pub use sampling::SamplingParams;
pub use save::save_pretrained;
pub use tch::Device;
pub use tiny::{TinyConfig, TinyVocab, tiny};
pub use tokenizer::{ChatMessage, SpecialTokens, Tokenizer};
