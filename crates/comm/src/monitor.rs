//! Each rank's monitor: its [flight recorder](crate::flight), a heartbeat, and the gathering
//! of every rank's state for a [diagnosis](crate::diagnosis).
//!
//! The heartbeat is a background thread per rank (per [`Communicator`](crate::Communicator))
//! that, every `interval` (`XTRAIN_HEARTBEAT_INTERVAL`), bumps the rank's counter in the store
//! and reads the other ranks' counters, noting when each last advanced; every quarter
//! interval it publishes its flight record there if it changed. A process that is stopped (SIGSTOP, a debugger, a frozen VM) stops its
//! heartbeat thread too, while a rank that is merely slow — computing, or waiting in a long
//! collective — keeps beating. So a rank waiting on a peer whose heartbeat has not advanced
//! for `misses` intervals knows that peer is stopped or gone, and fails long before the
//! collective timeout (`XTRAIN_COMM_TIMEOUT`) with a diagnosis.
//!
//! Store keys (namespaced by the job id): `xtrain/<job>/monitor/beat/<rank>` (the counter)
//! and `xtrain/<job>/monitor/flight/<rank>` ([`FlightRecord::encode`] text).
//!
//! Every heartbeat reads the counters of all ranks, a world-size number of small store
//! requests per interval and rank. The store is hosted by rank 0's process: when this rank's
//! own beats stop reaching it (rank 0 stopped, network down), no peer is called stopped and
//! diagnoses do not read it; the collective timeout remains the bound.
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::diagnosis::PeerState;
use crate::flight::{FlightRecord, FlightRecorder};
use crate::store::Store;

/// Default of [`Options::heartbeat_interval`](crate::Options::heartbeat_interval).
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);
/// Heartbeats a peer may miss before it counts as stopped.
pub const HEARTBEAT_MISSES: u32 = 3;

/// One rank's monitor (shared by its groups' engines and its heartbeat thread).
pub struct Monitor {
    store: Arc<dyn Store>,
    ns: String,
    /// World rank and size.
    rank: usize,
    world: usize,
    pub(crate) recorder: FlightRecorder,
    /// Zero: no heartbeat.
    interval: Duration,
    /// Per world rank: the last counter read and when it last changed.
    seen: Mutex<Vec<(Vec<u8>, Instant)>>,
    /// When this rank's own beat last reached the store.
    beat_ok: Mutex<Instant>,
    stop: Mutex<bool>,
    wake: Condvar,
}

impl Monitor {
    /// A monitor for world rank `rank` of `world`, its keys under `xtrain/<job_id>/monitor`.
    pub(crate) fn new(
        store: Arc<dyn Store>,
        job_id: &str,
        rank: usize,
        world: usize,
        interval: Duration,
    ) -> Arc<Self> {
        let now = Instant::now();
        Arc::new(Monitor {
            store,
            ns: format!("xtrain/{job_id}/monitor"),
            rank,
            world,
            recorder: FlightRecorder::default(),
            interval,
            seen: Mutex::new(vec![(Vec::new(), now); world]),
            beat_ok: Mutex::new(now),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        })
    }

    /// Starts the heartbeat thread (when the interval is not zero and there are peers).
    pub(crate) fn start(self: &Arc<Self>) {
        if self.interval.is_zero() || self.world < 2 {
            return;
        }
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("heartbeat-{}", self.rank))
            .spawn(move || me.run());
        if let Err(e) = spawned {
            tracing::warn!(
                "no heartbeat thread ({e}): stopped ranks are found by the timeout only"
            );
        }
    }

    /// Ends the heartbeat thread (at its next wake-up; it holds no lock meanwhile).
    pub(crate) fn shutdown(&self) {
        *self.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.wake.notify_all();
    }

    /// The heartbeat thread: a beat every interval; in between, every quarter interval, the
    /// flight record is published again if operations were recorded since (so a rank that
    /// stops leaves a record at most a quarter interval old).
    fn run(&self) {
        let (mut tick, mut published) = (0u64, u64::MAX);
        loop {
            if tick.is_multiple_of(4) {
                let beat = tick / 4 + 1;
                let sent = self
                    .store
                    .set(&self.key("beat", self.rank), beat.to_string().as_bytes());
                if sent.is_ok() {
                    *self.beat_ok.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
                }
                self.read_beats();
            }
            let ops = self.recorder.ops_recorded();
            if ops != published {
                self.publish();
                published = ops;
            }
            tick += 1;
            let stop = self.stop.lock().unwrap_or_else(|e| e.into_inner());
            let (stop, _) = self
                .wake
                .wait_timeout_while(stop, self.interval / 4, |s| !*s)
                .unwrap_or_else(|e| e.into_inner());
            if *stop {
                return;
            }
        }
    }

    fn key(&self, what: &str, rank: usize) -> String {
        format!("{}/{what}/{rank}", self.ns)
    }

    fn read_beats(&self) {
        for r in (0..self.world).filter(|&r| r != self.rank) {
            let Ok(v) = self.store.get(&self.key("beat", r), Duration::ZERO) else {
                continue;
            };
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if seen[r].0 != v {
                seen[r] = (v, Instant::now());
            }
        }
    }

    /// Publishes this rank's flight record as it stands.
    pub(crate) fn publish(&self) {
        let text = self.recorder.snapshot(self.rank).encode();
        let _ = self
            .store
            .set(&self.key("flight", self.rank), text.as_bytes());
    }

    /// How long a heartbeat may stay still before its rank counts as stopped.
    pub(crate) fn limit(&self) -> Option<Duration> {
        (!self.interval.is_zero() && self.world > 1).then(|| self.interval * HEARTBEAT_MISSES)
    }

    /// How long world rank `r`'s heartbeat has not advanced (`None`: heartbeats are off).
    pub(crate) fn silent_for(&self, r: usize) -> Option<Duration> {
        self.limit()?;
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.get(r).map(|s| s.1.elapsed())
    }

    /// Whether this rank's own heartbeats reach the store (within the limit). When they do
    /// not, the store (hosted by rank 0's process) is unreachable or stalled: every peer would
    /// look silent, so none is called stopped, and nothing waits on the store here.
    fn store_answers(&self) -> bool {
        let limit = self.limit().unwrap_or(Duration::MAX);
        self.beat_ok
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
            <= limit
    }

    /// Whether world rank `r`'s heartbeat stayed still past the limit (while this rank's own
    /// heartbeats get through).
    pub(crate) fn stopped(&self, r: usize) -> bool {
        r != self.rank
            && matches!((self.silent_for(r), self.limit()), (Some(s), Some(l)) if s > l)
            && self.store_answers()
    }

    /// Every world rank's state: its published flight record (this rank's taken now) and
    /// heartbeat. Reads the store without waiting.
    pub(crate) fn gather(&self) -> Vec<PeerState> {
        let reachable = self.limit().is_none() || self.store_answers();
        if reachable {
            self.publish();
        }
        (0..self.world)
            .map(|r| PeerState {
                record: if r == self.rank {
                    Some(self.recorder.snapshot(r))
                } else if reachable {
                    self.store
                        .get(&self.key("flight", r), Duration::ZERO)
                        .ok()
                        .and_then(|b| FlightRecord::decode(&String::from_utf8_lossy(&b)))
                } else {
                    None
                },
                silent_for: (r != self.rank).then(|| self.silent_for(r)).flatten(),
                stopped: self.stopped(r),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemStore, StoreError};

    const BEAT: Duration = Duration::from_millis(40);

    /// Polls `f` until it holds (up to 10 s: the threads may be descheduled under load).
    fn eventually(f: impl Fn() -> bool) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if f() {
                return true;
            }
            std::thread::sleep(BEAT / 4);
        }
        false
    }

    #[test]
    fn a_peer_whose_heartbeat_stops_is_called_stopped_and_its_record_is_read() {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let a = Monitor::new(Arc::clone(&store), "hb", 0, 2, BEAT);
        let b = Monitor::new(Arc::clone(&store), "hb", 1, 2, BEAT);
        a.start();
        b.start();
        assert!(eventually(|| a.gather()[1].record.is_some()));
        assert!(!a.stopped(1) && !a.stopped(0));
        // Rank 1 stops beating (as a SIGSTOPped process does); rank 0 notices after 3 beats.
        b.shutdown();
        assert!(eventually(|| a.stopped(1)));
        assert!(a.silent_for(1).unwrap() > BEAT * HEARTBEAT_MISSES);
        a.shutdown();
        // No heartbeat: nobody is ever stopped.
        let off = Monitor::new(store, "off", 0, 2, Duration::ZERO);
        off.start();
        assert_eq!(
            (off.limit(), off.silent_for(1), off.stopped(1)),
            (None, None, false)
        );
    }

    /// A store that no longer answers (its host process stopped).
    struct DeadStore;
    impl Store for DeadStore {
        fn set(&self, _: &str, _: &[u8]) -> Result<(), StoreError> {
            Err(StoreError::Io("down".into()))
        }
        fn get(&self, _: &str, _: Duration) -> Result<Vec<u8>, StoreError> {
            Err(StoreError::Io("down".into()))
        }
        fn wait(&self, _: &[&str], _: Duration) -> Result<(), StoreError> {
            Err(StoreError::Io("down".into()))
        }
        fn add(&self, _: &str, _: i64) -> Result<i64, StoreError> {
            Err(StoreError::Io("down".into()))
        }
        fn compare_set(&self, _: &str, _: Option<&[u8]>, _: &[u8]) -> Result<Vec<u8>, StoreError> {
            Err(StoreError::Io("down".into()))
        }
        fn delete(&self, _: &str) -> Result<bool, StoreError> {
            Err(StoreError::Io("down".into()))
        }
    }

    #[test]
    fn when_the_store_does_not_answer_no_peer_is_blamed() {
        let m = Monitor::new(Arc::new(DeadStore), "dead", 0, 2, BEAT);
        m.start();
        std::thread::sleep(BEAT * (HEARTBEAT_MISSES + 2));
        assert!(m.silent_for(1).unwrap() > m.limit().unwrap());
        assert!(!m.stopped(1), "the silence is the store's, not rank 1's");
        let peers = m.gather();
        assert!(peers[0].record.is_some() && peers[1].record.is_none());
        m.shutdown();
    }
}
