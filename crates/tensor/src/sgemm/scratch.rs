//! Per-thread packing buffers, reused across calls so a product allocates nothing once warm.
//! Each worker thread packs into its own buffers, which is what keeps its `A` block in its
//! own core's L2.

use std::cell::RefCell;

/// Cache-line alignment of the packed panels (aligned vector loads in the kernel).
const ALIGN_FLOATS: usize = 16;

/// A growable `f32` buffer whose handed-out slices start on a 64-byte boundary.
#[derive(Default)]
pub(super) struct Aligned(Vec<f32>);

impl Aligned {
    /// A 64-byte-aligned slice of `len` floats (contents unspecified).
    pub(super) fn get(&mut self, len: usize) -> &mut [f32] {
        if self.0.len() < len + ALIGN_FLOATS {
            self.0 = vec![0.0; len + ALIGN_FLOATS];
        }
        let off = self.0.as_ptr().align_offset(ALIGN_FLOATS * 4);
        &mut self.0[off..off + len]
    }
}

thread_local! {
    static BUFFERS: RefCell<(Aligned, Aligned)> = RefCell::default();
    static SHARED_A: RefCell<Aligned> = RefCell::default();
}

/// Runs `f` with this thread's (`A`, `B`) packing buffers.
pub(super) fn with_buffers<R>(f: impl FnOnce(&mut Aligned, &mut Aligned) -> R) -> R {
    BUFFERS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut bufs) => {
            let (a, b) = &mut *bufs;
            f(a, b)
        }
        // Re-entered on this thread (not expected): use fresh buffers rather than panic.
        Err(_) => f(&mut Aligned::default(), &mut Aligned::default()),
    })
}

/// Runs `f` with this thread's buffer for packed `A` panels that several threads read (the
/// dynamic schedule's, see `super::dynamic`); separate from [`with_buffers`] because the
/// thread that owns it may also work on the product.
pub(super) fn with_shared_a<R>(f: impl FnOnce(&mut Aligned) -> R) -> R {
    SHARED_A.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => f(&mut buf),
        Err(_) => f(&mut Aligned::default()),
    })
}
