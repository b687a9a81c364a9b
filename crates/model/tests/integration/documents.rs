//! Document masking on one process: a packed batch (several documents per row, block-causal
//! attention, positions restarting per document) equals running each document as a batch of
//! its own — logits, and gradients of the packed mean loss against the same weighted sum of
//! the documents' gradients — within 1e-5.

use model::{Batch, Documents, Model, ModelConfig, StepOptions};

/// Two rows of 12 tokens: row 0 holds documents of 5 and 7 tokens, row 1 of 3, 1 and 8
/// (a one-token document has no target but still attends to itself).
const SEQ: usize = 12;
const OPENS: [&[usize]; 2] = [&[0, 5], &[0, 3, 4]];

fn cfg() -> ModelConfig {
    let mut c = ModelConfig::llama(48, 32, 40, 2, 4, 2);
    c.initializer_range = 0.2;
    c
}

fn ids() -> Vec<u32> {
    (0..2 * SEQ).map(|i| ((i * 13 + 5) % 48) as u32).collect()
}

fn packed(restart_positions: bool) -> Batch {
    let docs = Documents::from_openings(2, SEQ, restart_positions, |b, p| OPENS[b].contains(&p));
    Batch::next_token_per_document(&ids(), docs).unwrap()
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Logits and gradients of the packed batch, and of its documents run one by one (each a
/// batch of one row), the documents' gradients weighted by their share of the packed batch's
/// valid targets: the packed loss is `Σ_d n_d·mean_d / N`, so its gradient is
/// `Σ_d (n_d/N)·∇mean_d`.
fn packed_and_separate(b: &Batch) -> [(Vec<f32>, Vec<f32>); 2] {
    let m = Model::new(cfg()).unwrap();
    let p = m.init_params(3);
    let logits = m.logits_of(&p[..], b).unwrap();
    let mut g = vec![0.0; m.num_params()];
    m.forward_backward(&p[..], &mut g, b, &StepOptions::default(), &mut |_| {})
        .unwrap();
    let docs = b.docs.as_ref().unwrap();
    let n_valid = b.targets.iter().filter(|&&t| t >= 0).count() as f32;
    let v = cfg().vocab_size;
    let (mut sep_logits, mut sep_g) = (vec![0.0; logits.len()], vec![0.0; g.len()]);
    for (row, start, len) in docs.spans() {
        let at = row * SEQ + start;
        let doc = Batch::next_token(1, len, &b.inputs[at..at + len]).unwrap();
        let l = m.logits_of(&p[..], &doc).unwrap();
        sep_logits[at * v..(at + len) * v].copy_from_slice(&l);
        let opts = StepOptions {
            loss_scale: (len - 1) as f32 / n_valid,
            ..StepOptions::default()
        };
        m.forward_backward(&p[..], &mut sep_g, &doc, &opts, &mut |_| {})
            .unwrap();
    }
    [(logits, sep_logits), (g, sep_g)]
}

#[test]
fn packed_documents_equal_separate_runs() {
    let [(l, sl), (g, sg)] = packed_and_separate(&packed(true));
    // Each packed token computes the same sums as in its own run (same keys, same positions);
    // only the reduction order of the weight gradients over tokens differs: f32 rounding.
    assert!(max_rel(&l, &sl) < 1e-5, "logits {:e}", max_rel(&l, &sl));
    assert!(max_rel(&g, &sg) < 1e-5, "grads {:e}", max_rel(&g, &sg));
}

/// Without restarting positions, a document's tokens keep their row positions: RoPE makes the
/// scores depend on relative positions only, so the results still equal the separate runs up
/// to the rounding of the rotation angles (as the blocks' position-offset test).
#[test]
fn packed_documents_without_restarted_positions_equal_separate_runs() {
    let [(l, sl), (g, sg)] = packed_and_separate(&packed(false));
    assert!(max_rel(&l, &sl) < 1e-5, "logits {:e}", max_rel(&l, &sl));
    assert!(max_rel(&g, &sg) < 1e-5, "grads {:e}", max_rel(&g, &sg));
}

/// The mask is not a no-op: the same packed tokens without documents attend across the
/// boundaries, and their logits differ.
#[test]
fn without_the_mask_documents_see_each_other() {
    let b = packed(true);
    let m = Model::new(cfg()).unwrap();
    let p = m.init_params(3);
    let plain = Batch {
        docs: None,
        ..b.clone()
    };
    let d = max_rel(
        &m.logits_of(&p[..], &plain).unwrap(),
        &m.logits_of(&p[..], &b).unwrap(),
    );
    assert!(d > 1e-3, "{d:e}");
}

#[test]
fn documents_of_another_shape_are_refused() {
    let docs = Documents::from_openings(1, SEQ, false, |_, p| p == 4);
    let e = Batch::next_token(2, SEQ, &ids())
        .unwrap()
        .with_documents(docs)
        .unwrap_err();
    assert!(e.to_string().contains("1 × 12"), "{e}");
}
