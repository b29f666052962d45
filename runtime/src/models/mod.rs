//! Models and what they are made of: architectures read from `config.json` (`config`), the
//! network with its heads and cached forward (`model`), tiny random models (`tiny`), weight
//! files (`weights`), saving in Hugging Face form (`save`), tokenizers and chat templates
//! (`tokenizer`) and the KV cache (`cache`). This layer runs forward passes; it does not sample,
//! train or know plans.

pub mod cache;
pub mod config;
pub mod dequant;
pub mod gguf;
pub mod model;
pub mod parallel;
pub mod pipeline;
pub mod save;
pub mod tiny;
pub mod tokenizer;
pub mod weights;
