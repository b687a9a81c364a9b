//! Cross-memory attach: reading (and writing) another process's memory with
//! `process_vm_readv(2)` / `process_vm_writev(2)`, the
//! kernel primitive behind the single-copy shared-memory path (see `crate::single_copy`).
//!
//! The kernel copies straight from the peer's pages into ours: one copy instead of the two of
//! a shared ring (sender → ring, ring → receiver). It cannot crash the reader: a peer that died
//! reads as `ESRCH`, memory the peer unmapped as `EFAULT`. It needs ptrace-style permission to
//! the peer (same user, and Yama's `ptrace_scope` ≤ 0 for processes that are not ancestors),
//! and container seccomp profiles may forbid the call (`ENOSYS` / `EPERM`): a probe at group
//! set-up decides, and the group falls back to the ring path when it fails.

/// Why a read from a peer failed.
#[derive(Debug)]
pub(crate) enum CmaError {
    /// The peer's process or the offered memory is gone (`ESRCH`, `EFAULT`): it exited or
    /// returned from the collective after an error.
    Gone,
    Io(std::io::Error),
}

/// What one rank offers its reader: `len` bytes at `addr` in process `pid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub pid: u32,
    pub addr: u64,
    pub len: u64,
}

impl Offer {
    /// Encoded size: 24 bytes, a whole number of elements of every supported type.
    pub const LEN: usize = 24;

    pub fn of(buf: &[u8]) -> Offer {
        Offer {
            pid: std::process::id(),
            addr: buf.as_ptr() as u64,
            len: buf.len() as u64,
        }
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&u64::from(self.pid).to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Offer {
        let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Offer {
            pid: u(0) as u32,
            addr: u(8),
            len: u(16),
        }
    }
}

/// Copies `dst.len()` bytes from `addr` in process `pid` into `dst`.
pub(crate) fn read(pid: u32, addr: u64, dst: &mut [u8]) -> Result<(), CmaError> {
    transfer(pid, addr, dst.as_mut_ptr(), dst.len(), false)
}

/// Copies `src` to `addr` in process `pid` (memory that process handed over for writing).
pub(crate) fn write(pid: u32, addr: u64, src: &[u8]) -> Result<(), CmaError> {
    transfer(pid, addr, src.as_ptr() as *mut u8, src.len(), true)
}

/// `process_vm_readv` (or `_writev` when `to_remote`) of `len` bytes between `local` and
/// `addr` in `pid`, looping over partial transfers (the kernel stops at an unmapped page).
fn transfer(
    pid: u32,
    addr: u64,
    local: *mut u8,
    len: usize,
    to_remote: bool,
) -> Result<(), CmaError> {
    let mut done = 0;
    while done < len {
        // SAFETY (pointer arithmetic): `done < len`, inside the caller's slice.
        let local_iov = libc::iovec {
            iov_base: unsafe { local.add(done) } as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `local_iov` describes the caller's slice (written only when reading, for
        // which the caller passed `&mut`); the kernel validates the remote range and reports
        // bad addresses as EFAULT instead of faulting.
        let got = unsafe {
            if to_remote {
                libc::process_vm_writev(pid as libc::pid_t, &local_iov, 1, &remote_iov, 1, 0)
            } else {
                libc::process_vm_readv(pid as libc::pid_t, &local_iov, 1, &remote_iov, 1, 0)
            }
        };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) | Some(libc::EFAULT) => CmaError::Gone,
                _ => CmaError::Io(e),
            });
        }
        if got == 0 {
            return Err(CmaError::Gone);
        }
        done += got as usize;
    }
    Ok(())
}

/// The word every rank offers to the set-up probe (its value is checked by the reader).
pub(crate) static PROBE_WORD: u64 = 0x5854_434d_415f_4f4b; // "XTCMA_OK"

/// Reads the probe word at `addr` in process `pid` and checks its value: `Ok` when this
/// process may use cross-memory attach on that peer, the reason otherwise.
pub(crate) fn probe(pid: u32, addr: u64) -> Result<(), String> {
    let mut b = [0u8; 8];
    match read(pid, addr, &mut b) {
        Ok(()) if u64::from_ne_bytes(b) == PROBE_WORD => Ok(()),
        Ok(()) => Err(format!("probe of pid {pid} read an unexpected value")),
        Err(CmaError::Gone) => Err(format!("process {pid} or its probe word is gone")),
        Err(CmaError::Io(e)) => Err(format!("process_vm_readv on pid {pid}: {e}")),
    }
}

/// Whether this process may read its own memory through `process_vm_readv` (false where a
/// seccomp filter forbids the call): a precondition of the single-copy path.
pub fn available_here() -> bool {
    probe(std::process::id(), &PROBE_WORD as *const u64 as u64).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_and_reports_bad_addresses() {
        if !available_here() {
            return; // forbidden by the sandbox: nothing to test
        }
        let src: Vec<u32> = (0..100_000).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&src);
        let mut dst = vec![0u8; bytes.len()];
        let o = Offer::of(bytes);
        assert_eq!(Offer::decode(&o.encode()), o);
        read(o.pid, o.addr, &mut dst).unwrap();
        assert_eq!(dst, bytes);
        let back: Vec<u8> = dst.iter().map(|b| b ^ 0x5a).collect();
        write(o.pid, dst.as_mut_ptr() as u64, &back).unwrap();
        assert_eq!(dst, back);
        // Page 0 is never mapped: EFAULT, reported as the peer's memory being gone.
        assert!(matches!(read(o.pid, 8, &mut dst[..8]), Err(CmaError::Gone)));
        // A pid that cannot exist.
        assert!(probe(u32::MAX / 2, 8).is_err());
    }
}
