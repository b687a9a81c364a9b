//! Context-parallel attention alone, against the single-process kernel over whole sequences:
//! ring and all-gather, cp ∈ {1, 2, 3, 4}, every balance (none, zigzag, striped), GQA ratios
//! 1, 2 and 4; the forward's output and log-sum-exp and the backward's dQ, dK, dV of every
//! rank's tokens within 1e-5 of the largest reference element (fp32). The errors per cp are
//! printed (`--nocapture`): they stay at the level of f32 reassociation, and the backward's
//! do not grow with the ring. Every configuration runs twice: plain causal, and block-causal
//! over packed documents (the single-process kernel's document mask as the reference).
use model::layers::attention::AttentionCore;
use model::layers::{Buf, BufRef};
use model::Documents;
use parallel::context_parallel::ring::ContextAttention;
use parallel::context_parallel::{CpBalance, CpComm, CpLayout};
use tensor::attention::{attention_backward_docs, attention_forward_docs, AttnShape, AttnTiles};

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

/// Packed documents of `[2, seq]` rows: row 0 opens one at every position ≡ 3 (mod 5) (short
/// documents, boundaries inside every rank's part), row 1 at multiples of 7 — and a document
/// of one token at 1.
fn packed(seq: usize) -> Documents {
    Documents::from_openings(2, seq, false, |b, p| {
        if b == 0 {
            p % 5 == 3
        } else {
            p.is_multiple_of(7) || p == 1 || p == 2
        }
    })
}

/// Errors (forward out, lse, dq, dk, dv) of one configuration, worst over ranks.
fn errors(cp: usize, balance: CpBalance, comm: CpComm, gqa: usize, masked: bool) -> [f32; 5] {
    let (batch, heads, d) = (2, 4, 8);
    let kv_heads = heads / gqa;
    let seq = 8 * cp;
    let docs = masked.then(|| packed(seq));
    let starts = docs.as_ref().map(|d| d.starts());
    let shape = AttnShape::causal(batch, seq, heads, kv_heads, d);
    let q = rand(shape.q_elems(), 1);
    let k = rand(shape.kv_elems(), 2);
    let v = rand(shape.kv_elems(), 3);
    let dout = rand(shape.q_elems(), 4);
    let mut o = vec![0.0; shape.q_elems()];
    let mut lse = vec![0.0; shape.lse_elems()];
    let t = AttnTiles::default();
    attention_forward_docs(&shape, starts, &q, &k, &v, &mut o, &mut lse, t).unwrap();
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; shape.q_elems()],
        vec![0.0; shape.kv_elems()],
        vec![0.0; shape.kv_elems()],
    );
    attention_backward_docs(
        &shape,
        starts,
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
        let docs = docs.as_ref();
        fn r(v: &[f32]) -> BufRef<'_> {
            BufRef::Host(v)
        }
        let (ol, lsel) = core
            .forward(&local, part, docs, r(&ql), r(&kl), r(&vl))
            .unwrap();
        let (dql, dkl, dvl) = core
            .backward(
                &local,
                part,
                docs,
                r(&ql),
                r(&kl),
                r(&vl),
                ol.r(),
                lsel.r(),
                r(&dl),
            )
            .unwrap();
        let h = |b: &Buf| b.as_host("test").unwrap().to_vec();
        let (ol, lsel, dql, dkl, dvl) = (h(&ol), h(&lsel), h(&dql), h(&dkl), h(&dvl));
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
    eprintln!("cp  balance  comm       gqa  docs   out       lse       dq        dk        dv");
    for cp in 1..=4 {
        for balance in [CpBalance::None, CpBalance::Zigzag, CpBalance::Striped] {
            for comm in [CpComm::Ring, CpComm::AllGather] {
                for gqa in [1, 2, 4] {
                    for masked in [false, true] {
                        let e = errors(cp, balance, comm, gqa, masked);
                        eprintln!(
                            "{cp}   {balance:<8?} {comm:<10?} {gqa}    {masked:<5}  {:.1e}   {:.1e}   {:.1e}   {:.1e}   {:.1e}",
                            e[0], e[1], e[2], e[3], e[4]
                        );
                        for (what, x) in ["out", "lse", "dq", "dk", "dv"].iter().zip(e) {
                            assert!(
                                x < 1e-5,
                                "cp={cp} {balance:?} {comm:?} gqa={gqa} docs={masked}: {what} differs by {x:e}"
                            );
                        }
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
        let x = BufRef::Host(&x);
        core.forward(&shape, model::layers::SeqPart::Offset(0), None, x, x, x)
            .unwrap_err()
            .to_string()
    });
    assert!(errs[0].contains("expects its own tokens"), "{}", errs[0]);
}

/// Bytes each rank sends per attention layer, from the communicator's statistics, against the
/// formulas of `context_parallel::ring` (one K/V block = 2·B·(S/cp)·n_kv·d·4 bytes): ring
/// forward (cp − 1) blocks; backward (cp − 1) more K/V blocks and cp dK/dV blocks (on the
/// second group); all-gather forward (cp − 1) blocks (a ring all-gather), backward (cp − 1)
/// for the gather again and (cp − 1) for the reduce-scatter of dK/dV.
#[test]
fn bytes_sent_per_layer_equal_the_formula() {
    use comm::OpKind;
    let (batch, heads, kv_heads, d) = (2, 4, 2, 8);
    for cp in [2, 3, 4] {
        for comm in [CpComm::Ring, CpComm::AllGather] {
            let seq = 8 * cp;
            let block = (2 * batch * (seq / cp) * kv_heads * d * 4) as u64;
            let got = comm::testing::run_threads(cp, |c| {
                let lay = CpLayout {
                    cp,
                    rank: c.rank(),
                    balance: CpBalance::Zigzag,
                };
                let kv = c.new_group(&(0..cp).collect::<Vec<_>>()).unwrap();
                let dkv = c.new_group(&(0..cp).collect::<Vec<_>>()).unwrap();
                let core = ContextAttention::new(lay, comm, kv.clone(), dkv.clone()).unwrap();
                let local = AttnShape::causal(batch, seq / cp, heads, kv_heads, d);
                let part = lay.part(seq);
                let q = rand(local.q_elems(), 1 + c.rank() as u64);
                let k = rand(local.kv_elems(), 7);
                let (q, k) = (BufRef::Host(&q), BufRef::Host(&k));
                let (o, lse) = core.forward(&local, part, None, q, k, k).unwrap();
                let fwd = kv.stats();
                core.backward(&local, part, None, q, k, k, o.r(), lse.r(), q)
                    .unwrap();
                let (all, grads) = (kv.stats(), dkv.stats());
                (
                    fwd.total_bytes_sent(),
                    all.total_bytes_sent() - fwd.total_bytes_sent(),
                    grads.total_bytes_sent(),
                    all.bytes_sent(OpKind::P2p) + grads.bytes_sent(OpKind::P2p),
                )
            });
            let n = cp as u64;
            let want = match comm {
                CpComm::Ring => ((n - 1) * block, (n - 1) * block, n * block),
                CpComm::AllGather => ((n - 1) * block, 2 * (n - 1) * block, 0),
            };
            for (r, g) in got.iter().enumerate() {
                assert_eq!((g.0, g.1, g.2), want, "cp={cp} {comm:?} rank {r}");
                if comm == CpComm::AllGather {
                    assert_eq!(g.3, 0, "no point-to-point traffic");
                }
            }
        }
    }
}
