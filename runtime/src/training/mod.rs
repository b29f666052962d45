//! Training: batched forward passes over rollouts (`infer`: log-probabilities, values,
//! scores), the evaluator of losses written in the language (`objective`), AdamW (`optim`) and
//! atomic checkpoints (`checkpoint`).
//! It uses models; it knows nothing of plans.

pub mod checkpoint;
pub mod infer;
pub mod objective;
pub mod optim;
