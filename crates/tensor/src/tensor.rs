//! A small owned tensor (`Vec<f32>` + shape) for tests, loading and glue code.
//! Kernels themselves take plain slices with explicit shapes.

use crate::dtype::decode_le;
use crate::{DType, TensorError};

/// Contiguous row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
}

impl Tensor {
    /// Wraps `data` with `shape`, checking that the element counts agree.
    pub fn new(data: Vec<f32>, shape: Vec<usize>) -> Result<Tensor, TensorError> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(TensorError::Length {
                what: "Tensor::new data",
                expected: n,
                got: data.len(),
            });
        }
        Ok(Tensor { data, shape })
    }

    /// All-zero tensor of `shape`.
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor {
            data: vec![0.0; shape.iter().product()],
            shape: shape.to_vec(),
        }
    }

    /// Decodes little-endian `bytes` of `dtype` (e.g. a safetensors view) into an f32 tensor.
    pub fn from_bytes(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor, TensorError> {
        let n: usize = shape.iter().product();
        if bytes.len() != n * dtype.size_of() {
            return Err(TensorError::Bytes {
                len: bytes.len(),
                dtype,
                shape: shape.to_vec(),
            });
        }
        let mut data = vec![0.0; n];
        decode_le(bytes, dtype, &mut data)?;
        Ok(Tensor {
            data,
            shape: shape.to_vec(),
        })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Same data, new shape with the same element count.
    pub fn reshape(self, shape: &[usize]) -> Result<Tensor, TensorError> {
        Tensor::new(self.data, shape.to_vec())
    }

    /// Largest absolute elementwise difference to `other` (shapes must agree).
    pub fn max_abs_diff(&self, other: &Tensor) -> Result<f32, TensorError> {
        if self.shape != other.shape {
            return Err(TensorError::Shape(format!(
                "max_abs_diff: {:?} vs {:?}",
                self.shape, other.shape
            )));
        }
        Ok(max_abs_diff(&self.data, &other.data))
    }
}

/// Largest absolute elementwise difference of two equally long slices (NaN if any is NaN).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "max_abs_diff: lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, |m, d| {
            if d.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn construct_and_decode() {
        assert!(Tensor::new(vec![0.0; 5], vec![2, 3]).is_err());
        let t = Tensor::new(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], vec![2, 3]).unwrap();
        assert_eq!(t.numel(), 6);
        let bytes = crate::dtype::encode_le(&t.data, DType::BF16);
        let u = Tensor::from_bytes(&bytes, DType::BF16, &[2, 3]).unwrap();
        assert_eq!(t.max_abs_diff(&u).unwrap(), 0.0);
        assert!(Tensor::from_bytes(&bytes, DType::F32, &[2, 3]).is_err());
        assert!(t.clone().reshape(&[3, 2]).is_ok());
        assert!(t.reshape(&[4, 2]).is_err());
        assert!(max_abs_diff(&[f32::NAN], &[0.0]).is_nan());
    }
}
