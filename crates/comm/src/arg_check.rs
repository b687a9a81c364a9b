//! Argument checks every backend makes before an operation (the own engine and MPI alike), so
//! a mismatched buffer gets the same clear error whichever runs the group.
use crate::error::{CommError, Result};
use crate::shard_range;

/// `root` is a rank of the group `group` of `n` ranks.
pub(crate) fn root(op: &str, group: &str, n: usize, root: usize) -> Result<()> {
    if root >= n {
        return Err(CommError::invalid(
            op,
            format!("root {root} is outside group {group} of size {n}"),
        ));
    }
    Ok(())
}

/// Rank `r`'s reduce-scatter output holds its shard of the `input_len` elements.
pub(crate) fn reduce_scatter(
    n: usize,
    r: usize,
    input_len: usize,
    output_len: usize,
) -> Result<()> {
    let shard = shard_range(input_len, n, r).len();
    if output_len != shard {
        return Err(CommError::invalid(
            "reduce_scatter",
            format!(
                "output has {output_len} elements, shard {r} of {input_len} over {n} ranks has {shard}"
            ),
        ));
    }
    Ok(())
}

/// An all-gather output holds `n` blocks of `m`.
pub(crate) fn all_gather(n: usize, m: usize, output_len: usize) -> Result<()> {
    if output_len != n * m {
        return Err(CommError::invalid(
            "all_gather",
            format!("output has {output_len} elements, expected {n} ranks × {m}"),
        ));
    }
    Ok(())
}

/// The root's buffer of a gather (`what` = "output") or scatter ("input") holds `n` blocks of
/// `m`; returns it.
pub(crate) fn root_blocks<B: AsRef<[T]>, T>(
    op: &str,
    what: &str,
    n: usize,
    m: usize,
    buf: Option<B>,
) -> Result<B> {
    match buf {
        Some(b) if b.as_ref().len() == n * m => Ok(b),
        b => Err(CommError::invalid(
            op,
            format!(
                "root needs an {what} of {n} × {m} elements, got {:?}",
                b.map(|b| b.as_ref().len())
            ),
        )),
    }
}

/// An all-to-all input splits into `n` equal blocks and the output matches it.
pub(crate) fn all_to_all(n: usize, input_len: usize, output_len: usize) -> Result<()> {
    if !input_len.is_multiple_of(n) || output_len != input_len {
        return Err(CommError::invalid(
            "all_to_all",
            format!(
                "input ({input_len}) must split into {n} equal blocks and output must match it ({output_len})"
            ),
        ));
    }
    Ok(())
}

/// An all-to-all-v has one send count per rank, summing to the input's length.
pub(crate) fn all_to_all_v(n: usize, input_len: usize, send_counts: &[usize]) -> Result<()> {
    let total = send_counts.iter().sum::<usize>();
    if send_counts.len() != n || total != input_len {
        return Err(CommError::invalid(
            "all_to_all_v",
            format!(
                "{} send counts summing to {total} for {n} ranks and {input_len} elements",
                send_counts.len()
            ),
        ));
    }
    Ok(())
}

/// A caller's output of `held` elements receives the `total` a variable-length collective
/// delivers here (all-gather-v, all-to-all-v into a given buffer).
pub(crate) fn received_into(op: &str, held: usize, total: usize) -> Result<()> {
    if held != total {
        return Err(CommError::invalid(
            op,
            format!("output has {held} elements for the {total} received"),
        ));
    }
    Ok(())
}
