//! The flight recorder: every rank keeps the last [`RING_LEN`] operations it issued on any of
//! its groups (collectives and point-to-point: group, sequence number, kind, bytes, peer,
//! start and finish times) in a fixed ring, plus per group how many collectives and
//! point-to-point operations it started and finished. Recording an operation writes one ring
//! slot under an uncontended lock (no allocation); only a [`FlightRecorder::snapshot`], taken
//! when the record is published (each heartbeat, or when a wait times out), builds a
//! [`FlightRecord`], which travels through the store as text ([`FlightRecord::encode`]).
//!
//! Sequence numbers: a group's collectives are numbered 1, 2, … in call order (the number
//! carried in every message header, so ranks that disagree are caught); point-to-point
//! operations are numbered separately per group.
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::engine::GroupDesc;
use crate::wire::OpKind;

/// Operations kept per rank.
pub const RING_LEN: usize = 64;

/// Direction of a point-to-point operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Dir {
    /// A collective (no single peer).
    #[default]
    None,
    Send,
    Recv,
    /// Batched sends and receives (`send_recv`).
    Both,
}

/// One recorded operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpEntry {
    /// Group name, e.g. `dp[0,2]` (world ranks in brackets).
    pub group: String,
    /// Collective number in the group, or point-to-point number (see the module doc).
    pub seq: u64,
    pub kind: OpKind,
    /// Payload bytes of this rank's buffer (collectives) or of its sends and receives.
    pub bytes: u64,
    /// World rank of the (first) peer of a point-to-point operation.
    pub peer: Option<usize>,
    pub dir: Dir,
    /// Wall-clock milliseconds since the Unix epoch.
    pub started_ms: u64,
    /// `None` while the operation runs.
    pub finished_ms: Option<u64>,
    /// Whether it ended in an error.
    pub failed: bool,
}

impl OpEntry {
    /// `all_reduce #812 on dp[0,1]`, `send #4 to rank 3 on pp[1,3]`.
    pub fn describe(&self) -> String {
        let peer = self.peer.map_or(String::new(), |p| match self.dir {
            Dir::Send => format!(" to rank {p}"),
            Dir::Recv => format!(" from rank {p}"),
            _ => format!(" with rank {p}"),
        });
        let name = match (self.kind, self.dir) {
            (OpKind::P2p, Dir::Send) => "send",
            (OpKind::P2p, Dir::Recv) => "recv",
            (k, _) => k.name(),
        };
        format!("{name} #{}{peer} on {}", self.seq, self.group)
    }
}

/// What a rank did on one group so far.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct GroupProgress {
    pub group: String,
    /// Collectives started and finished (the last started one's number is `started`).
    pub started: u64,
    pub finished: u64,
    /// Point-to-point operations started and finished.
    pub p2p_started: u64,
    pub p2p_finished: u64,
}

/// One rank's published flight record.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct FlightRecord {
    /// World rank.
    pub rank: usize,
    /// When the snapshot was taken (ms since the Unix epoch).
    pub taken_ms: u64,
    pub groups: Vec<GroupProgress>,
    /// Oldest first.
    pub ops: Vec<OpEntry>,
}

impl FlightRecord {
    /// The operation this rank is inside, if any (the newest unfinished one).
    pub fn current(&self) -> Option<&OpEntry> {
        self.ops.iter().rev().find(|o| o.finished_ms.is_none())
    }

    /// The newest finished operation.
    pub fn last_finished(&self) -> Option<&OpEntry> {
        self.ops
            .iter()
            .filter(|o| o.finished_ms.is_some())
            .max_by_key(|o| o.finished_ms)
    }

    /// This rank's progress on `group`, if it ever used it.
    pub fn progress(&self, group: &str) -> Option<&GroupProgress> {
        self.groups.iter().find(|g| g.group == group)
    }

    /// The recorded collective `seq` of `group`.
    pub fn collective(&self, group: &str, seq: u64) -> Option<&OpEntry> {
        self.ops
            .iter()
            .rev()
            .find(|o| o.kind != OpKind::P2p && o.group == group && o.seq == seq)
    }

    /// Text form: a header line, then one tab-separated line per group and per operation.
    pub fn encode(&self) -> String {
        let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
        let mut s = format!("xtrain-flight 1\t{}\t{}\n", self.rank, self.taken_ms);
        for g in &self.groups {
            s += &format!(
                "group\t{}\t{}\t{}\t{}\t{}\n",
                g.group, g.started, g.finished, g.p2p_started, g.p2p_finished
            );
        }
        for o in &self.ops {
            let dir = match o.dir {
                Dir::None => "-",
                Dir::Send => "send",
                Dir::Recv => "recv",
                Dir::Both => "both",
            };
            s += &format!(
                "op\t{}\t{}\t{}\t{}\t{}\t{dir}\t{}\t{}\t{}\n",
                o.group,
                o.seq,
                o.kind.name(),
                o.bytes,
                opt(o.peer.map(|p| p as u64)),
                o.started_ms,
                opt(o.finished_ms),
                o.failed as u8
            );
        }
        s
    }

    /// Parses [`encode`](Self::encode)'s text; `None` for anything else.
    pub fn decode(text: &str) -> Option<FlightRecord> {
        let mut lines = text.lines();
        let head: Vec<&str> = lines.next()?.split('\t').collect();
        if head.len() != 3 || head[0] != "xtrain-flight 1" {
            return None;
        }
        let mut r = FlightRecord {
            rank: head[1].parse().ok()?,
            taken_ms: head[2].parse().ok()?,
            ..Default::default()
        };
        let opt = |s: &str| -> Option<Option<u64>> {
            match s {
                "-" => Some(None),
                v => v.parse().ok().map(Some),
            }
        };
        for line in lines {
            let f: Vec<&str> = line.split('\t').collect();
            match (f[0], f.len()) {
                ("group", 6) => r.groups.push(GroupProgress {
                    group: f[1].to_string(),
                    started: f[2].parse().ok()?,
                    finished: f[3].parse().ok()?,
                    p2p_started: f[4].parse().ok()?,
                    p2p_finished: f[5].parse().ok()?,
                }),
                ("op", 10) => r.ops.push(OpEntry {
                    group: f[1].to_string(),
                    seq: f[2].parse().ok()?,
                    kind: *OpKind::ALL.iter().find(|k| k.name() == f[3])?,
                    bytes: f[4].parse().ok()?,
                    peer: opt(f[5])?.map(|p| p as usize),
                    dir: match f[6] {
                        "-" => Dir::None,
                        "send" => Dir::Send,
                        "recv" => Dir::Recv,
                        "both" => Dir::Both,
                        _ => return None,
                    },
                    started_ms: f[7].parse().ok()?,
                    finished_ms: opt(f[8])?,
                    failed: f[9] == "1",
                }),
                _ => return None,
            }
        }
        Some(r)
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `HH:MM:SS.mmm` (UTC) of a [`now_ms`] time.
pub fn clock(ms: u64) -> String {
    let s = ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{:03} UTC",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        ms % 1000
    )
}

/// One ring slot: an [`OpEntry`] with the group shared instead of named.
#[derive(Clone, Default)]
struct Slot {
    /// Operation number on this rank (0: empty slot).
    id: u64,
    group: Option<Arc<GroupDesc>>,
    seq: u64,
    kind: Option<OpKind>,
    bytes: u64,
    peer: Option<usize>,
    dir: Dir,
    started_ms: u64,
    finished_ms: Option<u64>,
    failed: bool,
}

struct Progress {
    desc: Arc<GroupDesc>,
    counts: [u64; 4],
}

#[derive(Default)]
struct Inner {
    ring: Vec<Slot>,
    next_id: u64,
    groups: Vec<Progress>,
}

/// One rank's recorder, shared by all its groups' engines.
#[derive(Default)]
pub struct FlightRecorder {
    inner: Mutex<Inner>,
}

/// What [`FlightRecorder::begin`] records besides the group.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpInfo {
    pub kind: OpKind,
    pub seq: u64,
    pub bytes: u64,
    /// Group rank of the first peer (point-to-point).
    pub peer: Option<usize>,
    pub dir: Dir,
}

impl FlightRecorder {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a group; returns its index for [`begin`](Self::begin).
    pub(crate) fn register(&self, desc: &Arc<GroupDesc>) -> usize {
        let mut g = self.lock();
        g.groups.push(Progress {
            desc: Arc::clone(desc),
            counts: [0; 4],
        });
        g.groups.len() - 1
    }

    /// Records the start of an operation on group `gid`; returns its id for [`end`](Self::end).
    pub(crate) fn begin(&self, gid: usize, op: OpInfo) -> u64 {
        let mut g = self.lock();
        if g.ring.is_empty() {
            g.ring = vec![Slot::default(); RING_LEN];
        }
        g.next_id += 1;
        let id = g.next_id;
        let p2p = op.kind == OpKind::P2p;
        let progress = &mut g.groups[gid];
        progress.counts[if p2p { 2 } else { 0 }] += 1;
        let desc = Arc::clone(&progress.desc);
        let peer = op.peer.map(|p| desc.world_ranks[p]);
        g.ring[(id as usize) % RING_LEN] = Slot {
            id,
            group: Some(desc),
            seq: op.seq,
            kind: Some(op.kind),
            bytes: op.bytes,
            peer,
            dir: op.dir,
            started_ms: now_ms(),
            finished_ms: None,
            failed: false,
        };
        id
    }

    /// Sets the peer (world rank), direction and bytes of point-to-point operation `id`.
    pub(crate) fn set_p2p(&self, id: u64, peer: Option<usize>, dir: Dir, bytes: u64) {
        let mut g = self.lock();
        if let Some(slot) = g
            .ring
            .get_mut((id as usize) % RING_LEN)
            .filter(|s| s.id == id)
        {
            (slot.peer, slot.dir, slot.bytes) = (peer, dir, bytes);
        }
    }

    /// Records the end of operation `id` on group `gid`.
    pub(crate) fn end(&self, gid: usize, id: u64, ok: bool) {
        let mut g = self.lock();
        let Some(slot) = g.ring.get_mut((id as usize) % RING_LEN) else {
            return;
        };
        let p2p = slot.kind == Some(OpKind::P2p);
        if slot.id == id {
            slot.finished_ms = Some(now_ms());
            slot.failed = !ok;
        }
        g.groups[gid].counts[if p2p { 3 } else { 1 }] += 1;
    }

    /// Operations begun or ended so far (changes whenever the record does).
    pub(crate) fn ops_recorded(&self) -> u64 {
        let g = self.lock();
        g.next_id
            + g.groups
                .iter()
                .map(|p| p.counts[1] + p.counts[3])
                .sum::<u64>()
    }

    /// The record as it stands, for world rank `rank`.
    pub fn snapshot(&self, rank: usize) -> FlightRecord {
        let g = self.lock();
        let mut slots: Vec<&Slot> = g.ring.iter().filter(|s| s.id != 0).collect();
        slots.sort_by_key(|s| s.id);
        FlightRecord {
            rank,
            taken_ms: now_ms(),
            groups: g
                .groups
                .iter()
                .map(|p| GroupProgress {
                    group: p.desc.name.clone(),
                    started: p.counts[0],
                    finished: p.counts[1],
                    p2p_started: p.counts[2],
                    p2p_finished: p.counts[3],
                })
                .collect(),
            ops: slots
                .into_iter()
                .map(|s| OpEntry {
                    group: s.group.as_ref().map_or(String::new(), |d| d.name.clone()),
                    seq: s.seq,
                    kind: s.kind.unwrap_or(OpKind::P2p),
                    bytes: s.bytes,
                    peer: s.peer,
                    dir: s.dir,
                    started_ms: s.started_ms,
                    finished_ms: s.finished_ms,
                    failed: s.failed,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(name: &str, ranks: &[usize]) -> Arc<GroupDesc> {
        Arc::new(GroupDesc {
            name: name.to_string(),
            world_ranks: ranks.to_vec(),
            rank: 0,
        })
    }

    #[test]
    fn the_ring_keeps_the_newest_operations_and_round_trips_as_text() {
        let rec = FlightRecorder::default();
        let dp = rec.register(&desc("dp[0,2]", &[0, 2]));
        let pp = rec.register(&desc("pp[0,1]", &[0, 1]));
        for seq in 1..=RING_LEN as u64 + 10 {
            let op = OpInfo {
                kind: OpKind::AllReduce,
                seq,
                bytes: 4096,
                peer: None,
                dir: Dir::None,
            };
            let id = rec.begin(dp, op);
            rec.end(dp, id, true);
        }
        let send = OpInfo {
            kind: OpKind::P2p,
            seq: 1,
            bytes: 64,
            peer: Some(1),
            dir: Dir::Send,
        };
        rec.begin(pp, send);
        let r = rec.snapshot(0);
        assert_eq!(r.ops.len(), RING_LEN);
        assert_eq!(
            r.ops.first().unwrap().seq,
            12,
            "the oldest were overwritten"
        );
        let cur = r.current().unwrap();
        assert_eq!(cur.describe(), "send #1 to rank 1 on pp[0,1]");
        assert_eq!(
            r.last_finished().unwrap().describe(),
            "all_reduce #74 on dp[0,2]"
        );
        let p = r.progress("dp[0,2]").unwrap();
        assert_eq!((p.started, p.finished), (74, 74));
        assert_eq!(r.progress("pp[0,1]").unwrap().p2p_started, 1);
        assert_eq!(FlightRecord::decode(&r.encode()), Some(r.clone()));
        assert_eq!(FlightRecord::decode("garbage"), None);
        let torn = r.encode().replace("op\tdp", "op\tdp\tx");
        assert_eq!(FlightRecord::decode(&torn), None);
    }

    #[test]
    fn clock_prints_utc_time_of_day() {
        assert_eq!(
            clock(((16 * 60 + 2) * 60 + 11) * 1000 + 7),
            "16:02:11.007 UTC"
        );
    }
}
