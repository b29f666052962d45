//! Built-in functions, sources and options: names, parameters, defaults and docs, in one place.

/// Where a built-in may be called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// In a pipeline's `each` body: model calls, `next`, losses, `by_prompt`.
    Pipeline,
    /// In a `fn` body: math, reductions, string and regex tests.
    Fn,
    /// In the body of a loss (a `fn … -> Loss`): reductions to the loss and `stop_grad`.
    Loss,
}

#[derive(Debug, Clone, Copy)]
pub struct BuiltinParam {
    pub name: &'static str,
    /// The type as shown to users; `number` means int or float, `PerToken|PerSample` either.
    pub ty: &'static str,
    /// The default as source text, if the parameter is optional.
    pub default: Option<&'static str>,
}

#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    pub name: &'static str,
    pub place: Place,
    pub params: &'static [BuiltinParam],
    pub ret: &'static str,
    pub doc: &'static str,
}

impl Builtin {
    /// `name(a: T, b: U = d) -> R`, for hover and completion.
    pub fn signature(&self) -> String {
        let ps: Vec<String> = self
            .params
            .iter()
            .map(|p| match p.default {
                Some(d) => format!("{}: {} = {}", p.name, p.ty, d),
                None => format!("{}: {}", p.name, p.ty),
            })
            .collect();
        format!("{}({}) -> {}", self.name, ps.join(", "), self.ret)
    }
}

const fn p(name: &'static str, ty: &'static str) -> BuiltinParam {
    BuiltinParam {
        name,
        ty,
        default: None,
    }
}

const fn d(name: &'static str, ty: &'static str, default: &'static str) -> BuiltinParam {
    BuiltinParam {
        name,
        ty,
        default: Some(default),
    }
}

/// Every built-in function.
pub const BUILTINS: &[Builtin] = &[
    // Model calls: the nodes of the task graph.
    Builtin {
        name: "generate",
        place: Place::Pipeline,
        params: &[
            p("model", "Model"),
            p("prompts", "PromptBatch"),
            d("n", "int", "1"),
            d("max_new_tokens", "int", "256"),
            d("temperature", "float", "1.0"),
            d("top_p", "float", "1.0"),
            d("top_k", "int", "0"),
            d("greedy", "bool", "false"),
        ],
        ret: "Rollout",
        doc: "Samples `n` completions of every prompt from the model. Per sample: each finished sample streams to its consumers. `greedy: true` takes the most likely token at every step; `top_k: 0` means no top-k cut.",
    },
    Builtin {
        name: "logprobs",
        place: Place::Pipeline,
        params: &[p("model", "Model"), p("rollout", "Rollout")],
        ret: "PerToken",
        doc: "The log-probability under the model of every completion token of the rollout. Per sample. Needs an `lm` head.",
    },
    Builtin {
        name: "values",
        place: Place::Pipeline,
        params: &[p("model", "Model"), p("rollout", "Rollout")],
        ret: "PerToken",
        doc: "The critic's value estimate at every completion token. Per sample. Needs a `value` head.",
    },
    Builtin {
        name: "score",
        place: Place::Pipeline,
        params: &[p("model", "Model"), p("rollout", "Rollout")],
        ret: "PerSample",
        doc: "The reward model's score of every sample, read at its last token. Per sample. Needs a `score` head.",
    },
    Builtin {
        name: "train",
        place: Place::Pipeline,
        params: &[
            p("model", "Model"),
            p("rollout", "Rollout"),
            p("loss", "Loss"),
            d("epochs", "int", "1"),
            d("minibatches", "int", "1"),
        ],
        ret: "()",
        doc: "Updates the model to lower the loss on the rollout: `epochs` passes, each over `minibatches` optimizer steps. Per batch. The model must declare `train:`.",
    },
    Builtin {
        name: "next",
        place: Place::Pipeline,
        params: &[p("dataset", "Dataset"), p("n", "int")],
        ret: "PromptBatch",
        doc: "The next `n` prompts of the dataset (shuffled and repeated over epochs as its options say).",
    },
    Builtin {
        name: "by_prompt",
        place: Place::Pipeline,
        params: &[p("value", "PerSample"), p("like", "Rollout")],
        ret: "PerSample",
        doc: "Lines per-sample values of one rollout up with another rollout of the same prompt batch: each sample of `like` gets the value of its prompt's sample. Per group.",
    },
    // Math, in fn bodies. Elementwise over per-token values.
    Builtin {
        name: "exp",
        place: Place::Fn,
        params: &[p("x", "number|PerToken")],
        ret: "float|PerToken",
        doc: "e^x.",
    },
    Builtin {
        name: "log",
        place: Place::Fn,
        params: &[p("x", "number|PerToken")],
        ret: "float|PerToken",
        doc: "The natural logarithm.",
    },
    Builtin {
        name: "sqrt",
        place: Place::Fn,
        params: &[p("x", "number|PerToken")],
        ret: "float|PerToken",
        doc: "The square root.",
    },
    Builtin {
        name: "abs",
        place: Place::Fn,
        params: &[p("x", "number|PerToken")],
        ret: "number|PerToken",
        doc: "The absolute value.",
    },
    Builtin {
        name: "float",
        place: Place::Fn,
        params: &[p("x", "number")],
        ret: "float",
        doc: "Converts an int to a float.",
    },
    Builtin {
        name: "clamp",
        place: Place::Fn,
        params: &[
            p("x", "number|PerToken"),
            p("lo", "number"),
            p("hi", "number"),
        ],
        ret: "number|PerToken",
        doc: "x limited to [lo, hi].",
    },
    Builtin {
        name: "min",
        place: Place::Fn,
        params: &[
            p("x", "number|PerToken|PerSample"),
            d("y", "number|PerToken", "(none)"),
        ],
        ret: "number|PerToken",
        doc: "With two arguments, the smaller (elementwise). With one, the smallest element: of a per-token value over the sample's tokens, or, in an `over group`/`over batch` function, over the scope.",
    },
    Builtin {
        name: "max",
        place: Place::Fn,
        params: &[
            p("x", "number|PerToken|PerSample"),
            d("y", "number|PerToken", "(none)"),
        ],
        ret: "number|PerToken",
        doc: "With two arguments, the larger (elementwise). With one, the largest element: of a per-token value over the sample's tokens, or, in an `over group`/`over batch` function, over the scope.",
    },
    Builtin {
        name: "sum",
        place: Place::Fn,
        params: &[p("x", "PerToken|PerSample")],
        ret: "float",
        doc: "The sum over the sample's tokens; in an `over group`/`over batch` function, over the scope's samples (or all their tokens).",
    },
    Builtin {
        name: "mean",
        place: Place::Fn,
        params: &[p("x", "PerToken|PerSample")],
        ret: "float",
        doc: "The mean over the sample's tokens; in an `over group`/`over batch` function, over the scope. 0.0 when empty.",
    },
    Builtin {
        name: "std",
        place: Place::Fn,
        params: &[p("x", "PerToken|PerSample")],
        ret: "float",
        doc: "The population standard deviation over the sample's tokens; in an `over group`/`over batch` function, over the scope.",
    },
    Builtin {
        name: "len",
        place: Place::Fn,
        params: &[p("x", "string|PerToken|PerSample")],
        ret: "int",
        doc: "The length of a string in characters, or the number of elements a reduction of `x` covers: a sample's tokens, or the samples of the group/batch.",
    },
    Builtin {
        name: "count",
        place: Place::Fn,
        params: &[p("x", "string|PerToken"), d("pattern", "regex", "(none)")],
        ret: "int",
        doc: "`count(s, r\"re\")`: the number of non-overlapping matches of a regular expression in a string. `count(x)`: the number of non-zero elements of a per-token value.",
    },
    Builtin {
        name: "matches",
        place: Place::Fn,
        params: &[p("s", "string"), p("pattern", "regex")],
        ret: "bool",
        doc: "Whether the regular expression matches somewhere in the string. The pattern must be a literal; it is compiled once.",
    },
    Builtin {
        name: "contains",
        place: Place::Fn,
        params: &[p("s", "string"), p("part", "string")],
        ret: "bool",
        doc: "Whether `part` occurs in the string.",
    },
    Builtin {
        name: "starts_with",
        place: Place::Fn,
        params: &[p("s", "string"), p("prefix", "string")],
        ret: "bool",
        doc: "Whether the string starts with `prefix`.",
    },
    Builtin {
        name: "ends_with",
        place: Place::Fn,
        params: &[p("s", "string"), p("suffix", "string")],
        ret: "bool",
        doc: "Whether the string ends with `suffix`.",
    },
    Builtin {
        name: "answer_matches",
        place: Place::Fn,
        params: &[p("completion", "string"), p("answer", "string")],
        ret: "bool",
        doc: "Numeric answer matching: the last number in the completion (or the content of its last `\\boxed{}`) equals the answer's number. Tolerates `1,000`, `1000.0` and `$`.",
    },
    // Losses: in the body of a `fn … -> Loss`, evaluated per micro-batch with autograd.
    Builtin {
        name: "batch_mean",
        place: Place::Loss,
        params: &[p("x", "PerToken|PerSample")],
        ret: "Loss",
        doc: "The mean over the mini-batch: of all its tokens for a per-token value (a token mean), of its samples for a per-sample one (`batch_mean(mean(x))` is the sequence mean). Each micro-batch contributes its share, divided by the mini-batch's count, so accumulated gradients are the mini-batch's.",
    },
    Builtin {
        name: "batch_sum",
        place: Place::Loss,
        params: &[p("x", "PerToken|PerSample")],
        ret: "Loss",
        doc: "The sum over the mini-batch's tokens (per-token `x`) or samples (per-sample `x`). Divide it by a constant for Dr. GRPO's normaliser: `batch_sum(x) / max_new_tokens`.",
    },
    Builtin {
        name: "group_mean",
        place: Place::Loss,
        params: &[p("x", "PerToken|PerSample")],
        ret: "Loss",
        doc: "The mean over the mini-batch's groups of each group's mean: over the group's tokens for a per-token value, its samples for a per-sample one. A group is the samples of one prompt that the mini-batch holds.",
    },
    Builtin {
        name: "stop_grad",
        place: Place::Loss,
        params: &[p("x", "number|PerToken|PerSample")],
        ret: "number|PerToken",
        doc: "The value, cut from the gradient: the loss is differentiated as if `x` were a constant (CISPO's clipped weight, a baseline).",
    },
    Builtin {
        name: "field",
        place: Place::Fn,
        params: &[p("s", "Sample"), p("name", "string")],
        ret: "string",
        doc: "The string field `name` of the dataset record the sample's prompt came from: `field(s, \"topic\")`. The name is a literal. Every record of the data the function scores must hold it as a string; one that does not is an error naming its file and line when the dataset is loaded.",
    },
    Builtin {
        name: "field_int",
        place: Place::Fn,
        params: &[p("s", "Sample"), p("name", "string")],
        ret: "int",
        doc: "The integer field `name` of the sample's dataset record: `field_int(s, \"difficulty\")`. Checked when the dataset is loaded, like `field`.",
    },
    Builtin {
        name: "field_float",
        place: Place::Fn,
        params: &[p("s", "Sample"), p("name", "string")],
        ret: "float",
        doc: "The numeric field `name` of the sample's dataset record, as a float (an integer converts). Checked when the dataset is loaded, like `field`.",
    },
    Builtin {
        name: "field_bool",
        place: Place::Fn,
        params: &[p("s", "Sample"), p("name", "string")],
        ret: "bool",
        doc: "The boolean field `name` of the sample's dataset record. Checked when the dataset is loaded, like `field`.",
    },
];

/// Looks a built-in function up by name.
pub fn builtin(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}

/// One accepted key of an options block (`model … { key: value }`, `run … { … }`, `cluster`).
#[derive(Debug, Clone, Copy)]
pub struct OptionSpec {
    pub key: &'static str,
    pub ty: &'static str,
    /// Allowed values of an enumerated option (written bare: `dtype: bf16`).
    pub values: &'static [&'static str],
    pub doc: &'static str,
}

const fn o(key: &'static str, ty: &'static str, doc: &'static str) -> OptionSpec {
    OptionSpec {
        key,
        ty,
        values: &[],
        doc,
    }
}

pub const MODEL_OPTIONS: &[OptionSpec] = &[
    OptionSpec {
        key: "dtype",
        ty: "dtype",
        values: &["f32", "bf16", "f16"],
        doc: "Compute precision: forward and backward run in it, and frozen models and generation hold their weights in it. A trained bf16 or f16 model keeps f32 master weights and f32 AdamW state; f16 adds dynamic loss scaling. Default: f32 on CPU, bf16 on GPU.",
    },
    OptionSpec {
        key: "head",
        ty: "head",
        values: &["lm", "value", "score"],
        doc: "The output head: `lm` (next-token logits, the default), `value` (a critic: a scalar per token), `score` (a reward model: a scalar per sequence).",
    },
    o(
        "train",
        "adamw(...)",
        "The optimizer, which makes the model trainable: `adamw(lr: 1e-6, weight_decay: 0.0, eps: 1e-8, beta1: 0.9, beta2: 0.999, warmup: 0, schedule: constant|cosine|linear)`. Without it the model is frozen.",
    ),
    o(
        "grad_clip",
        "float",
        "Clip the global gradient norm to this value (> 0). The norm is logged every step.",
    ),
    o(
        "max_len",
        "int",
        "The longest sequence (prompt plus completion) the model is run on (> 0).",
    ),
    o(
        "gradient_checkpointing",
        "bool",
        "Activation checkpointing for a trained model: keep only each layer's input in the forward pass and recompute the layer in the backward pass. Less memory for activations, one more forward pass of compute. Needs `train:`. Default: off.",
    ),
];

/// Sources of `model` declarations and their parameters.
pub const MODEL_SOURCES: &[Builtin] = &[
    Builtin {
        name: "tiny",
        place: Place::Pipeline,
        params: &[
            d("vocab", "string", "\"bytes\""),
            d("layers", "int", "2"),
            d("hidden", "int", "64"),
            d("heads", "int", "4"),
            d("kv_heads", "int", "heads"),
            d("intermediate", "int", "4 * hidden"),
            d("max_len", "int", "512"),
            d("seed", "int", "0"),
        ],
        ret: "Model",
        doc: "A small Llama-style model with random weights from `seed` and a byte-level tokenizer: for demos and tests, no files needed.",
    },
    Builtin {
        name: "hf",
        place: Place::Pipeline,
        params: &[p("dir", "string")],
        ret: "Model",
        doc: "A Hugging Face model directory (config.json, safetensors, tokenizer.json), relative to this file. Llama, Mistral, Qwen2 and GPT-2 architectures.",
    },
    Builtin {
        name: "frozen",
        place: Place::Pipeline,
        params: &[p("model", "Model")],
        ret: "Model",
        doc: "A frozen copy of a model, made at the start of the run (a reference policy). It is never trained.",
    },
];

pub const DATASET_OPTIONS: &[OptionSpec] = &[
    o(
        "fields",
        "{ prompt: string, answer: string }",
        "Which fields of each record hold the prompt (or the chat messages) and the reference answer.",
    ),
    o(
        "shuffle",
        "bool",
        "Shuffle the records (seeded by `seed`) at every epoch.",
    ),
    o("seed", "int", "The shuffling seed."),
    o(
        "chat_template",
        "bool",
        "Render each prompt with the policy tokenizer's chat template as a user message.",
    ),
    o(
        "epochs",
        "int",
        "How many times the data may be repeated (> 0); the run stops with an error when it runs out.",
    ),
];

/// Keys of a dataset's `fields: { … }` record.
pub const FIELD_OPTIONS: &[OptionSpec] = &[
    o(
        "prompt",
        "string",
        "The record field holding the prompt. Default: \"prompt\".",
    ),
    o(
        "answer",
        "string",
        "The record field holding the reference answer (`s.answer`). Default: \"answer\"; a conversation without one takes its trailing assistant turn.",
    ),
    o(
        "messages",
        "string",
        "The record field holding a conversation: an array of `{ role, content }` messages (system, user, assistant) whose turns up to the last user turn are the prompt, rendered with the policy's chat template. Default: \"messages\", used by a record without a prompt field.",
    ),
];

pub const DATASET_SOURCES: &[Builtin] = &[
    Builtin {
        name: "jsonl",
        place: Place::Pipeline,
        params: &[p("path", "string")],
        ret: "Dataset",
        doc: "One JSON object per line, relative to this file.",
    },
    Builtin {
        name: "parquet",
        place: Place::Pipeline,
        params: &[p("path", "string")],
        ret: "Dataset",
        doc: "A Parquet file, relative to this file.",
    },
    Builtin {
        name: "synthetic::letters",
        place: Place::Pipeline,
        params: &[
            d("count", "int", "256"),
            d("seed", "int", "0"),
            d("split", "string", "\"all\""),
        ],
        ret: "Dataset",
        doc: "Generated prompts of a few random lowercase letters, for demos (reward: what the model writes next).",
    },
    Builtin {
        name: "synthetic::arithmetic",
        place: Place::Pipeline,
        params: &[
            d("count", "int", "256"),
            d("seed", "int", "0"),
            d("digits", "int", "2"),
            d("split", "string", "\"all\""),
        ],
        ret: "Dataset",
        doc: "Generated addition problems `a + b =` with their answers, for demos of answer-matching rewards.",
    },
    Builtin {
        name: "synthetic::word_problems",
        place: Place::Pipeline,
        params: &[
            d("count", "int", "256"),
            d("seed", "int", "0"),
            d("split", "string", "\"all\""),
        ],
        ret: "Dataset",
        doc: "Generated arithmetic word problems of one or two steps (addition, subtraction, multiplication, sharing), \
              each asking for `Answer: N`; the answer is the number and the record's `difficulty` field the number of steps. \
              `split: \"train\"` and `split: \"held_out\"` draw disjoint problems (one in eight is held out, by a hash of its text), \
              so a run can train on one and evaluate on the other.",
    },
];

pub const CLUSTER_OPTIONS: &[OptionSpec] = &[
    o("gpus", "int", "GPUs in all (> 0)."),
    OptionSpec {
        key: "gpu",
        ty: "string",
        values: DEVICES,
        doc: "The GPU type.",
    },
    o(
        "nodes",
        "int",
        "Machines the GPUs are spread over (> 0; divides `gpus`).",
    ),
    o("cpu", "bool", "Plan for this machine's CPU, one process."),
    o(
        "cpus",
        "int",
        "Plan for this many CPU processes (ranks) on this machine (> 0); `braid launch --nproc-per-node N` starts them.",
    ),
];

/// Device types known to the cost model.
pub const DEVICES: &[&str] = &["H100-80G", "H100", "H200", "H800", "A100-80G"];

/// Settings every `run` accepts besides its pipeline's `param`s.
pub const RUN_SETTINGS: &[OptionSpec] = &[
    o(
        "seed",
        "int",
        "The seed of the run: sampling, shuffling and initialisation. Default 0.",
    ),
    o(
        "checkpoint_every",
        "int",
        "Write a checkpoint every this many steps (> 0), and always at the end. Default 50.",
    ),
    o(
        "eval",
        "record",
        "Evaluation on held-out prompts during the run: `eval: { every: 10, prompts: held_out, n: 1, greedy }`. \
         Logs `eval/reward_mean` and `eval/accuracy` before the first step, every `every` steps and after the last.",
    ),
];

/// Keys of the run's `eval` record.
pub const EVAL_OPTIONS: &[OptionSpec] = &[
    o(
        "every",
        "int",
        "Evaluate every this many steps (> 0), and before the first step and after the last.",
    ),
    o(
        "prompts",
        "Dataset",
        "The held-out dataset: every record is answered at each evaluation. It must not be (or contain) the training data.",
    ),
    o("n", "int", "Samples per prompt (> 0). Default 1."),
    o("greedy", "bool", "Decode greedily (the usual evaluation)."),
    o(
        "temperature",
        "float",
        "Sampling temperature (> 0) when not greedy. Default 1.0.",
    ),
    o(
        "max_new_tokens",
        "int",
        "Tokens per answer (> 0). Default: the run's `max_new_tokens`.",
    ),
];

/// The trained model's outputs in the body of a loss (`policy.logp`), per completion token of
/// the rollout being trained on, with gradients.
pub const MODEL_OUTPUTS: &[OptionSpec] = &[
    o(
        "logp",
        "PerToken",
        "The log-probability of each completion token under the model as it trains (at the rollout's sampling temperature). Needs an `lm` head.",
    ),
    o(
        "entropy",
        "PerToken",
        "The entropy of the model's next-token distribution at each completion token. Needs an `lm` head.",
    ),
    o(
        "value",
        "PerToken",
        "The model's value estimate at each completion token. Needs a `value` head.",
    ),
];

/// Names a loss's `metric` may not take: the trainer reports these itself.
pub const TRAINER_METRICS: &[&str] = &["loss", "grad_norm", "lr", "entropy"];

/// Fields of a `Sample` in a `fn` body.
pub const SAMPLE_FIELDS: &[OptionSpec] = &[
    o("prompt", "string", "The prompt text."),
    o("completion", "string", "The generated text."),
    o(
        "answer",
        "string",
        "The reference answer from the dataset (\"\" when it has none).",
    ),
    o("length", "int", "The number of completion tokens."),
    o(
        "group",
        "int",
        "The index of the sample's prompt in the batch (samples of one prompt form a group).",
    ),
    o("tokens", "PerToken", "The completion's token ids."),
];
