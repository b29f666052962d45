//! Braid's runtime: models, the generation engine, inference, training and the executor of a
//! `Plan`. This is the only crate in the workspace that links libtorch (through `tch`); the
//! compiler crates never depend on it. See docs/runtime.md for how models, the engine and its
//! stream work, and the invariants with the tests that keep them.

pub mod calibrate;
pub mod cuda;
pub mod device;
pub mod dist;
pub mod error;
pub mod exec;
pub mod generation;
pub mod kernels;
pub mod models;
pub mod rng;
pub mod training;

pub use error::{Error, Result};
pub use generation::engine::{
    EngineOptions, FinishReason, Generation, Sample, SamplingPlace, generate, generate_stream,
    spawn_generation,
};
pub use generation::sampling::SamplingParams;
pub use models::cache::KvCache;
pub use models::config::{Arch, ModelConfig};
pub use models::model::{Head, LoadOptions, Model};
pub use models::save::save_pretrained;
pub use models::tiny::{TinyConfig, TinyVocab, tiny, tiny_in};
pub use models::tokenizer::{ChatMessage, SpecialTokens, Tokenizer};
pub use tch::{Device, Kind};
pub use training::infer::{InferOptions, Rollout, logprobs, score, values};
