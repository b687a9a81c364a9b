//! Context-parallel attention alone, against the single-process kernel over whole sequences:
//! ring and all-gather, cp ∈ {1, 2, 3, 4}, every balance (none, zigzag, striped), GQA ratios
//! 1, 2 and 4; the forward's output and log-sum-exp and the backward's dQ, dK, dV of every
//! rank's tokens within 1e-5 of the largest reference element (fp32). The errors per cp are
//! printed (`--nocapture`): they stay at the level of f32 reassociation, and the backward's
//! do not grow with the ring.
use model::layers::attention::AttentionCore;
use parallel::context_parallel::ring::ContextAttention;
use parallel::context_parallel::{CpBalance, CpComm, CpLayout};
use tensor::attention::{attention_backward, attention_forward, AttnShape, AttnTiles};

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut r = model::init::SplitMix64::new(seed);
    (0..n).map(|_| r.next_normal() as f32).collect()
}

/// Max |a − b| over max |b|.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// The `[batch, heads, seq]` lse's entries of this rank's positions.
fn slice_lse(lse: &[f32], lay: &CpLayout, batch: usize, heads: usize, seq: usize) -> Vec<f32> {
    let len = lay.local_len(seq);
    let pos = lay.part(seq).positions(len);
    let mut out = Vec::new();
    for bh in 0..batch * heads {
        out.extend(pos.iter().map(|&p| lse[bh * seq + p]));
    }
    out
}

/// Errors (forward out, lse, dq, dk, dv) of one configuration, worst over ranks.
fn errors(cp: usize, balance: CpBalance, comm: CpComm, gqa: usize) -> [f32; 5] {
    let (batch, heads, d) = (2, 4, 8);
    let kv_heads = heads / gqa;
    let seq = 8 * cp;
    let shape = AttnShape::causal(batch, seq, heads, kv_heads, d);
    let q = rand(shape.q_elems(), 1);
    let k = rand(shape.kv_elems(), 2);
    let v = rand(shape.kv_elems(), 3);
    let dout = rand(shape.q_elems(), 4);
    let mut o = vec![0.0; shape.q_elems()];
    let mut lse = vec![0.0; shape.lse_elems()];
    attention_forward(&shape, &q, &k, &v, &mut o, &mut lse, AttnTiles::default()).unwrap();
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; shape.q_elems()],
        vec![0.0; shape.kv_elems()],
        vec![0.0; shape.kv_elems()],
    );
    attention_backward(
        &shape,
        &q,
        &k,
        &v,
        &o,
        &lse,
        &dout,
        &mut dq,
        &mut dk,
        &mut dv,
        AttnTiles::default(),
    )
    .unwrap();
    let per_rank = comm::testing::run_threads(cp, |c| {
        let lay = CpLayout {
            cp,
            rank: c.rank(),
            balance,
        };
        lay.check(seq).unwrap();
        let dkv = c.new_group(&(0..cp).collect::<Vec<_>>()).unwrap();
        let core = ContextAttention::new(lay, comm, c.world().clone(), dkv).unwrap();
        let (hd, kvd) = (heads * d, kv_heads * d);
        let local = AttnShape::causal(batch, lay.local_len(seq), heads, kv_heads, d);
        let part = lay.part(seq);
        let (ql, kl, vl, dl) = (
            lay.slice(&q, batch, seq, hd),
            lay.slice(&k, batch, seq, kvd),
            lay.slice(&v, batch, seq, kvd),
            lay.slice(&dout, batch, seq, hd),
        );
        let (ol, lsel) = core.forward(&local, part, &ql, &kl, &vl).unwrap();
        let (dql, dkl, dvl) = core
            .backward(&local, part, &ql, &kl, &vl, &ol, &lsel, &dl)
            .unwrap();
        [
            rel(&ol, &lay.slice(&o, batch, seq, hd)),
            rel(&lsel, &slice_lse(&lse, &lay, batch, heads, seq)),
            rel(&dql, &lay.slice(&dq, batch, seq, hd)),
            rel(&dkl, &lay.slice(&dk, batch, seq, kvd)),
            rel(&dvl, &lay.slice(&dv, batch, seq, kvd)),
        ]
    });
    let mut worst = [0.0f32; 5];
    for e in per_rank {
        for i in 0..5 {
            worst[i] = worst[i].max(e[i]);
        }
    }
    worst
}

#[test]
fn ring_and_allgather_attention_equal_the_single_process_kernel() {
    eprintln!("cp  balance  comm       gqa  out       lse       dq        dk        dv");
    for cp in 1..=4 {
        for balance in [CpBalance::None, CpBalance::Zigzag, CpBalance::Striped] {
            for comm in [CpComm::Ring, CpComm::AllGather] {
                for gqa in [1, 2, 4] {
                    let e = errors(cp, balance, comm, gqa);
                    eprintln!(
                        "{cp}   {balance:<8?} {comm:<10?} {gqa}    {:.1e}   {:.1e}   {:.1e}   {:.1e}   {:.1e}",
                        e[0], e[1], e[2], e[3], e[4]
                    );
                    for (what, x) in ["out", "lse", "dq", "dk", "dv"].iter().zip(e) {
                        assert!(
                            x < 1e-5,
                            "cp={cp} {balance:?} {comm:?} gqa={gqa}: {what} differs by {x:e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_part_other_than_the_ranks_own_is_refused() {
    let errs = comm::testing::run_threads(2, |c| {
        let lay = CpLayout {
            cp: 2,
            rank: c.rank(),
            balance: CpBalance::Zigzag,
        };
        let dkv = c.new_group(&[0, 1]).unwrap();
        let core = ContextAttention::new(lay, CpComm::Ring, c.world().clone(), dkv).unwrap();
        let shape = AttnShape::causal(1, 4, 2, 2, 4);
        let x = vec![0.0; shape.q_elems()];
        core.forward(&shape, model::layers::SeqPart::Offset(0), &x, &x, &x)
            .unwrap_err()
            .to_string()
    });
    assert!(errs[0].contains("expects its own tokens"), "{}", errs[0]);
}
