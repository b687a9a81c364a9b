//! Element types that travel through collectives, and the reduction kernels over them.
//!
//! Half-precision types (bf16, f16) are combined in f32 and rounded once per combination, as
//! NCCL does: `bf16(f32(a) + f32(b))`. Integer sums wrap (two's complement); integer averages
//! truncate toward zero (`sum / n`).
use half::{bf16, f16};

/// Wire code of an element type (travels in message headers so mismatches are detected).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32 = 1,
    BF16 = 2,
    F16 = 3,
    I32 = 4,
    I64 = 5,
    U8 = 6,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::BF16,
            3 => DType::F16,
            4 => DType::I32,
            5 => DType::I64,
            6 => DType::U8,
            _ => return None,
        })
    }

    /// Lower-case name (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }
}

/// How values from different ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 1,
    /// Sum, then divided by the group size.
    Avg = 2,
    Max = 3,
    Min = 4,
}

impl ReduceOp {
    pub(crate) fn from_code(code: u8) -> Option<ReduceOp> {
        Some(match code {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Avg,
            3 => ReduceOp::Max,
            4 => ReduceOp::Min,
            _ => return None,
        })
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// A plain value type collectives can move and reduce.
pub trait Element: bytemuck::Pod + PartialEq + std::fmt::Debug + Send + Sync + 'static {
    const DTYPE: DType;
    fn add(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    /// `self / n` (for [`ReduceOp::Avg`]).
    fn div_n(self, n: usize) -> Self;
}

macro_rules! float_element {
    ($t:ty, $d:expr, $to:expr, $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                $from($to(a) + $to(b))
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                $from($to(a).max($to(b)))
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                $from($to(a).min($to(b)))
            }
            #[inline(always)]
            fn div_n(self, n: usize) -> Self {
                $from($to(self) / n as f32)
            }
        }
    };
}

float_element!(f32, DType::F32, |x: f32| x, |x: f32| x);
float_element!(bf16, DType::BF16, bf16::to_f32, bf16::from_f32);
float_element!(f16, DType::F16, f16::to_f32, f16::from_f32);

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn div_n(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}

int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

/// `dst[i] = op(dst[i], src[i])` (Avg combines as Sum; the division happens once at the end).
pub fn reduce_slice<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
    #[inline(always)]
    fn apply<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f(*d, *s);
        }
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => apply(dst, src, T::add),
        ReduceOp::Max => apply(dst, src, T::max),
        ReduceOp::Min => apply(dst, src, T::min),
    }
}

/// Divides every element by `n` (the last step of [`ReduceOp::Avg`]).
pub fn scale_avg<T: Element>(buf: &mut [T], n: usize) {
    for x in buf {
        *x = x.div_n(n);
    }
}

/// [`scale_avg`] on bytes holding `T`s (type-erased, for the single-copy receive path).
pub(crate) type ScaleBytesFn = fn(&mut [u8], usize);

pub(crate) fn scale_avg_bytes<T: Element>(buf: &mut [u8], n: usize) {
    scale_avg::<T>(bytemuck::cast_slice_mut(buf), n)
}

/// A type-erased reduction of raw bytes into raw bytes, used by the receive path so a receiver
/// can reduce straight out of a transport buffer.
pub(crate) type ReduceBytesFn = fn(&mut [u8], &[u8], ReduceOp);

/// `dst op= src` on bytes holding `T`s. `dst` comes from a `&mut [T]` and is aligned; `src`
/// is aligned by the transports (8-byte aligned offsets), with a copying fallback otherwise.
pub(crate) fn reduce_bytes<T: Element>(dst: &mut [u8], src: &[u8], op: ReduceOp) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(src) => reduce_slice(dst, src, op),
        Err(_) => {
            let src: Vec<T> = src
                .chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned)
                .collect();
            reduce_slice(dst, &src, op)
        }
    }
}
