//! Generation: the engine (continuous batching over a KV cache, a stream of finished samples),
//! sampling, and speculative decoding. It uses models; it knows nothing of training or plans.

pub mod device_sampling;
pub mod engine;
pub mod sampling;
pub mod spec;
