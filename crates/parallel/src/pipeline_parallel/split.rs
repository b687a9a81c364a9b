//! Which layers each pipeline stage holds: `L` layers over `S` stages as evenly as possible
//! (stage `s` takes layers `⌊s·L/S⌋ .. ⌊(s+1)·L/S⌋`), the embedding on the first stage and the
//! final norm + LM head on the last. Which rank runs which stage is the schedule's choice
//! ([`super::Schedule::stage_rank`]).
use std::ops::Range;

use crate::ParallelError;

/// One part of the decoder: the units a stage holds are a run of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Embedding,
    Block(usize),
    Head,
}

/// The layers of each of `stages` stages.
pub fn stage_layers(layers: usize, stages: usize) -> Result<Vec<Range<usize>>, ParallelError> {
    if stages == 0 || stages > layers {
        return Err(ParallelError::Config(format!(
            "{stages} pipeline stages for {layers} layers: every stage needs at least one layer"
        )));
    }
    Ok((0..stages)
        .map(|s| s * layers / stages..(s + 1) * layers / stages)
        .collect())
}

/// The parts of stage `stage` of `stages` for a model of `layers` layers, in forward order.
pub fn stage_parts(layers: usize, stages: usize, stage: usize) -> Result<Vec<Part>, ParallelError> {
    let ranges = stage_layers(layers, stages)?;
    let r = ranges.get(stage).cloned().ok_or_else(|| {
        ParallelError::Config(format!("stage {stage} of a {stages}-stage pipeline"))
    })?;
    let mut parts = Vec::new();
    if stage == 0 {
        parts.push(Part::Embedding);
    }
    parts.extend(r.map(Part::Block));
    if stage + 1 == stages {
        parts.push(Part::Head);
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_split_evenly_and_cover_the_model() {
        assert_eq!(stage_layers(8, 4).unwrap(), [0..2, 2..4, 4..6, 6..8]);
        assert_eq!(stage_layers(5, 2).unwrap(), [0..2, 2..5]);
        assert!(stage_layers(2, 3).is_err());
        assert_eq!(
            stage_parts(4, 2, 0).unwrap(),
            [Part::Embedding, Part::Block(0), Part::Block(1)]
        );
        assert_eq!(
            stage_parts(4, 2, 1).unwrap(),
            [Part::Block(2), Part::Block(3), Part::Head]
        );
        assert_eq!(
            stage_parts(2, 1, 0).unwrap(),
            [Part::Embedding, Part::Block(0), Part::Block(1), Part::Head]
        );
    }
}
