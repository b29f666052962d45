//! Reading checkpoint tensors from memory-mapped safetensors files (`model.safetensors` or the
//! shards named by `model.safetensors.index.json`). Each tensor's bytes are read exactly once,
//! by the copy into the model's own parameter: the file is mapped, a tensor is wrapped around
//! the mapped bytes without copying, and libtorch copies (and converts the dtype) into the
//! destination. This module validates headers and shapes and never panics on a bad file; it
//! must not keep tensors that alias the mapping beyond one copy.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorInfo};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

struct Mapped {
    path: PathBuf,
    mmap: Mmap,
    /// Where the data section starts (8 + header length).
    data_start: usize,
    tensors: BTreeMap<String, TensorInfo>,
}

/// The tensors of one checkpoint, possibly sharded over several files.
pub struct WeightFiles {
    files: Vec<Mapped>,
    /// Tensor name → index into `files`.
    index: BTreeMap<String, usize>,
}

fn map_file(path: &Path) -> Result<Mapped> {
    let file = File::open(path).map_err(|e| Error::file(path, format!("cannot open: {e}")))?;
    // SAFETY: the mapping is read-only and lives as long as `Mapped`; Braid never writes the
    // checkpoint while a model loads from it. Another process truncating the file during the
    // load is the one hazard memory-mapping cannot exclude, the same as in every mmap-based
    // checkpoint loader (safetensors' own Python loader included).
    #[allow(unsafe_code)]
    let mmap =
        unsafe { Mmap::map(&file) }.map_err(|e| Error::file(path, format!("cannot map: {e}")))?;
    let (n, metadata) = SafeTensors::read_metadata(&mmap).map_err(|e| {
        Error::file(
            path,
            format!("not a valid safetensors file (truncated or corrupt): {e:?}"),
        )
    })?;
    let tensors = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.clone()))
        .collect();
    Ok(Mapped {
        path: path.to_path_buf(),
        mmap,
        data_start: n + 8,
        tensors,
    })
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

impl WeightFiles {
    /// Opens the weights of a Hugging Face model directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        if single.exists() {
            let m = map_file(&single)?;
            for name in m.tensors.keys() {
                index.insert(name.clone(), 0);
            }
            files.push(m);
        } else if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| Error::file(&index_path, format!("cannot read: {e}")))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| Error::file(&index_path, format!("invalid JSON: {e}")))?;
            let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
                return Err(Error::file(&index_path, "missing object `weight_map`"));
            };
            let mut shard_ids: BTreeMap<String, usize> = BTreeMap::new();
            for (tensor, shard) in map {
                let Some(shard) = shard.as_str() else {
                    return Err(Error::file(
                        &index_path,
                        format!("shard of `{tensor}` must be a file name"),
                    ));
                };
                let id = match shard_ids.get(shard) {
                    Some(id) => *id,
                    None => {
                        let id = files.len();
                        files.push(map_file(&dir.join(shard))?);
                        shard_ids.insert(shard.to_owned(), id);
                        id
                    }
                };
                if !files[id].tensors.contains_key(tensor) {
                    return Err(Error::file(
                        &files[id].path,
                        format!("tensor `{tensor}` listed in the index is missing"),
                    ));
                }
                index.insert(tensor.clone(), id);
            }
        } else {
            return Err(Error::file(
                &single,
                "missing (no model.safetensors or model.safetensors.index.json)",
            ));
        }
        Ok(WeightFiles { files, index })
    }

    /// Whether the checkpoint has a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The file a tensor lives in (for error messages).
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.index.get(name).map(|i| self.files[*i].path.as_path())
    }

    /// The first file, for messages about the checkpoint as a whole.
    pub fn first_path(&self) -> &Path {
        self.files
            .first()
            .map(|f| f.path.as_path())
            .unwrap_or(Path::new("model.safetensors"))
    }

    /// Copies the tensor `name` into `dst` (converting its dtype and moving it to `dst`'s
    /// device), after checking that the shapes agree.
    pub fn copy_into(&self, name: &str, dst: &mut Tensor) -> Result<()> {
        let Some(&i) = self.index.get(name) else {
            return Err(Error::file(
                self.first_path(),
                format!("missing tensor `{name}`"),
            ));
        };
        let file = &self.files[i];
        let Some(info) = file.tensors.get(name) else {
            return Err(Error::file(&file.path, format!("missing tensor `{name}`")));
        };
        let shape: Vec<i64> = info
            .shape
            .iter()
            .map(|&d| i64::try_from(d).unwrap_or(i64::MAX))
            .collect();
        if shape != dst.size() {
            return Err(Error::file(
                &file.path,
                format!(
                    "tensor `{name}` has shape {shape:?}, the configuration implies {:?}",
                    dst.size()
                ),
            ));
        }
        let Some(kind) = kind_of(info.dtype) else {
            return Err(Error::file(
                &file.path,
                format!("tensor `{name}` has unsupported dtype {:?}", info.dtype),
            ));
        };
        let (start, end) = info.data_offsets;
        let bytes = &file.mmap[file.data_start + start..file.data_start + end];
        let elt = kind.elt_size_in_bytes();
        let src = if (bytes.as_ptr() as usize).is_multiple_of(elt) {
            // SAFETY: `bytes` covers exactly numel × element-size bytes of the mapping (checked
            // by `read_metadata`), is aligned for the element type (checked just above), and
            // outlives `src`, which is dropped at the end of this function after the copy.
            #[allow(unsafe_code)]
            let t = unsafe { Tensor::f_from_blob(bytes.as_ptr(), &shape, &[], kind, Device::Cpu) }?;
            t
        } else {
            // An unaligned tensor (possible in hand-made files) is copied out first.
            Tensor::f_from_data_size(bytes, &shape, kind)?
        };
        tch::no_grad(|| dst.f_copy_(&src))?;
        Ok(())
    }
}
