//! Storage dtypes (f32, bf16, f16) and conversions between them and f32 compute buffers.
//!
//! All compute is f32; bf16/f16 are storage formats (checkpoints, communication buffers,
//! mixed-precision weights). Conversions round to nearest-even (via `half`'s vectorised
//! slice conversions).

use crate::error::check_len;
use crate::TensorError;
use half::slice::HalfFloatSliceExt;
pub use half::{bf16, f16};

/// Element type of stored tensor data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Name as used by safetensors ("F32", "BF16", "F16").
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
        }
    }

    /// Parses a safetensors dtype name.
    pub fn from_name(name: &str) -> Option<DType> {
        match name {
            "F32" => Some(DType::F32),
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            _ => None,
        }
    }
}

/// `dst[i] = bf16(src[i])` (round to nearest even).
pub fn to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<(), TensorError> {
    check_len("to_bf16 dst", dst.len(), src.len())?;
    dst.convert_from_f32_slice(src);
    Ok(())
}

/// `dst[i] = f32(src[i])` (exact).
pub fn from_bf16(src: &[bf16], dst: &mut [f32]) -> Result<(), TensorError> {
    check_len("from_bf16 dst", dst.len(), src.len())?;
    src.convert_to_f32_slice(dst);
    Ok(())
}

/// `dst[i] = f16(src[i])` (round to nearest even).
pub fn to_f16(src: &[f32], dst: &mut [f16]) -> Result<(), TensorError> {
    check_len("to_f16 dst", dst.len(), src.len())?;
    dst.convert_from_f32_slice(src);
    Ok(())
}

/// `dst[i] = f32(src[i])` (exact).
pub fn from_f16(src: &[f16], dst: &mut [f32]) -> Result<(), TensorError> {
    check_len("from_f16 dst", dst.len(), src.len())?;
    src.convert_to_f32_slice(dst);
    Ok(())
}

/// Allocating helper: f32 slice to a new bf16 vector.
pub fn to_bf16_vec(src: &[f32]) -> Vec<bf16> {
    let mut v = vec![bf16::ZERO; src.len()];
    v.convert_from_f32_slice(src);
    v
}

/// Allocating helper: bf16 slice to a new f32 vector.
pub fn from_bf16_vec(src: &[bf16]) -> Vec<f32> {
    let mut v = vec![0.0; src.len()];
    src.convert_to_f32_slice(&mut v);
    v
}

/// Rounds every element of `x` to the nearest bf16 value, in place (used to emulate bf16
/// storage while computing in f32).
pub fn round_to_bf16(x: &mut [f32]) {
    for v in x {
        *v = bf16::from_f32(*v).to_f32();
    }
}

/// Decodes little-endian bytes of `dtype` into f32 values (bytes may be unaligned).
pub fn decode_le(bytes: &[u8], dtype: DType, dst: &mut [f32]) -> Result<(), TensorError> {
    check_len("decode_le bytes", bytes.len(), dst.len() * dtype.size_of())?;
    match dtype {
        DType::F32 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
    Ok(())
}

/// Encodes f32 values as little-endian bytes of `dtype` (rounding to nearest even).
pub fn encode_le(src: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(src.len() * dtype.size_of());
    match dtype {
        DType::F32 => src
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::BF16 => src
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes())),
        DType::F16 => src
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes())),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_roundtrip_and_rounding() {
        let src = [1.0f32, -2.5, 3.140625, 1.0 + 1.0 / 256.0, 65504.0, 1e-3];
        let mut b = vec![bf16::ZERO; src.len()];
        to_bf16(&src, &mut b).unwrap();
        let mut back = vec![0.0; src.len()];
        from_bf16(&b, &mut back).unwrap();
        // bf16 has 8 significant bits: the spacing in [2^e, 2^(e+1)) is 2^(e-7), so
        // round-to-nearest errs by at most 2^(e-8) <= 2^-8 relative.
        for (a, r) in src.iter().zip(&back) {
            assert!((a - r).abs() <= a.abs() * (1.0 / 256.0), "{a} {r}");
        }
        // exactly representable values survive; 1 + 2^-8 is a tie and rounds to even (1.0).
        assert_eq!(back[0], 1.0);
        assert_eq!(back[1], -2.5);
        assert_eq!(back[3], 1.0);
        assert!(to_bf16(&src, &mut b[..2]).is_err());
    }

    #[test]
    fn f16_and_bytes_roundtrip() {
        let src = [0.5f32, -1.25, 1000.0];
        let mut h = vec![f16::ZERO; 3];
        to_f16(&src, &mut h).unwrap();
        let mut back = vec![0.0; 3];
        from_f16(&h, &mut back).unwrap();
        assert_eq!(back, src);
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let bytes = encode_le(&src, dt);
            assert_eq!(bytes.len(), 3 * dt.size_of());
            let mut dec = vec![0.0; 3];
            decode_le(&bytes, dt, &mut dec).unwrap();
            assert_eq!(dec, src, "{dt:?}");
            assert_eq!(DType::from_name(dt.name()), Some(dt));
        }
        assert!(decode_le(&[0u8; 5], DType::F32, &mut [0.0; 1]).is_err());
    }
}
