//! Training: batched forward passes over rollouts (`infer`: log-probabilities, values,
//! scores), the RL losses (`loss`), AdamW (`optim`) and atomic checkpoints (`checkpoint`).
//! It uses models; it knows nothing of plans.

pub mod checkpoint;
pub mod infer;
pub mod loss;
pub mod optim;
