//! The job token and the proof of it that every connection makes before anything else
//! (store clients, rank-to-rank TCP links).
//!
//! The token is a secret shared by the ranks of one job (`xtrain launch` creates a random one
//! per launch and passes it in [`TOKEN_VAR`]). It never crosses the wire: each side of a
//! connection sends a fresh random nonce and proves the token with HMAC-SHA256 over a
//! transcript holding both nonces (challenge-response), so a recorded proof is worthless for
//! another connection. Each role has its own label, so a proof cannot be reflected back as the
//! other side's, and both sides prove: a client also knows it reached its own job's store.
//! Proofs are compared in constant time.
//!
//! A job without a token uses the empty key: the handshake still runs, but proves nothing;
//! [`crate::env`] allows that only where the store is reachable from this host alone.
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The secret shared by the ranks of one job (set by `xtrain launch`; set it on every rank
/// by hand when starting ranks another way).
pub const TOKEN_VAR: &str = "XTRAIN_JOB_TOKEN";
/// `1` lets a job whose store other hosts can reach run without a token (anyone who can
/// reach the store then joins it).
pub const ALLOW_NO_TOKEN_VAR: &str = "XTRAIN_ALLOW_NO_TOKEN";
/// Bytes of a nonce and of a proof.
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
/// Shortest token accepted (a hex string of 8 random bytes; generated ones have 64 digits).
pub const MIN_TOKEN_LEN: usize = 16;

/// Which side of a handshake a proof speaks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    StoreClient,
    StoreServer,
    LinkConnector,
    LinkAcceptor,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::StoreClient => b"xtrain store client v1",
            Role::StoreServer => b"xtrain store server v1",
            Role::LinkConnector => b"xtrain link connector v1",
            Role::LinkAcceptor => b"xtrain link acceptor v1",
        }
    }
}

/// A job's secret. `Debug` never shows it and it has no `Display`, so it is never logged.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct JobToken(Option<Arc<[u8]>>);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Some(_) => "JobToken(<secret>)",
            None => "JobToken(none)",
        })
    }
}

impl JobToken {
    /// No token: handshakes run with the empty key and prove nothing.
    pub fn none() -> Self {
        JobToken(None)
    }

    /// A token from its text form (surrounding whitespace ignored).
    pub fn new(secret: &str) -> Result<Self, String> {
        let s = secret.trim();
        if s.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "{TOKEN_VAR} is too short to be a secret ({} characters; use at least \
                 {MIN_TOKEN_LEN}, e.g. 32 random bytes in hex)",
                s.len()
            ));
        }
        Ok(JobToken(Some(s.as_bytes().into())))
    }

    /// A fresh random secret in text form (64 hex digits), for a launcher to hand its workers.
    pub fn generate_secret() -> Result<String, String> {
        let bytes = nonce()?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The token in [`TOKEN_VAR`] of the process environment, [`JobToken::none`] when unset.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(TOKEN_VAR) {
            Ok(v) if !v.trim().is_empty() => Self::new(&v),
            _ => Ok(Self::none()),
        }
    }

    /// Whether this is [`JobToken::none`].
    pub fn is_none(&self) -> bool {
        self.0.is_none()
    }

    fn mac(&self, role: Role, transcript: &[&[u8]]) -> Hmac<Sha256> {
        let key: &[u8] = self.0.as_deref().unwrap_or(&[]);
        let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
        mac.update(role.label());
        for part in transcript {
            // Length-prefixed, so different splits of the same bytes differ.
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// `role`'s proof of the token over `transcript` (both nonces and what they bind).
    pub(crate) fn prove(&self, role: Role, transcript: &[&[u8]]) -> [u8; PROOF_LEN] {
        self.mac(role, transcript).finalize().into_bytes().into()
    }

    /// Whether `proof` is `role`'s proof over `transcript` (constant-time comparison).
    pub(crate) fn verify(&self, role: Role, transcript: &[&[u8]], proof: &[u8]) -> bool {
        self.mac(role, transcript).verify_slice(proof).is_ok()
    }
}

/// Fresh random bytes from the operating system.
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN], String> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| format!("no randomness from the OS: {e}"))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_token_the_role_and_the_transcript() {
        let t = JobToken::new("0123456789abcdef0123").unwrap();
        let (a, b) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(a, b);
        let p = t.prove(Role::StoreClient, &[&a, &b]);
        assert!(t.verify(Role::StoreClient, &[&a, &b], &p));
        // Another role, another transcript, another token, a cut proof: all refused.
        assert!(!t.verify(Role::StoreServer, &[&a, &b], &p));
        assert!(!t.verify(Role::StoreClient, &[&b, &a], &p));
        let other = JobToken::new("0123456789abcdef0124").unwrap();
        assert!(!other.verify(Role::StoreClient, &[&a, &b], &p));
        assert!(!JobToken::none().verify(Role::StoreClient, &[&a, &b], &p));
        assert!(!t.verify(Role::StoreClient, &[&a, &b], &p[..16]));
        // Length prefixes: the same bytes split differently are a different transcript.
        let joined = [a.as_slice(), b.as_slice()].concat();
        assert!(!t.verify(Role::StoreClient, &[&joined], &p));
    }

    #[test]
    fn tokens_are_checked_generated_and_never_shown() {
        assert!(JobToken::new("short").unwrap_err().contains("too short"));
        let s = JobToken::generate_secret().unwrap();
        assert_eq!(s.len(), 64);
        assert_ne!(s, JobToken::generate_secret().unwrap());
        let t = JobToken::new(&format!("  {s}\n")).unwrap();
        assert_eq!(t, JobToken::new(&s).unwrap());
        let shown = format!("{t:?}");
        assert!(!shown.contains(&s[..8]), "{shown}");
        assert_eq!(format!("{:?}", JobToken::none()), "JobToken(none)");
    }
}
