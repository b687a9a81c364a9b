//! Compressed reductions (`comm::compress`) against a naive reference built from the codec
//! alone — every rank's piece encoded and decoded, summed in fp32 in rank order, the sum
//! encoded and decoded — bit for bit, for world sizes 1–5, lengths that do and do not divide,
//! fp32, bf16 and fp8; and the bytes they put on the wire against the fp32 all-reduce's.
use comm::compress::Codec;
use comm::testing::run_threads;
use comm::{shard_range, OpKind};

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = ((i * 31 + rank * 17) as f32 * 0.731).sin();
            // Magnitudes over several decades, as gradients have.
            x * 10f32.powi((i % 7) as i32 - 4)
        })
        .collect()
}

fn all_reduce_reference(n: usize, len: usize, codec: Codec) -> Vec<f32> {
    let mut out = vec![0.0; len];
    for i in 0..n {
        let s = shard_range(len, n, i);
        let mut acc = codec.round_trip(&input(0, len)[s.clone()]);
        for r in 1..n {
            let v = codec.round_trip(&input(r, len)[s.clone()]);
            acc.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
        }
        out[s].copy_from_slice(&codec.round_trip(&acc));
    }
    out
}

fn reduce_reference(n: usize, len: usize, codec: Codec) -> Vec<f32> {
    let mut acc = codec.round_trip(&input(0, len));
    for r in 1..n {
        let v = codec.round_trip(&input(r, len));
        acc.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
    }
    acc
}

#[test]
fn compressed_reductions_match_the_reference() {
    for n in 1..=5 {
        run_threads(n, |c| {
            let g = c.world();
            let r = g.rank();
            for codec in [Codec::F32, Codec::Bf16, Codec::Fp8] {
                for len in [0, 1, 3, 64, 1001] {
                    let want = all_reduce_reference(n, len, codec);
                    let mut buf = input(r, len);
                    g.all_reduce_compressed(&mut buf, codec).unwrap();
                    assert_eq!(buf, want, "{codec:?} all_reduce n={n} len={len}");
                    let got = g
                        .all_reduce_compressed_async(input(r, len), codec)
                        .wait()
                        .unwrap();
                    assert_eq!(got, want, "{codec:?} async all_reduce n={n} len={len}");
                    let root = len % n;
                    let got = g
                        .reduce_compressed_async(input(r, len), codec, root)
                        .wait()
                        .unwrap();
                    if r == root {
                        assert_eq!(got, reduce_reference(n, len, codec), "{codec:?} reduce");
                    } else {
                        assert_eq!(got, input(r, len), "reduce leaves non-roots intact");
                    }
                }
            }
        });
    }
}

/// bf16 sends half the bytes of the bandwidth-optimal fp32 all-reduce (the ring's
/// `2·(n−1)/n·N·4`), fp8 a quarter (plus scales and counts).
#[test]
fn compressed_reductions_send_a_half_and_a_quarter_of_the_bytes() {
    let (n, len) = (4, 1 << 16);
    let sent = run_threads(n, |c| {
        let g = c.world();
        let mut buf = input(g.rank(), len);
        g.reset_stats();
        g.all_reduce_with(&mut buf, comm::ReduceOp::Sum, comm::AllReduceAlgo::Ring)
            .unwrap();
        let fp32 = g.stats().total_bytes_sent();
        let mut out = Vec::new();
        for codec in [Codec::Bf16, Codec::Fp8] {
            g.reset_stats();
            g.all_reduce_compressed(&mut buf, codec).unwrap();
            let s = g.stats();
            assert_eq!(
                s.total_bytes_sent(),
                s.bytes_sent(OpKind::AllToAllV) + s.bytes_sent(OpKind::AllGatherV)
            );
            out.push(s.total_bytes_sent() as f64 / fp32 as f64);
        }
        out
    });
    for ratios in sent {
        assert!(
            (0.49..0.52).contains(&ratios[0]),
            "bf16 / fp32 bytes = {}",
            ratios[0]
        );
        assert!(
            (0.24..0.27).contains(&ratios[1]),
            "fp8 / fp32 bytes = {}",
            ratios[1]
        );
    }
}

/// Ranks whose buffers differ in length get an error naming the mismatch, not a wrong sum.
#[test]
fn mismatched_lengths_are_an_error() {
    let res = run_threads(2, |c| {
        let g = c.world();
        let mut buf = input(g.rank(), 10 + g.rank());
        g.all_reduce_compressed(&mut buf, Codec::Bf16)
    });
    assert!(res.iter().any(|r| r.is_err()), "{res:?}");
}

/// `Codec::F32` is exact and its order is the rank order wherever an element sits: the same
/// values reduced at another offset of a longer buffer, or onto another root, give the same
/// bits (what keeps the copies of a tied tensor equal in the executor).
#[test]
fn the_f32_codec_sums_every_element_in_rank_order() {
    for n in 1..=5 {
        run_threads(n, |c| {
            let g = c.world();
            let r = g.rank();
            let len = 777;
            let x = input(r, len);
            let mut direct = x.clone();
            g.all_reduce_compressed(&mut direct, Codec::F32).unwrap();
            let want: Vec<f32> = (0..len)
                .map(|i| (0..n).map(|q| input(q, len)[i]).fold(0.0f32, |a, v| a + v))
                .collect();
            assert_eq!(direct, want, "n={n}: exact rank-order sums");
            for pad in [1, 130, 501] {
                let mut shifted = shifted_input(r, pad, &x);
                g.all_reduce_compressed(&mut shifted, Codec::F32).unwrap();
                assert_eq!(&shifted[pad..], &direct[..], "n={n} pad={pad}");
                let root = pad % n;
                let got = g
                    .reduce_compressed_async(shifted_input(r, pad, &x), Codec::F32, root)
                    .wait()
                    .unwrap();
                if r == root {
                    assert_eq!(&got[pad..], &direct[..], "n={n} pad={pad} reduce");
                }
            }
        });
    }
}

/// `x` after `pad` other values.
fn shifted_input(r: usize, pad: usize, x: &[f32]) -> Vec<f32> {
    let mut v = input(r + 7, pad);
    v.extend_from_slice(x);
    v
}
