//! Reading from a socket with an overall deadline, for handshakes with peers not yet trusted.
use std::net::TcpStream;
use std::time::Instant;

/// Reads from a stream, failing with `TimedOut` once `deadline` (if any) has passed, however
/// the bytes trickle in (a per-read timeout alone lets a client that sends a byte now and
/// then hold its handshake open indefinitely).
pub(crate) struct Deadlined<'a> {
    pub stream: &'a TcpStream,
    /// None: no deadline (plain reads).
    pub deadline: Option<Instant>,
}

impl std::io::Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(d) = self.deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        (&*self.stream).read(buf)
    }
}
