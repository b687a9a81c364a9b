//! A whole pipeline schedule as data: where each stage runs, which micro-batches flow through
//! which chain of stages, and every rank's list of actions — with its text form (one rank per
//! line, torch.distributed.pipelining's action strings) and CSV files a user can hand in.
//!
//! Stages form chains: a chain is a run of consecutive stage ids through which its
//! micro-batches flow forward (`s → s + 1`) and their gradients backward. Every schedule but
//! DualPipe has one chain over all stages; DualPipe has two (the pipeline and its mirror), whose
//! stages hold the same layers ([`Schedule::stage_split`]).
use std::fmt;
use std::ops::Range;

use super::action::Action;
use crate::ParallelError;

/// A run of stages and the micro-batches that flow through it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub stages: Range<usize>,
    pub microbatches: Range<usize>,
}

/// Every rank's actions and where each stage runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The generator's name (`1f1b`, …) or `csv`.
    pub kind: String,
    /// The pp rank that runs each stage.
    pub stage_rank: Vec<usize>,
    pub chains: Vec<Chain>,
    /// Each pp rank's actions, in order.
    pub actions: Vec<Vec<Action>>,
}

fn bad<T>(msg: impl Into<String>) -> Result<T, ParallelError> {
    Err(ParallelError::Schedule(msg.into()))
}

impl Schedule {
    pub fn num_ranks(&self) -> usize {
        self.actions.len()
    }

    pub fn num_stages(&self) -> usize {
        self.stage_rank.len()
    }

    /// Micro-batches of a step (over every chain).
    pub fn num_microbatches(&self) -> usize {
        self.chains.iter().map(|c| c.microbatches.len()).sum()
    }

    /// The chain stage `s` belongs to.
    pub fn chain(&self, s: usize) -> Option<&Chain> {
        self.chains.iter().find(|c| c.stages.contains(&s))
    }

    /// The stage before `s` in its chain (`None` at a chain's start).
    pub fn prev_stage(&self, s: usize) -> Option<usize> {
        let c = self.chain(s)?;
        (s > c.stages.start).then(|| s - 1)
    }

    /// The stage after `s` in its chain (`None` at a chain's end, where the loss is).
    pub fn next_stage(&self, s: usize) -> Option<usize> {
        let c = self.chain(s)?;
        (s + 1 < c.stages.end).then_some(s + 1)
    }

    /// Which of the model's `stage_splits()` layer ranges stage `s` holds: its position in its
    /// chain (a mirror chain's stages hold the same layers as the first chain's).
    pub fn stage_split(&self, s: usize) -> usize {
        self.chain(s).map_or(s, |c| s - c.stages.start)
    }

    /// How many layer ranges the model is cut into: the length of a chain.
    pub fn stage_splits(&self) -> usize {
        self.chains.first().map_or(0, |c| c.stages.len())
    }

    /// The stages rank `r` runs, in increasing order.
    pub fn rank_stages(&self, r: usize) -> Vec<usize> {
        (0..self.num_stages())
            .filter(|&s| self.stage_rank[s] == r)
            .collect()
    }

    /// The layer ranges ([`Self::stage_split`]) rank `r` holds, in increasing order.
    pub fn rank_splits(&self, r: usize) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .rank_stages(r)
            .iter()
            .map(|&s| self.stage_split(s))
            .collect();
        v.sort_unstable();
        v
    }

    /// The stages rank `r` runs in the order of the layers they hold (then by id): the order
    /// of the rank's parameters. Ranks holding the same layers (DualPipe's mirror pairs)
    /// then lay their parameters out identically.
    pub fn local_stages(&self, r: usize) -> Vec<usize> {
        let mut v = self.rank_stages(r);
        v.sort_by_key(|&s| (self.stage_split(s), s));
        v
    }

    /// The pp ranks holding the same layers as rank `r` (itself included, increasing): its
    /// replicas, whose gradients are summed like data-parallel ones. `[r]` but in DualPipe,
    /// where rank r and p − 1 − r hold both copies of layers r and p − 1 − r.
    pub fn replicas(&self, r: usize) -> Vec<usize> {
        let mine = self.rank_splits(r);
        (0..self.num_ranks())
            .filter(|&q| self.rank_splits(q) == mine)
            .collect()
    }

    /// The most micro-batches stage `s` has in flight on its rank at once: its forward run,
    /// its weight gradients (a fused backward, or the weight half of a split one) not yet.
    pub fn max_in_flight(&self, s: usize) -> usize {
        let Some(&r) = self.stage_rank.get(s) else {
            return 0;
        };
        let (mut now, mut most) = (0usize, 0usize);
        for a in self.actions[r].iter().filter(|a| a.is_compute()) {
            for part in a.parts() {
                match part {
                    Action::Forward { stage, .. } if stage == s => {
                        now += 1;
                        most = most.max(now);
                    }
                    Action::Backward { stage, .. } | Action::BackwardWeight { stage, .. }
                        if stage == s =>
                    {
                        now = now.saturating_sub(1)
                    }
                    _ => {}
                }
            }
        }
        most
    }

    /// Whether some layers are held by more than one rank (see [`Self::replicas`]).
    pub fn has_replicas(&self) -> bool {
        (0..self.num_ranks()).any(|r| self.replicas(r).len() > 1)
    }

    /// Checks the shape: chains tile the stages and partition the micro-batches, every stage
    /// runs on a rank of the schedule, and every rank's actions name stages it runs.
    pub fn check_shape(&self) -> Result<(), ParallelError> {
        let n = self.num_stages();
        if n == 0 || self.actions.is_empty() {
            return bad("a schedule needs at least one stage and one rank");
        }
        let mut next_stage = 0;
        let mut next_mb = 0;
        for c in &self.chains {
            if c.stages.start != next_stage || c.stages.is_empty() {
                return bad(format!(
                    "chain of stages {:?}: chains must tile stages 0..{n} in order",
                    c.stages
                ));
            }
            if c.microbatches.start != next_mb || c.microbatches.is_empty() {
                return bad(format!(
                    "chain of micro-batches {:?}: chains must partition the micro-batches in order",
                    c.microbatches
                ));
            }
            next_stage = c.stages.end;
            next_mb = c.microbatches.end;
        }
        if next_stage != n {
            return bad(format!("the chains cover stages 0..{next_stage} of {n}"));
        }
        if self
            .chains
            .iter()
            .any(|c| c.stages.len() != self.stage_splits())
        {
            return bad("every chain must have the same number of stages");
        }
        if let Some(s) = (0..n).find(|&s| self.stage_rank[s] >= self.num_ranks()) {
            return bad(format!(
                "stage {s} runs on rank {} of a {}-rank schedule",
                self.stage_rank[s],
                self.num_ranks()
            ));
        }
        for (r, list) in self.actions.iter().enumerate() {
            for a in list {
                for part in a.parts() {
                    if let Some(s) = part.stage() {
                        if s >= n || self.stage_rank[s] != r {
                            return bad(format!(
                                "rank {r}'s action {a} names stage {s}, which {}",
                                if s >= n {
                                    format!("does not exist ({n} stages)")
                                } else {
                                    format!("runs on rank {}", self.stage_rank[s])
                                }
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The schedule as text: a header line (`# kind=… stages=… ranks=… chains=…`), then each
    /// rank's actions on one line, comma-separated (the CSV form).
    pub fn to_csv(&self) -> String {
        let chains: Vec<String> = self
            .chains
            .iter()
            .map(|c| {
                format!(
                    "{}-{}:{}-{}",
                    c.stages.start, c.stages.end, c.microbatches.start, c.microbatches.end
                )
            })
            .collect();
        let placement: Vec<String> = self.stage_rank.iter().map(|r| r.to_string()).collect();
        let mut out = format!(
            "# kind={} stage_rank={} chains={}\n",
            self.kind,
            placement.join(" "),
            chains.join(" ")
        );
        for list in &self.actions {
            let line: Vec<String> = list.iter().map(|a| a.to_string()).collect();
            out.push_str(&line.join(","));
            out.push('\n');
        }
        out
    }

    /// Reads [`Self::to_csv`]'s form. Without a header, each stage runs on the rank whose line
    /// names it and one chain takes every stage and micro-batch.
    pub fn from_csv(text: &str) -> Result<Self, ParallelError> {
        let mut kind = "csv".to_string();
        let mut stage_rank: Option<Vec<usize>> = None;
        let mut chains: Option<Vec<Chain>> = None;
        let mut actions = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if let Some(h) = line.strip_prefix('#') {
                if let Some(v) = header_value(h, "kind") {
                    kind = v.to_string();
                }
                if let Some(v) = header_value(h, "stage_rank") {
                    stage_rank = Some(
                        v.split_whitespace()
                            .map(|x| x.parse().map_err(|_| format!("stage_rank entry `{x}`")))
                            .collect::<Result<_, _>>()
                            .map_err(ParallelError::Schedule)?,
                    );
                }
                if let Some(v) = header_value(h, "chains") {
                    chains = Some(
                        v.split_whitespace()
                            .map(parse_chain)
                            .collect::<Result<_, _>>()?,
                    );
                }
                continue;
            }
            let list = if line.is_empty() {
                Vec::new()
            } else {
                line.split(',')
                    .map(|a| {
                        a.parse::<Action>()
                            .map_err(|e| ParallelError::Schedule(format!("line {}: {e}", n + 1)))
                    })
                    .collect::<Result<Vec<_>, _>>()?
            };
            actions.push(list);
        }
        let stage_rank = match stage_rank {
            Some(s) => s,
            None => infer_placement(&actions)?,
        };
        let chains = chains.unwrap_or_else(|| {
            let mbs = actions
                .iter()
                .flatten()
                .flat_map(|a| a.parts())
                .filter_map(|a| a.microbatch())
                .max()
                .map_or(0, |m| m + 1);
            vec![Chain {
                stages: 0..stage_rank.len(),
                microbatches: 0..mbs,
            }]
        });
        let s = Schedule {
            kind,
            stage_rank,
            chains,
            actions,
        };
        s.check_shape()?;
        Ok(s)
    }
}

/// The text after `key=` up to the next `key=` of a header line (values hold spaces).
fn header_value<'a>(h: &'a str, key: &str) -> Option<&'a str> {
    let start = h.find(&format!("{key}="))? + key.len() + 1;
    let rest = &h[start..];
    let end = ["kind=", "stage_rank=", "chains="]
        .iter()
        .filter_map(|k| rest.find(k))
        .min()
        .unwrap_or(rest.len());
    Some(rest[..end].trim())
}

fn parse_chain(text: &str) -> Result<Chain, ParallelError> {
    let range = |t: &str| -> Option<Range<usize>> {
        let (a, b) = t.split_once('-')?;
        Some(a.parse().ok()?..b.parse().ok()?)
    };
    let (s, m) = text
        .split_once(':')
        .ok_or_else(|| ParallelError::Schedule(format!("chain `{text}` (form: 0-4:0-8)")))?;
    match (range(s), range(m)) {
        (Some(stages), Some(microbatches)) => Ok(Chain {
            stages,
            microbatches,
        }),
        _ => bad(format!("chain `{text}` (form: 0-4:0-8)")),
    }
}

/// Each stage on the rank whose actions name it (exactly one).
fn infer_placement(actions: &[Vec<Action>]) -> Result<Vec<usize>, ParallelError> {
    let mut stage_rank: Vec<Option<usize>> = Vec::new();
    for (r, list) in actions.iter().enumerate() {
        for a in list.iter().flat_map(|a| a.parts()) {
            let Some(s) = a.stage() else { continue };
            if s >= stage_rank.len() {
                stage_rank.resize(s + 1, None);
            }
            match stage_rank[s] {
                None => stage_rank[s] = Some(r),
                Some(o) if o != r => {
                    return bad(format!(
                        "stage {s} appears on ranks {o} and {r}: a stage runs on one rank"
                    ))
                }
                _ => {}
            }
        }
    }
    stage_rank
        .into_iter()
        .enumerate()
        .map(|(s, r)| r.ok_or_else(|| ParallelError::Schedule(format!("stage {s} has no actions"))))
        .collect()
}

impl fmt::Display for Schedule {
    /// One line per rank: `rank 0: 0F0 0F1 0B0 …`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (r, list) in self.actions.iter().enumerate() {
            let line: Vec<String> = list.iter().map(|a| a.to_string()).collect();
            writeln!(f, "rank {r}: {}", line.join(" "))?;
        }
        Ok(())
    }
}
