//! Writes a `tiny(...)` model (Braid's seeded initialisation and byte tokenizer) as a Hugging
//! Face directory, so that another trainer can start from exactly the weights a `.rlhf`
//! program's `tiny(...)` policy starts from. Used by `scripts/bench_trl` (Braid against TRL's
//! `GRPOTrainer`), where both sides then load the directory.
//!
//! Usage: export_tiny --out DIR [--layers 4] [--hidden 256] [--heads 4] [--kv-heads 4]
//!                    [--intermediate 4*hidden] [--max-len 512] [--seed 0]

use std::path::PathBuf;
use std::process::ExitCode;

use braid_runtime::{Head, TinyConfig, save_pretrained, tiny};
use tch::Device;

fn run() -> Result<PathBuf, String> {
    let mut cfg = TinyConfig {
        layers: 4,
        hidden: 256,
        heads: 4,
        kv_heads: 4,
        intermediate: 0,
        ..TinyConfig::default()
    };
    let mut out = PathBuf::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || value.parse::<i64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--out" => out = PathBuf::from(&value),
            "--layers" => cfg.layers = num()?,
            "--hidden" => cfg.hidden = num()?,
            "--heads" => cfg.heads = num()?,
            "--kv-heads" => cfg.kv_heads = num()?,
            "--intermediate" => cfg.intermediate = num()?,
            "--max-len" => cfg.max_len = num()?,
            "--seed" => cfg.seed = num()? as u64,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if out.as_os_str().is_empty() {
        return Err("--out is required".into());
    }
    if cfg.intermediate == 0 {
        cfg.intermediate = 4 * cfg.hidden;
    }
    let (model, tok) = tiny(&cfg, Head::Lm, Device::Cpu).map_err(|e| e.to_string())?;
    save_pretrained(&model, &tok, &out).map_err(|e| e.to_string())?;
    Ok(out)
}

fn main() -> ExitCode {
    match run() {
        Ok(dir) => {
            println!("{}", dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("export_tiny: {e}");
            ExitCode::FAILURE
        }
    }
}
