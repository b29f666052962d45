//! Atomic checkpoints of a run.
//!
//! `RUN_DIR/checkpoints/step-NNNNNN/` holds, for every trained model, a Hugging Face directory
//! in the model's dtype (`models/NAME/`), its optimizer state (`optimizer/NAME.safetensors`)
//! and, for a bf16 or f16 model, its f32 master weights (`master/NAME.safetensors`, under the
//! Hugging Face names), plus `state.json` (step, data cursors, seed, the program's
//! fingerprint). A resumed run continues from the masters, not from the rounded weights. A checkpoint is written to a
//! temporary directory, every file and the directory are fsynced, and it is renamed into place:
//! a directory named `step-*` is always complete, whenever the process is killed. The newest
//! `KEEP` checkpoints are kept.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::models::model::Model;
use crate::models::save::save_pretrained;
use crate::models::tokenizer::Tokenizer;
use crate::training::optim::AdamW;

/// Checkpoints kept in a run directory.
pub const KEEP: usize = 3;

/// What a run needs besides weights to continue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// Steps completed.
    pub step: i64,
    /// Records drawn from each dataset.
    pub cursors: BTreeMap<String, u64>,
    pub seed: i64,
    pub pipeline: String,
    /// `exec::fingerprint` of the plan that wrote it.
    pub fingerprint: String,
}

fn io(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::file(path, format!("{what}: {e}"))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io(dir, "cannot sync directory", e))
}

/// fsyncs every file under `dir`, then the directories bottom-up.
fn sync_tree(dir: &Path) -> Result<()> {
    let entries = fs::read_dir(dir).map_err(|e| io(dir, "cannot list", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io(dir, "cannot list", e))?;
        let path = entry.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| io(&path, "cannot sync", e))?;
        }
    }
    sync_dir(dir)
}

/// Writes a file atomically: a temporary file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    {
        let mut f = File::create(&tmp).map_err(|e| io(&tmp, "cannot create", e))?;
        f.write_all(bytes)
            .map_err(|e| io(&tmp, "cannot write", e))?;
        f.sync_all().map_err(|e| io(&tmp, "cannot sync", e))?;
    }
    fs::rename(&tmp, path).map_err(|e| io(path, "cannot rename into place", e))?;
    sync_dir(dir)
}

/// Appends one line and syncs it, so a completed step's metrics survive a kill.
pub fn append_line(path: &Path, line: &str) -> Result<()> {
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| io(path, "cannot open", e))?;
    f.write_all(format!("{line}\n").as_bytes())
        .map_err(|e| io(path, "cannot write", e))?;
    f.sync_data().map_err(|e| io(path, "cannot sync", e))
}

/// Keeps the metrics of steps `1..=step` (a resumed run recomputes the later ones); a line cut
/// short by a kill is dropped.
pub fn truncate_metrics(path: &Path, step: i64) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let text = fs::read_to_string(path).map_err(|e| io(path, "cannot read", e))?;
    let mut keep = String::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v.get("step")
            .and_then(|s| s.as_i64())
            .is_some_and(|s| s <= step)
        {
            keep.push_str(line);
            keep.push('\n');
        }
    }
    if keep != text {
        write_atomic(path, keep.as_bytes())?;
    }
    Ok(())
}

/// The optimizer state of model `name` in checkpoint `dir`.
pub fn optimizer_path(dir: &Path, name: &str) -> PathBuf {
    dir.join("optimizer").join(format!("{name}.safetensors"))
}

/// The f32 master weights of a bf16 or f16 model `name` in checkpoint `dir`.
pub fn master_path(dir: &Path, name: &str) -> PathBuf {
    dir.join("master").join(format!("{name}.safetensors"))
}

/// `path` for the part of a model that `model` holds: its pipeline stage (`stage-S-of-N`) and
/// tensor-parallel rank (`tp-T-of-M`), each part's state in a file of its own, or `path`
/// itself for a whole model.
pub fn part_path(path: PathBuf, model: &Model) -> PathBuf {
    let mut ext = String::new();
    if let Some((s, n)) = model.pipeline_stage() {
        ext.push_str(&format!("stage-{s}-of-{n}."));
    }
    let (tp, t) = model.tensor_parallel();
    if tp > 1 {
        ext.push_str(&format!("tp-{t}-of-{tp}."));
    }
    if ext.is_empty() {
        path
    } else {
        path.with_extension(format!("{ext}safetensors"))
    }
}

fn step_dir_name(step: i64) -> String {
    format!("step-{step:06}")
}

/// Writes a checkpoint of `models` (name, model, tokenizer, optimizer) and `state`; returns its
/// directory. One process: [`begin`], [`write_model`] for each, [`commit`].
pub fn save(
    run_dir: &Path,
    state: &State,
    models: &[(&str, &Model, &Tokenizer, &AdamW)],
) -> Result<PathBuf> {
    let tmp = begin(run_dir, state.step)?;
    for (name, model, tokenizer, opt) in models {
        write_model(&tmp, name, model, tokenizer, opt)?;
    }
    commit(run_dir, &tmp, state)
}

/// The temporary directory a checkpoint of `step` is written into (the same name on every
/// rank of a run, so that several ranks can write one checkpoint), created empty.
pub fn begin(run_dir: &Path, step: i64) -> Result<PathBuf> {
    let tmp = pending_dir(run_dir, step);
    let root = run_dir.join("checkpoints");
    fs::create_dir_all(&root).map_err(|e| io(&root, "cannot create", e))?;
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, "cannot remove", e))?;
    }
    fs::create_dir_all(tmp.join("optimizer")).map_err(|e| io(&tmp, "cannot create", e))?;
    fs::create_dir_all(tmp.join("models")).map_err(|e| io(&tmp, "cannot create", e))?;
    Ok(tmp)
}

/// Where [`begin`] puts the checkpoint of `step` while it is written.
pub fn pending_dir(run_dir: &Path, step: i64) -> PathBuf {
    run_dir
        .join("checkpoints")
        .join(format!(".tmp-{}", step_dir_name(step)))
}

/// Writes one trained model (a Hugging Face directory in its dtype), its optimizer state and,
/// for a bf16 or f16 model, its f32 master weights into a pending checkpoint.
pub fn write_model(
    tmp: &Path,
    name: &str,
    model: &Model,
    tokenizer: &Tokenizer,
    opt: &AdamW,
) -> Result<()> {
    save_pretrained(model, tokenizer, &tmp.join("models").join(name))?;
    opt.save(&part_path(optimizer_path(tmp, name), model))?;
    if opt.has_masters() {
        fs::create_dir_all(tmp.join("master")).map_err(|e| io(tmp, "cannot create", e))?;
        opt.save_masters(&part_path(master_path(tmp, name), model))?;
    }
    Ok(())
}

/// Completes a pending checkpoint: `state.json`, every file and directory fsynced, then the
/// rename into `step-NNNNNN` that makes it visible; older checkpoints beyond [`KEEP`] and
/// leftovers of killed runs are removed.
pub fn commit(run_dir: &Path, tmp: &Path, state: &State) -> Result<PathBuf> {
    let root = run_dir.join("checkpoints");
    let final_dir = root.join(step_dir_name(state.step));
    let json = serde_json::to_string_pretty(state)
        .map_err(|e| Error::file(tmp, format!("cannot serialise state: {e}")))?;
    fs::write(tmp.join("state.json"), json + "\n")
        .map_err(|e| io(&tmp.join("state.json"), "cannot write", e))?;
    sync_tree(tmp)?;
    if final_dir.exists() {
        // A checkpoint of this step from an earlier attempt: replace it.
        fs::remove_dir_all(&final_dir).map_err(|e| io(&final_dir, "cannot remove", e))?;
    }
    fs::rename(tmp, &final_dir).map_err(|e| io(&final_dir, "cannot rename into place", e))?;
    sync_dir(&root)?;
    // Older checkpoints beyond KEEP, and temporary directories left by killed runs.
    let mut steps = list(&root)?;
    steps.sort();
    if steps.len() > KEEP {
        for (_, dir) in &steps[..steps.len() - KEEP] {
            let _ = fs::remove_dir_all(dir);
        }
    }
    if let Ok(entries) = fs::read_dir(&root) {
        for e in entries.flatten() {
            let n = e.file_name();
            if n.to_string_lossy().starts_with(".tmp-") {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(final_dir)
}

fn list(root: &Path) -> Result<Vec<(i64, PathBuf)>> {
    let mut out = Vec::new();
    if !root.exists() {
        return Ok(out);
    }
    for e in fs::read_dir(root).map_err(|e| io(root, "cannot list", e))? {
        let e = e.map_err(|e| io(root, "cannot list", e))?;
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(n) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<i64>().ok())
        {
            out.push((n, e.path()));
        }
    }
    Ok(out)
}

/// The newest checkpoint of a run directory.
pub fn latest(run_dir: &Path) -> Result<Option<(i64, PathBuf)>> {
    let mut steps = list(&run_dir.join("checkpoints"))?;
    steps.sort();
    Ok(steps.pop())
}

pub fn read_state(dir: &Path) -> Result<State> {
    let path = dir.join("state.json");
    let text = fs::read_to_string(&path).map_err(|e| io(&path, "cannot read", e))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::file(&path, format!("not a checkpoint state: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_cut_at_the_checkpoint_and_torn_lines_dropped() {
        let dir = std::env::temp_dir().join(format!("braid-ck-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("metrics.jsonl");
        fs::write(&p, "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"ste").unwrap();
        truncate_metrics(&p, 2).unwrap();
        assert_eq!(
            fs::read_to_string(&p).unwrap(),
            "{\"step\":1}\n{\"step\":2}\n"
        );
        write_atomic(&dir.join("x.txt"), b"hello").unwrap();
        assert_eq!(fs::read_to_string(dir.join("x.txt")).unwrap(), "hello");
        assert!(latest(&dir).unwrap().is_none());
        let _ = fs::remove_dir_all(&dir);
    }
}
