//! Safetensors import/export with Hugging Face names and layouts. The flat buffer already stores
//! every tensor in its HF layout (`[out, in]` linears, Mixtral's fused
//! `experts.gate_up_proj [E, 2I, H]` and `experts.down_proj [E, H, I]`), so loading and saving
//! are per-tensor copies with shape checks; f32, bf16 and f16 files are read.

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{ModelError, Result};
use crate::layout::ParamLayout;

/// A safetensors file held in memory.
pub struct WeightsFile {
    bytes: Vec<u8>,
}

fn st_err(e: safetensors::SafeTensorError) -> ModelError {
    ModelError::Safetensors(e.to_string())
}

impl WeightsFile {
    /// Read a safetensors file.
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bytes(bytes)
    }

    /// Wrap in-memory safetensors bytes (validated now, so later reads cannot fail on format).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        SafeTensors::deserialize(&bytes).map_err(st_err)?;
        Ok(WeightsFile { bytes })
    }

    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("validated in from_bytes")
    }

    /// Names of all tensors in the file.
    pub fn names(&self) -> Vec<String> {
        self.st().names().into_iter().cloned().collect()
    }

    /// Shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let st = self.st();
        let t = st
            .tensor(name)
            .map_err(|_| ModelError::MissingTensor(name.to_string()))?;
        Ok(t.shape().to_vec())
    }

    /// Tensor `name` converted to f32 (from f32, bf16 or f16), with its shape.
    pub fn f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let st = self.st();
        let t = st
            .tensor(name)
            .map_err(|_| ModelError::MissingTensor(name.to_string()))?;
        let d = t.data();
        let v: Vec<f32> = match t.dtype() {
            Dtype::F32 => d
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => d
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => d
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok((v, t.shape().to_vec()))
    }

    /// Integer tensor `name` (i64 or i32), e.g. `input_ids`.
    pub fn i64(&self, name: &str) -> Result<(Vec<i64>, Vec<usize>)> {
        let st = self.st();
        let t = st
            .tensor(name)
            .map_err(|_| ModelError::MissingTensor(name.to_string()))?;
        let d = t.data();
        let v = match t.dtype() {
            Dtype::I64 => d
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            Dtype::I32 => d
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect(),
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok((v, t.shape().to_vec()))
    }

    /// Copy every tensor of `layout`, named `prefix + name` in the file, into `buf`
    /// (length `layout.total()`). Missing tensors and wrong shapes are errors; extra tensors in
    /// the file are ignored. `prefix` lets test files hold several buffers (`grad.`, `step3.`).
    pub fn load_into(&self, layout: &ParamLayout, prefix: &str, buf: &mut [f32]) -> Result<()> {
        if buf.len() != layout.total() {
            return Err(ModelError::BufferSize {
                what: "params",
                expected: layout.total(),
                found: buf.len(),
            });
        }
        for e in &layout.entries {
            let name = format!("{prefix}{}", e.name);
            let (data, shape) = self.f32(&name)?;
            if shape != e.view.shape {
                return Err(ModelError::ShapeMismatch {
                    name,
                    expected: e.view.shape.clone(),
                    found: shape,
                });
            }
            e.view.of_mut(buf).copy_from_slice(&data);
        }
        Ok(())
    }
}

/// Load parameters for `layout` from a HF safetensors file.
pub fn load_params(layout: &ParamLayout, path: &Path) -> Result<Vec<f32>> {
    let f = WeightsFile::open(path)?;
    let mut buf = vec![0.0; layout.total()];
    f.load_into(layout, "", &mut buf)?;
    Ok(buf)
}

/// Serialise `buf` (layout order) to safetensors bytes with HF names, as f32 or bf16.
pub fn params_to_safetensors(
    layout: &ParamLayout,
    buf: &[f32],
    bf16: bool,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    if buf.len() != layout.total() {
        return Err(ModelError::BufferSize {
            what: "params",
            expected: layout.total(),
            found: buf.len(),
        });
    }
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = layout
        .entries
        .iter()
        .map(|e| {
            let src = e.view.of(buf);
            let bytes = if bf16 {
                src.iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect()
            } else {
                src.iter().flat_map(|&x| x.to_le_bytes()).collect()
            };
            (e.name.clone(), e.view.shape.clone(), bytes)
        })
        .collect();
    let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
    let views = encoded
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(dtype, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(st_err)
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, &metadata).map_err(st_err)
}

/// Save `buf` to a HF safetensors file.
pub fn save_params(layout: &ParamLayout, buf: &[f32], path: &Path, bf16: bool) -> Result<()> {
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let bytes = params_to_safetensors(layout, buf, bf16, Some(meta))?;
    std::fs::write(path, bytes).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })
}
