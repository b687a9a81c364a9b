//! The message header every transport carries in front of each payload.
//!
//! Layout (32 bytes, little-endian):
//! `magic u16 | version u8 | kind u8 | dtype u8 | op u8 | reserved u16 | seq u32 | tag u32 |
//!  count u64 | payload_len u64`, then the payload padded with zeros to a multiple of 8 bytes
//! (so that every chunk a receiver sees starts 8-byte aligned and holds whole elements).
//!
//! `kind`, `dtype`, `op`, `seq` (the collective's sequence number in its group), `tag` (step
//! and root) and `count` (the collective's length argument) let the receiver detect ranks that
//! called different collectives or the same one with different arguments.
use crate::element::{DType, ReduceOp};

pub(crate) const HEADER_LEN: usize = 32;
const MAGIC: u16 = 0x5854; // "XT"
const VERSION: u8 = 1;
/// Largest payload a header may announce (guards allocations against corrupt headers).
pub(crate) const MAX_PAYLOAD: u64 = 1 << 40;

/// The kind of operation a message belongs to (also the key of per-group counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    P2p = 1,
    Broadcast = 2,
    Reduce = 3,
    AllReduce = 4,
    ReduceScatter = 5,
    AllGather = 6,
    AllGatherV = 7,
    Gather = 8,
    Scatter = 9,
    AllToAll = 10,
    AllToAllV = 11,
    Barrier = 12,
}

impl OpKind {
    /// Every kind, in code order.
    pub const ALL: [OpKind; 12] = [
        OpKind::P2p,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::AllGatherV,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::AllToAll,
        OpKind::AllToAllV,
        OpKind::Barrier,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize - 1
    }

    fn from_code(code: u8) -> Option<OpKind> {
        OpKind::ALL.get((code as usize).wrapping_sub(1)).copied()
    }

    /// snake_case name, as used in error messages.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::P2p => "send/recv",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::AllGatherV => "all_gather_v",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::AllToAllV => "all_to_all_v",
            OpKind::Barrier => "barrier",
        }
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: OpKind,
    pub dtype: DType,
    /// Reduce op code, 0 when the operation does not reduce.
    pub op: u8,
    pub seq: u32,
    pub tag: u32,
    pub count: u64,
    pub payload_len: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = VERSION;
        b[3] = self.kind as u8;
        b[4] = self.dtype as u8;
        b[5] = self.op;
        b[8..12].copy_from_slice(&self.seq.to_le_bytes());
        b[12..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Decodes and validates; any byte string gives a header or an explanation, never a panic.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != MAGIC {
            return Err(format!("bad magic {magic:#06x} (expected {MAGIC:#06x})"));
        }
        if b[2] != VERSION {
            return Err(format!("unsupported protocol version {}", b[2]));
        }
        let kind = OpKind::from_code(b[3]).ok_or_else(|| format!("unknown op kind {}", b[3]))?;
        let dtype = DType::from_code(b[4]).ok_or_else(|| format!("unknown dtype code {}", b[4]))?;
        if b[5] != 0 && ReduceOp::from_code(b[5]).is_none() {
            return Err(format!("unknown reduce op code {}", b[5]));
        }
        let payload_len = u64_at(24);
        if payload_len > MAX_PAYLOAD {
            return Err(format!(
                "payload length {payload_len} exceeds the limit {MAX_PAYLOAD}"
            ));
        }
        if payload_len % dtype.size() as u64 != 0 {
            return Err(format!(
                "payload length {payload_len} is not a whole number of {} elements",
                dtype.name()
            ));
        }
        Ok(Header {
            kind,
            dtype,
            op: b[5],
            seq: u32_at(8),
            tag: u32_at(12),
            count: u64_at(16),
            payload_len,
        })
    }

    /// Human description used in mismatch errors.
    pub fn describe(&self) -> String {
        let op = ReduceOp::from_code(self.op)
            .map(|o| format!(", {}", o.name()))
            .unwrap_or_default();
        format!(
            "{} #{} ({}{op}, count {}, tag {:#x}, {} payload bytes)",
            self.kind,
            self.seq,
            self.dtype.name(),
            self.count,
            self.tag,
            self.payload_len
        )
    }
}

/// Bytes a message occupies on the wire (header + padded payload).
pub(crate) fn wire_len(payload: usize) -> usize {
    HEADER_LEN + payload.next_multiple_of(8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let h = Header {
            kind: OpKind::AllReduce,
            dtype: DType::BF16,
            op: ReduceOp::Avg as u8,
            seq: 7,
            tag: 0x10003,
            count: 12345,
            payload_len: 2468,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Arbitrary bytes decode to a header or an error, never a panic.
        #[test]
        fn garbage_never_panics(bytes in proptest::array::uniform32(any::<u8>())) {
            let _ = Header::decode(&bytes);
        }
    }
}
