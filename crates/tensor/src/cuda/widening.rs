//! Exact widenings of 16-bit device buffers, registered with their bits, so that a product
//! reads the bits instead of rounding the widened values back ([`super::ops::Operand::new`]).
//!
//! In a bf16 or fp16 step the executor keeps a unit's weights in 16 bits and widens them into
//! an fp32 copy for the layers; every product then used to round its slice of that copy back
//! to 16 bits (a cast kernel: 6 bytes a parameter, in the forward and again for the input
//! gradient). Widening is exact and rounding an exactly representable value returns it, so
//! the rounded copy *is* the stored bits: a registered widening lets the product read those
//! instead, bit for bit the same operand, without the cast.
//!
//! A [`Widening`] guard registers `(values, bits, format)` and unregisters when dropped. The
//! lookup ([`bits_of`]) maps any sub-range of the registered fp32 values to the same
//! sub-range of the bits, on the same GPU and in the same format only.
//!
//! The gradients are not accumulated into 16 bits this way: cuBLASLt, asked for
//! `D = A·B + C` with `C` and `D` in bf16 and fp32 compute, rounds the product to bf16 before
//! it adds `C` (seen on an H200 with CUDA 13's cuBLASLt: `round(g + round(A·B))`, one bf16
//! unit of `A·B` off where the fp32 copy's one rounding is exact to half a unit of the sum).
//! So a product accumulates into an fp32 copy of the gradients, widened and rounded back
//! ([`super::blas`] refuses a 16-bit `D` that accumulates).

use super::driver::DevSlice;
use crate::operands::Operands;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One registered widening: fp32 values at `values` (`len` elements) widened from the 16-bit
/// `bits` in `format`, on the GPU at `gpu` (its context's address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    id: u64,
    gpu: usize,
    values: u64,
    len: usize,
    bits: u64,
    format: Operands,
}

static ENTRIES: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(1);

/// A registered widening; unregistered when dropped.
#[must_use = "the widening is registered only while the guard lives"]
#[derive(Debug)]
pub struct Widening {
    id: u64,
}

impl Widening {
    /// Registers `values` as the exact widening of `bits` (16-bit values in `format`: bf16 or
    /// fp16; same length, same GPU).
    ///
    /// # Safety
    /// For as long as the guard lives, `bits` must stay allocated and hold, unchanged, the
    /// values `values` was widened from, and `values` must stay allocated (a product handed a
    /// slice of `values` reads `bits` instead). Drop the guard before either buffer.
    pub unsafe fn register(
        values: DevSlice<'_, f32>,
        bits: DevSlice<'_, u16>,
        format: Operands,
    ) -> Result<Widening, super::CudaError> {
        if values.len() != bits.len()
            || format == Operands::F32
            || !std::sync::Arc::ptr_eq(values.gpu(), bits.gpu())
        {
            return Err(super::CudaError::Shape(format!(
                "a widening registers fp32 values with their 16-bit bits on one GPU: {} values, \
                 {} bits, {format:?}",
                values.len(),
                bits.len()
            )));
        }
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            id,
            gpu: std::sync::Arc::as_ptr(values.gpu()) as usize,
            values: values.ptr(),
            len: values.len(),
            bits: bits.ptr(),
            format,
        };
        entries().push(entry);
        Ok(Widening { id })
    }
}

impl Drop for Widening {
    fn drop(&mut self) {
        entries().retain(|e| e.id != self.id);
    }
}

fn entries() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    ENTRIES.lock().unwrap_or_else(|e| e.into_inner())
}

/// The bits address of fp32 range `(values, len)` on `gpu` in `format`, where a registration
/// holds the whole range.
fn find(entries: &[Entry], gpu: usize, values: u64, len: usize, format: Operands) -> Option<u64> {
    entries.iter().find_map(|e| {
        let end = e.values + 4 * e.len as u64;
        let inside = e.gpu == gpu
            && e.format == format
            && values >= e.values
            && values + 4 * len as u64 <= end
            && (values - e.values).is_multiple_of(4);
        inside.then(|| e.bits + (values - e.values) / 2)
    })
}

/// The 16-bit bits (in `format`) of `x`, where `x` lies inside a registered widening: the
/// operand a product in `format` would otherwise round `x` to. Empty ranges are never looked
/// up (nothing to save).
pub fn bits_of<'a>(x: DevSlice<'a, f32>, format: Operands) -> Option<DevSlice<'a, u16>> {
    if x.is_empty() || format == Operands::F32 {
        return None;
    }
    let gpu = std::sync::Arc::as_ptr(x.gpu()) as usize;
    let at = find(&entries(), gpu, x.ptr(), x.len(), format)?;
    // SAFETY: `at .. at + 2 len` lies inside registered bits (`find`), which the registration's
    // contract keeps allocated and unchanged while the widening is registered; it is, for
    // longer than `'a`, since `x` borrows the registered values, which the contract keeps
    // allocated no longer than the guard.
    Some(unsafe { DevSlice::from_raw_parts(x.gpu(), at, x.len()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, values: u64, len: usize, bits: u64) -> Entry {
        Entry {
            id,
            gpu: 7,
            values,
            len,
            bits,
            format: Operands::Bf16,
        }
    }

    /// A sub-range maps to the same sub-range of the bits (element offset × 2 bytes); a range
    /// reaching past the end, starting before it or between elements, another GPU, another
    /// format, or an unregistered address finds nothing.
    #[test]
    fn sub_ranges_map_to_the_same_elements_of_the_bits() {
        let es = [entry(1, 0x1000, 100, 0x9000), entry(2, 0x4000, 10, 0xA000)];
        let f = |values, len| find(&es, 7, values, len, Operands::Bf16);
        assert_eq!(f(0x1000, 100), Some(0x9000));
        assert_eq!(f(0x1000 + 4 * 30, 20), Some(0x9000 + 2 * 30));
        assert_eq!(f(0x1000 + 4 * 99, 1), Some(0x9000 + 2 * 99));
        assert_eq!(f(0x4000 + 8, 8), Some(0xA000 + 4));
        assert_eq!(f(0x1000 + 4 * 99, 2), None, "past the end");
        assert_eq!(f(0x0FFC, 2), None, "before the start");
        assert_eq!(f(0x1002, 1), None, "between elements");
        assert_eq!(f(0x3000, 1), None, "not registered");
        assert_eq!(find(&es, 8, 0x1000, 1, Operands::Bf16), None, "another GPU");
        assert_eq!(
            find(&es, 7, 0x1000, 1, Operands::F16),
            None,
            "another format"
        );
    }
}
