//! `xtrain bench tp`: per-rank activation bytes of the norm / residual regions under tensor
//! parallelism, with and without sequence parallelism (ranks as threads; the figures are
//! exact byte counts of what each block's cache holds, not timings).
use std::sync::Arc;

use anyhow::Result;
use model::layers::Pass;
use parallel::tensor_parallel::shard_model;
use train::RunConfig;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Preset whose model and sequence length are measured.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 2)]
    pub tp: usize,
}

pub fn run(a: Args) -> Result<()> {
    let cfg = RunConfig::load(&a.preset, None, &[])?;
    let mc = train::trainer::model_config(&cfg);
    let (b, s, h) = (cfg.train.micro_batch, cfg.model.seq_len, mc.hidden_size);
    let params = model::Model::new(mc.clone())?.init_params(1);
    println!(
        "preset {} (micro-batch {b} × seq {s}, hidden {h}), tp = {}: per-rank bytes of one block's cache",
        a.preset, a.tp
    );
    println!("{:<6} {:>18} {:>14}", "sp", "norm/residual", "block output");
    for sp in [false, true] {
        let rows = comm::testing::run_threads(a.tp, |c| -> Result<(usize, usize)> {
            let (local, m) = shard_model(&mc, c.world().clone(), sp)?;
            let p = m.plan.shard(&params, m.rank());
            let x: Vec<f32> = (0..m.region.local_tokens(b * s).len() * h)
                .map(|i| (i % 7) as f32 * 0.1)
                .collect();
            let br = local.layout.block_range(0);
            let (y, cache) = local.blocks[0].forward(
                &p[br],
                Arc::new(model::layers::Buf::Host(x)),
                &Pass::new(b, s),
            )?;
            Ok((cache.residual_bytes(), y.len() * 4))
        });
        let (res, out) = rows.into_iter().next().expect("rank 0")?;
        println!("{:<6} {:>18} {:>14}", sp, res, out);
    }
    Ok(())
}
