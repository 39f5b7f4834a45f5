//! The fixed-size wire forms of a [`Call`] and of a point-to-point message's header, for
//! backends that exchange them between processes.

use crate::check::Call;
use crate::communicator::{Descriptor, OpKind};
use crate::elem::{DType, ReduceOp};

/// Words of one encoded call.
pub(crate) const WIRE_WORDS: usize = 10;

const NONE: u64 = u64::MAX;

fn op_code(op: OpKind) -> u64 {
    match op {
        OpKind::AllReduce => 0,
        OpKind::ReduceScatter => 1,
        OpKind::AllGather => 2,
        OpKind::Broadcast => 3,
        OpKind::Barrier => 4,
        OpKind::Split => 5,
        OpKind::Send => 6,
        OpKind::Recv => 7,
    }
}

fn op_of(code: u64) -> Option<OpKind> {
    Some(match code {
        0 => OpKind::AllReduce,
        1 => OpKind::ReduceScatter,
        2 => OpKind::AllGather,
        3 => OpKind::Broadcast,
        4 => OpKind::Barrier,
        5 => OpKind::Split,
        6 => OpKind::Send,
        7 => OpKind::Recv,
        _ => return None,
    })
}

const DTYPES: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::U32,
];
const REDUCES: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

fn code_of<T: PartialEq>(all: &[T], x: Option<T>) -> u64 {
    x.and_then(|x| all.iter().position(|a| *a == x))
        .map_or(NONE, |i| i as u64)
}

fn of_code<T: Copy>(all: &[T], code: u64) -> Option<T> {
    usize::try_from(code).ok().and_then(|i| all.get(i).copied())
}

impl Call {
    /// Encodes the call as fixed words (little-endian on the wire by construction of `u64`s).
    pub(crate) fn to_wire(self) -> [u64; WIRE_WORDS] {
        let d = self.desc;
        let (fi, fo) = self
            .dtype_fault
            .map_or((None, None), |(i, o)| (Some(i), Some(o)));
        [
            d.seq,
            op_code(d.op),
            code_of(&DTYPES, d.dtype),
            d.len as u64,
            code_of(&REDUCES, d.reduce),
            d.root.map_or(NONE, |r| r as u64),
            self.chunk_len as u64,
            code_of(&DTYPES, fi) << 32 | (code_of(&DTYPES, fo) & 0xFFFF_FFFF),
            u64::from(self.split.0),
            u64::from(self.split.1),
        ]
    }

    /// Decodes [`Call::to_wire`]; `None` when the words are not a call (a corrupt message).
    pub(crate) fn from_wire(w: &[u64; WIRE_WORDS]) -> Option<Call> {
        let fault = match (
            of_code(&DTYPES, w[7] >> 32),
            of_code(&DTYPES, w[7] & 0xFFFF_FFFF),
        ) {
            (Some(i), Some(o)) => Some((i, o)),
            _ => None,
        };
        Some(Call {
            desc: Descriptor {
                seq: w[0],
                op: op_of(w[1])?,
                dtype: of_code(&DTYPES, w[2]),
                len: usize::try_from(w[3]).ok()?,
                reduce: of_code(&REDUCES, w[4]),
                root: (w[5] != NONE).then(|| usize::try_from(w[5]).ok()).flatten(),
                peer: None,
                tag: None,
            },
            chunk_len: usize::try_from(w[6]).ok()?,
            dtype_fault: fault,
            split: (u32::try_from(w[8]).ok()?, u32::try_from(w[9]).ok()?),
        })
    }
}

/// Words of a point-to-point header.
pub(crate) const HEADER_WORDS: usize = 5;

/// The first word of every header, so that a message that is not kiln's is recognised.
const HEADER_MAGIC: u64 = 0x6b69_6c6e_7032_7031;

/// Encodes what a sender presents with its message: message number, dtype, length and tag.
pub(crate) fn p2p_header(sent: &Descriptor) -> [u64; HEADER_WORDS] {
    [
        HEADER_MAGIC,
        sent.seq,
        code_of(&DTYPES, sent.dtype),
        sent.len as u64,
        sent.tag.map_or(NONE, u64::from),
    ]
}

/// Decodes [`p2p_header`] as the descriptor of a send to rank `dest`; `None` when the words are
/// not a header.
pub(crate) fn p2p_from_header(w: &[u64], dest: usize) -> Option<Descriptor> {
    match *w {
        [HEADER_MAGIC, seq, dtype, len, tag] => Some(Descriptor::p2p(
            seq,
            OpKind::Send,
            of_code(&DTYPES, dtype)?,
            usize::try_from(len).ok()?,
            dest,
            u32::try_from(tag).ok()?,
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::check::test_call as call;

    #[test]
    fn wire_form_round_trips() {
        let mut c = call(OpKind::ReduceScatter, 7, 3);
        c.dtype_fault = Some((DType::F16, DType::U32));
        c.split = (9, 2);
        assert_eq!(Call::from_wire(&c.to_wire()), Some(c));
        let mut b = call(OpKind::Broadcast, 0, 0);
        b.desc.dtype = None;
        b.desc.reduce = None;
        b.desc.root = Some(3);
        assert_eq!(Call::from_wire(&b.to_wire()), Some(b));
        let mut bad = b.to_wire();
        bad[1] = 17;
        assert_eq!(Call::from_wire(&bad), None);
        let sent = Descriptor::p2p(41, OpKind::Send, DType::I64, 1 << 33, 3, u32::MAX);
        let h = p2p_header(&sent);
        assert_eq!(p2p_from_header(&h, 3), Some(sent));
        assert_eq!(p2p_from_header(&h[1..], 3), None);
        let mut bad = h;
        bad[0] ^= 1;
        assert_eq!(p2p_from_header(&bad, 3), None);
    }
}
