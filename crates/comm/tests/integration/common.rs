//! Shared utilities for the integration tests: deterministic small-integer inputs (so every
//! reduction is exact in every dtype, and results can be compared bit for bit with a naive
//! reference that gathers everything and computes serially).
#![allow(dead_code)]
use comm::{bf16, f16, Element, ReduceOp};

pub trait TestElem: Element {
    fn from_i(x: i64) -> Self;
    /// Reference result of reducing integer inputs (`acc` is the exact sum/max/min).
    fn expected(acc: i64, op: ReduceOp, n: usize) -> Self;
}

macro_rules! float_te {
    ($t:ty, $from:expr) => {
        impl TestElem for $t {
            fn from_i(x: i64) -> Self {
                $from(x as f32)
            }
            fn expected(acc: i64, op: ReduceOp, n: usize) -> Self {
                match op {
                    ReduceOp::Avg => $from(acc as f32 / n as f32),
                    _ => $from(acc as f32),
                }
            }
        }
    };
}
float_te!(f32, |x: f32| x);
float_te!(bf16, bf16::from_f32);
float_te!(f16, f16::from_f32);

macro_rules! int_te {
    ($t:ty) => {
        impl TestElem for $t {
            fn from_i(x: i64) -> Self {
                x as $t
            }
            fn expected(acc: i64, op: ReduceOp, n: usize) -> Self {
                match op {
                    ReduceOp::Avg => (acc / n as i64) as $t,
                    _ => acc as $t,
                }
            }
        }
    };
}
int_te!(i32);
int_te!(i64);
int_te!(u8);

/// Value of element `i` on `rank` for test case `seed`: small, so sums of 8 ranks stay exact
/// in bf16 (|sum| ≤ 64 < 256) and non-negative for u8.
pub fn val(rank: usize, i: usize, seed: u64, unsigned: bool) -> i64 {
    let mut h = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ seed;
    h ^= h >> 29;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 32;
    let v = (h % 16) as i64;
    if unsigned {
        v / 2
    } else {
        v - 8
    }
}

pub fn input<T: TestElem>(rank: usize, len: usize, seed: u64) -> Vec<T> {
    let u = T::DTYPE == comm::DType::U8;
    (0..len).map(|i| T::from_i(val(rank, i, seed, u))).collect()
}

/// Naive reference: reduce every rank's input serially.
pub fn reference<T: TestElem>(n: usize, len: usize, seed: u64, op: ReduceOp) -> Vec<T> {
    let u = T::DTYPE == comm::DType::U8;
    (0..len)
        .map(|i| {
            let vals = (0..n).map(|r| val(r, i, seed, u));
            let acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => vals.sum(),
                ReduceOp::Max => vals.max().unwrap(),
                ReduceOp::Min => vals.min().unwrap(),
            };
            T::expected(acc, op, n)
        })
        .collect()
}

pub const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// Lengths exercising 0, 1, a prime, lengths not divisible by n, and a larger one.
pub fn lengths(n: usize) -> Vec<usize> {
    vec![0, 1, 7, 13, 3 * n + 1, 1031]
}
