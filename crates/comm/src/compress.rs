//! Compressed reductions of fp32 data: each rank's values travel in a 16- or 8-bit [`Codec`]
//! and are summed in fp32 where they arrive, so the only errors are one rounding of every
//! input and one of the result — never a rounding per hop, as a ring or tree reduction in the
//! narrow type would make.
//!
//! - [`all_reduce`]: a reduce-scatter by direct exchange (rank `i` receives every rank's
//!   encoded piece `i` — [`crate::shard_range`] — and sums the decoded pieces in rank order),
//!   then an all-gather of the encoded sums. Every rank decodes the same bytes, so all hold the
//!   same result. Bytes sent per rank: `2·(n−1)/n·N` elements of the codec (a ring all-reduce
//!   of fp32 sends `2·(n−1)/n·N·4` bytes), so bf16 halves the volume and fp8 quarters it.
//! - [`reduce`]: every rank's encoded buffer is gathered at the root, which sums the decoded
//!   buffers in rank order.
//!
//! The root's own contribution is encoded and decoded like every other, so the result does
//! not depend on which rank owns a piece: `Σ_r decode(encode(x_r))`, summed in rank order.
//! With [`Codec::F32`] (no rounding at all) this makes an exact-order reduction: every element
//! is the same rank-order sum wherever it sits in the buffer, which a ring or tree reduction
//! (whose order depends on the element's chunk or on the root) does not give — the executor
//! reduces the copies of tied tensors so, which keeps them equal bit for bit.
//!
//! fp8 is E4M3 (OCP "e4m3fn": 4 exponent bits with bias 7, 3 mantissa bits, largest finite
//! 448, no infinities) with one fp32 scale per encoded piece, `s = max|x| / 448`, stored before
//! the piece's bytes: values are encoded as `e4m3(x / s)` (round to nearest even, saturating)
//! and decoded as `s · e4m3⁻¹(b)`. A non-finite input makes the scale NaN, so the piece decodes
//! to NaN and an fp16 overflow check downstream still sees it.
use half::bf16;

use crate::backend::Backend;
use crate::error::{CommError, Result};
use crate::shard_range;

/// The group a compressed reduction runs on: its name, size and this rank.
pub(crate) struct On<'a> {
    pub group: &'a str,
    pub n: usize,
    pub me: usize,
}

impl On<'_> {
    /// A piece from rank `rank` that does not decode: the ranks disagree on the buffer.
    fn mismatch(&self, op: &str, rank: usize, detail: String) -> CommError {
        CommError::Mismatch {
            group: self.group.to_string(),
            op: op.to_string(),
            rank,
            detail,
        }
    }
}

/// The format of values on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// fp32 itself (4 bytes per value): no compression, only the reduction order.
    F32,
    /// bfloat16: 8 exponent bits, 8 significand bits (2 bytes per value).
    Bf16,
    /// E4M3 with a per-piece fp32 scale (1 byte per value + 4 per piece).
    Fp8,
}

/// The largest finite E4M3 value.
const E4M3_MAX: f32 = 448.0;

impl Codec {
    /// Encoded bytes of `n` values (one piece).
    pub fn encoded_len(self, n: usize) -> usize {
        match self {
            Codec::F32 => 4 * n,
            Codec::Bf16 => 2 * n,
            Codec::Fp8 => 4 + n,
        }
    }

    /// Appends the encoding of `x` (one piece) to `out`.
    pub fn encode(self, x: &[f32], out: &mut Vec<u8>) {
        match self {
            Codec::F32 => {
                out.reserve(4 * x.len());
                for &v in x {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Codec::Bf16 => {
                out.reserve(2 * x.len());
                for &v in x {
                    out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            Codec::Fp8 => {
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let any_nan = x.iter().any(|v| v.is_nan());
                let scale = if any_nan || !amax.is_finite() {
                    f32::NAN
                } else if amax == 0.0 {
                    1.0
                } else {
                    amax / E4M3_MAX
                };
                out.extend_from_slice(&scale.to_le_bytes());
                if scale.is_nan() {
                    out.resize(out.len() + x.len(), 0);
                } else {
                    out.extend(x.iter().map(|&v| e4m3_from_f32(v / scale)));
                }
            }
        }
    }

    /// Decodes one piece of `out.len()` values from `bytes` (exactly `encoded_len` bytes)
    /// into `out`, adding when `add` (fp32 accumulation), else overwriting. A piece of the
    /// wrong length is an error saying so.
    pub fn decode(
        self,
        bytes: &[u8],
        out: &mut [f32],
        add: bool,
    ) -> std::result::Result<(), String> {
        if bytes.len() != self.encoded_len(out.len()) {
            return Err(format!(
                "a {self:?} piece of {} values needs {} bytes, got {} (buffers of different lengths?)",
                out.len(),
                self.encoded_len(out.len()),
                bytes.len()
            ));
        }
        let put = |o: &mut f32, v: f32| {
            if add {
                *o += v
            } else {
                *o = v
            }
        };
        match self {
            Codec::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    put(o, f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                }
            }
            Codec::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    put(
                        o,
                        bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
                    );
                }
            }
            Codec::Fp8 => {
                let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                let table = e4m3_table();
                for (o, &b) in out.iter_mut().zip(&bytes[4..]) {
                    put(o, scale * table[b as usize]);
                }
            }
        }
        Ok(())
    }

    /// `x` as the receiver sees it: encoded and decoded.
    pub fn round_trip(self, x: &[f32]) -> Vec<f32> {
        let mut bytes = Vec::new();
        self.encode(x, &mut bytes);
        let mut out = vec![0.0; x.len()];
        self.decode(&bytes, &mut out, false)
            .expect("a piece this codec encoded");
        out
    }
}

/// The value of every E4M3 code (the two NaN codes, 0x7f and 0xff, decode to NaN).
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [0.0f32; 256];
        for (code, v) in t.iter_mut().enumerate() {
            let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
            let e = ((code >> 3) & 0xf) as i32;
            let m = (code & 7) as f32;
            *v = if code & 0x7f == 0x7f {
                f32::NAN
            } else if e == 0 {
                sign * m / 8.0 * 2f32.powi(-6)
            } else {
                sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
            };
        }
        t
    })
}

/// `x` as E4M3: round to nearest, ties to even; beyond ±448 saturates to ±448; NaN → 0x7f.
/// Integer and exact float operations only (no division, no library call), so the encoding
/// loop vectorises.
#[inline]
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    let code = if a >= E4M3_MAX {
        0x7e
    } else if a < 1.0 / 64.0 {
        // Subnormals: multiples of 2^-9. `a·512` is exact and below 8; adding and removing
        // 2^23 rounds it to an integer, to nearest and ties to even (the f32 rounding mode);
        // a = 2^-6 (code 8), the smallest normal, is reached exactly as code 8.
        const MAGIC: f32 = 8_388_608.0;
        ((a * 512.0 + MAGIC) - MAGIC) as u8
    } else {
        // a = 2^e · 1.m: keep the top 3 of the 23 mantissa bits, rounding the 20 dropped ones
        // to nearest, ties to even (add 2^19 − 1 plus the kept lowest bit); a carry out of
        // the mantissa increments the exponent, as it must. Re-bias the exponent from 127 to
        // 7; values rounding past 448 saturate.
        let bits = a.to_bits();
        let rounded = (bits + 0x7_ffff + ((bits >> 20) & 1)) >> 20;
        (rounded - ((127 - 7) << 3)).min(0x7e) as u8
    };
    sign | code
}

/// Sums `buf` over the group: every rank's values encoded once, summed in fp32 in rank order,
/// the sum encoded once (see the module doc). The same result on every rank.
pub(crate) fn all_reduce(b: &mut Backend, buf: &mut [f32], codec: Codec, on: On<'_>) -> Result<()> {
    const OP: &str = "compressed all_reduce";
    let (n, me) = (on.n, on.me);
    if n == 1 {
        let r = codec.round_trip(buf);
        buf.copy_from_slice(&r);
        return Ok(());
    }
    let len = buf.len();
    // Reduce-scatter: piece i of every rank goes to rank i.
    let mut send = Vec::with_capacity(codec.encoded_len(len) + 4 * n);
    let mut counts = Vec::with_capacity(n);
    for i in 0..n {
        let before = send.len();
        codec.encode(&buf[shard_range(len, n, i)], &mut send);
        counts.push(send.len() - before);
    }
    let (recv, recv_counts) = b.all_to_all_v::<u8>(&send, &counts)?;
    b.end_op(true);
    let own = shard_range(len, n, me);
    let mut sum = vec![0.0f32; own.len()];
    let mut at = 0;
    for (r, &c) in recv_counts.iter().enumerate() {
        codec
            .decode(&recv[at..at + c], &mut sum, r > 0)
            .map_err(|d| on.mismatch(OP, r, d))?;
        at += c;
    }
    // All-gather of the encoded sums; every rank decodes the same bytes.
    let mut mine = Vec::with_capacity(codec.encoded_len(own.len()));
    codec.encode(&sum, &mut mine);
    let (all, all_counts) = b.all_gather_v::<u8>(&mine)?;
    let mut at = 0;
    for (i, &c) in all_counts.iter().enumerate() {
        codec
            .decode(&all[at..at + c], &mut buf[shard_range(len, n, i)], false)
            .map_err(|d| on.mismatch(OP, i, d))?;
        at += c;
    }
    Ok(())
}

/// Sums `buf` over the group onto `root` (every rank's values encoded once, summed in fp32 in
/// rank order); other ranks' buffers are unchanged.
pub(crate) fn reduce(
    b: &mut Backend,
    buf: &mut [f32],
    codec: Codec,
    root: usize,
    on: On<'_>,
) -> Result<()> {
    let (n, me) = (on.n, on.me);
    let mut mine = Vec::with_capacity(codec.encoded_len(buf.len()));
    codec.encode(buf, &mut mine);
    let m = mine.len();
    let mut all = (me == root).then(|| vec![0u8; n * m]);
    b.gather::<u8>(&mine, all.as_deref_mut(), root)?;
    if let Some(all) = all.filter(|_| !buf.is_empty()) {
        for (r, piece) in all.chunks_exact(m).enumerate() {
            codec
                .decode(piece, buf, r > 0)
                .map_err(|d| on.mismatch("compressed reduce", r, d))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite code decodes and re-encodes to itself; every f32 goes to the nearest code
    /// (ties to the even code), checked against a search over all codes.
    #[test]
    fn e4m3_round_trips_and_rounds_to_nearest_even() {
        let t = e4m3_table();
        for code in 0..=255u8 {
            if code & 0x7f == 0x7f {
                assert!(t[code as usize].is_nan());
                continue;
            }
            let v = t[code as usize];
            let back = e4m3_from_f32(v);
            // +0 and -0 are distinct codes with equal values.
            assert_eq!(back, code, "code {code:#x} = {v}");
        }
        assert_eq!(t[0x7e], 448.0);
        assert_eq!(t[0x01], 2f32.powi(-9));
        let finite: Vec<(u8, f32)> = (0..=255u8)
            .filter(|c| c & 0x7f != 0x7f)
            .map(|c| (c, t[c as usize]))
            .collect();
        let mut s = 0x2545F4914F6CDD1Du64;
        for i in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Magnitudes over the whole range, subnormals included, and exact midpoints.
            let x = if i % 5 == 0 {
                let a = finite[(s % finite.len() as u64) as usize].1;
                let b = finite[((s >> 20) % finite.len() as u64) as usize].1;
                (a + b) / 2.0
            } else {
                let mant = (s >> 40) as f32 / (1u64 << 24) as f32;
                let exp = ((s >> 8) % 24) as i32 - 14;
                let sign = if s & 1 == 0 { 1.0 } else { -1.0 };
                sign * (1.0 + mant) * 2f32.powi(exp)
            };
            let got = e4m3_from_f32(x);
            let want = if x.abs() >= 448.0 {
                if x < 0.0 {
                    0xfe
                } else {
                    0x7e
                }
            } else {
                let best = finite.iter().map(|&(c, v)| ((v - x).abs(), c)).fold(
                    (f32::INFINITY, 0u8),
                    |(bd, bc), (d, c)| {
                        let even = c & 1 == 0;
                        if d < bd || (d == bd && even && (bc & 1 == 1)) {
                            (d, c)
                        } else {
                            (bd, bc)
                        }
                    },
                );
                best.1
            };
            // Codes of equal value (±0) are interchangeable.
            assert_eq!(
                t[got as usize], t[want as usize],
                "x = {x:e}: {got:#x} vs {want:#x}"
            );
        }
    }

    #[test]
    fn codecs_round_within_their_precision() {
        let x: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let amax = 3.0f32;
        for (codec, rel) in [
            (Codec::F32, 0.0),
            (Codec::Bf16, 2f32.powi(-8)),
            (Codec::Fp8, 2f32.powi(-4)),
        ] {
            let y = codec.round_trip(&x);
            for (a, b) in x.iter().zip(&y) {
                // Round to nearest: half an ulp of the value (bf16) or of the scaled value
                // (fp8, whose subnormals below 2^-6·s are absolute steps of 2^-10·s).
                let bound = match codec {
                    Codec::F32 | Codec::Bf16 => a.abs() * rel,
                    Codec::Fp8 => (a.abs() * rel).max(amax / 448.0 * 2f32.powi(-10)),
                };
                assert!((a - b).abs() <= bound * 1.0001, "{codec:?}: {a} -> {b}");
            }
        }
        let mut nan = x.clone();
        nan[3] = f32::INFINITY;
        assert!(Codec::Fp8.round_trip(&nan).iter().all(|v| v.is_nan()));
        assert!(Codec::Bf16.round_trip(&nan)[3].is_infinite());
        assert!(Codec::Fp8.round_trip(&[0.0; 4]).iter().all(|&v| v == 0.0));
        let mut bytes = Vec::new();
        Codec::Bf16.encode(&x, &mut bytes);
        assert!(Codec::Bf16
            .decode(&bytes[1..], &mut vec![0.0; x.len()], false)
            .is_err());
    }
}
