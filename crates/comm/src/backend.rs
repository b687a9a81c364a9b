//! [`Backend`]: what executes a group's operations — xtrain's own [`Engine`] (shared memory and
//! TCP links) or an external library (the system MPI library, [`crate::external`]).
//! [`ProcessGroup`] holds one and calls the same methods on either, so the trainer and every
//! parallelism run unchanged on both.
//!
//! [`ProcessGroup`]: crate::ProcessGroup
use crate::collectives::AllReduceAlgo;
use crate::element::{Element, ReduceOp};
use crate::engine::Engine;
use crate::error::Result;

// One per group, behind the group's mutex: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Backend {
    Own(Engine),
    External(Box<dyn crate::external::ExternalGroup>),
}

/// Defines each operation on [`Backend`] as a call of the same method on the active backend.
macro_rules! dispatch {
    ($(fn $name:ident<$t:ident>(&mut self $(, $arg:ident: $ty:ty)*) -> $ret:ty;)*) => {
        impl Backend {
            $(pub fn $name<$t: Element>(&mut self $(, $arg: $ty)*) -> $ret {
                match self {
                    Backend::Own(e) => e.$name($($arg),*),
                    Backend::External(g) => crate::external::$name(g.as_mut() $(, $arg)*),
                }
            })*
        }
    };
}

dispatch! {
    fn p2p<T>(&mut self, sends: &[(usize, &[T])], recvs: &mut [(usize, &mut [T])], tag: u32) -> Result<()>;
    fn all_reduce<T>(&mut self, buf: &mut [T], op: ReduceOp, algo: AllReduceAlgo) -> Result<()>;
    fn reduce<T>(&mut self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()>;
    fn broadcast<T>(&mut self, buf: &mut [T], root: usize) -> Result<()>;
    fn reduce_scatter<T>(&mut self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()>;
    fn all_gather<T>(&mut self, input: &[T], output: &mut [T]) -> Result<()>;
    fn all_gather_v<T>(&mut self, input: &[T]) -> Result<(Vec<T>, Vec<usize>)>;
    fn all_gather_v_into<T>(&mut self, input: &[T], output: &mut [T]) -> Result<Vec<usize>>;
    fn gather<T>(&mut self, input: &[T], output: Option<&mut [T]>, root: usize) -> Result<()>;
    fn scatter<T>(&mut self, input: Option<&[T]>, output: &mut [T], root: usize) -> Result<()>;
    fn all_to_all<T>(&mut self, input: &[T], output: &mut [T]) -> Result<()>;
    fn all_to_all_v<T>(&mut self, input: &[T], send_counts: &[usize]) -> Result<(Vec<T>, Vec<usize>)>;
    fn all_to_all_v_into<T>(&mut self, input: &[T], send_counts: &[usize], output: &mut [T]) -> Result<Vec<usize>>;
}

impl Backend {
    pub fn barrier(&mut self) -> Result<()> {
        match self {
            Backend::Own(e) => e.barrier(),
            Backend::External(g) => g.barrier(),
        }
    }

    /// Records the end of the operation begun last in the rank's flight recorder (the own
    /// engine records its operations; an external library's are not recorded).
    pub fn end_op(&mut self, ok: bool) {
        match self {
            Backend::Own(e) => e.end_op(ok),
            Backend::External(_) => {}
        }
    }

    /// Refuses further operations (the own engine also closes its links, so peers waiting on
    /// this rank fail at once).
    pub fn abort(&mut self, reason: String) {
        match self {
            Backend::Own(e) => e.abort(reason),
            Backend::External(g) => g.abort(reason),
        }
    }
}
