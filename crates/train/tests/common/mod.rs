//! What several training tests share: a run of ranks as threads whose whole model is read
//! back from its checkpoint, whatever its layout.
use std::path::Path;

use train::trainer::Trainer;
use train::RunConfig;

/// `steps` optimizer steps of `cfg` on `nproc` ranks as threads (from checkpoint `from` if
/// given; every step `global_batch` sequences): rank 0's (loss, grad norm) per step, and the
/// whole model read back from the checkpoint the run saves to `save` (the one layout of a
/// checkpoint, whatever the run's).
pub fn run_read_back(
    cfg: &RunConfig,
    nproc: usize,
    global_batch: usize,
    (from, steps, save): (Option<&Path>, usize, &Path),
) -> (Vec<(f64, f32)>, Vec<f32>) {
    let mut out = comm::testing::run_threads(nproc, |c| {
        let mut t = match from {
            Some(ck) => Trainer::resume(cfg.clone(), ck, &c).unwrap(),
            None => Trainer::new(cfg.clone(), &c).unwrap(),
        };
        assert_eq!(t.sampler.global_batch(), global_batch);
        let stats: Vec<(f64, f32)> = (0..steps)
            .map(|_| {
                let s = t.train_step().unwrap();
                (s.loss, s.stats.grad_norm)
            })
            .collect();
        t.save_checkpoint(save).unwrap();
        stats
    });
    let params = train::trainer::load_model(save).unwrap().2;
    (out.remove(0), params)
}
