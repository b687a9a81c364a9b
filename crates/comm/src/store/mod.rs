//! Rendezvous key-value store: the contract every store implements, and an
//! in-process implementation used when ranks are threads of one process.
//!
//! A TCP implementation hosted by rank 0 at `MASTER_ADDR:MASTER_PORT` lives beside
//! this one ([`tcp`]: the client and the protocol; `server`: the server; `codec`: the wire
//! format) and implements the same trait, so transports bootstrap the same way whether ranks
//! are threads or processes. Only clients that prove the job token reach its keys.
pub(crate) mod codec;
mod server;
pub mod tcp;

pub use server::{StoreLimits, TcpStoreServer, MAX_FRAME};
pub use tcp::TcpStore;

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Errors from a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: timed out after {timeout:?} waiting for key(s) {keys:?}")]
    Timeout {
        keys: Vec<String>,
        timeout: Duration,
    },
    #[error("store: {0}")]
    Io(String),
    #[error("store: malformed message: {0}")]
    Protocol(String),
    /// A well-formed request the store refused (e.g. `add` on a key holding text).
    #[error("store: request rejected: {0}")]
    Rejected(String),
}

/// The operations of the rendezvous store (the same as torch.distributed's TCPStore).
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, waking anyone waiting for it.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Waits up to `timeout` for `key` to exist and returns its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError>;
    /// Waits up to `timeout` for all `keys` to exist.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;
    /// Adds `delta` to the integer stored at `key` (0 if absent) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
    /// Sets `key` to `new` if its current value is `expected` (`None`: absent).
    /// Returns the value after the operation.
    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<Vec<u8>, StoreError>;
    /// Deletes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool, StoreError>;
}

/// A store shared by threads of one process (ranks as threads in tests).
#[derive(Default)]
pub struct MemStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.map
            .lock()
            .unwrap()
            .insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], timeout)?;
        Ok(self.map.lock().unwrap()[key].clone())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        // A timeout too large for a deadline (e.g. Duration::MAX from a client) waits forever.
        let deadline = Instant::now().checked_add(timeout);
        let mut map = self.map.lock().unwrap();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(**k))
                .map(|k| k.to_string())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            map = match deadline {
                None => self.changed.wait(map).unwrap(),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(StoreError::Timeout {
                            keys: missing,
                            timeout,
                        });
                    }
                    self.changed.wait_timeout(map, deadline - now).unwrap().0
                }
            };
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let mut map = self.map.lock().unwrap();
        let current = match map.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        };
        let next = current + delta;
        map.insert(key.to_string(), next.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(next)
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let mut map = self.map.lock().unwrap();
        let matches = map.get(key).map(|v| v.as_slice()) == expected;
        if matches {
            map.insert(key.to_string(), new.to_vec());
            drop(map);
            self.changed.notify_all();
            return Ok(new.to_vec());
        }
        Ok(map.get(key).cloned().unwrap_or_default())
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.map.lock().unwrap().remove(key).is_some())
    }
}

/// Counters are stored as decimal text, as torch's TCPStore does, so `get` on them is readable.
pub fn parse_counter(key: &str, value: &[u8]) -> Result<i64, StoreError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            StoreError::Rejected(format!("key {key:?} does not hold an integer counter"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn get_waits_for_a_later_set() {
        let store = Arc::new(MemStore::new());
        let writer = Arc::clone(&store);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            writer.set("addr/1", b"hello").unwrap();
        });
        assert_eq!(
            store.get("addr/1", Duration::from_secs(5)).unwrap(),
            b"hello"
        );
        t.join().unwrap();
    }

    #[test]
    fn wait_times_out_naming_the_missing_key() {
        let store = MemStore::new();
        store.set("a", b"1").unwrap();
        let err = store
            .wait(&["a", "b"], Duration::from_millis(10))
            .unwrap_err();
        assert!(err.to_string().contains("\"b\""), "{err}");
    }

    #[test]
    fn huge_timeouts_do_not_overflow() {
        let store = MemStore::new();
        store.set("k", b"v").unwrap();
        assert_eq!(store.get("k", Duration::MAX).unwrap(), b"v");
    }

    #[test]
    fn add_and_compare_set() {
        let store = MemStore::new();
        assert_eq!(store.add("n", 2).unwrap(), 2);
        assert_eq!(store.add("n", -5).unwrap(), -3);
        assert_eq!(store.compare_set("k", None, b"x").unwrap(), b"x");
        assert_eq!(store.compare_set("k", Some(b"y"), b"z").unwrap(), b"x");
        assert!(store.delete("k").unwrap());
        assert!(!store.delete("k").unwrap());
    }
}
