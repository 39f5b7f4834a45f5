//! Small collectives the checkpoint protocol is built from, on top of the element types
//! kiln-comm carries.

use crate::error::{CkptError, Result};
use kiln_comm::{CommExt, Communicator, ReduceOp};

/// Every rank's byte string, in rank order, on every rank: an all-gather of the lengths, then
/// of the bytes packed into `u32` words and padded to the longest.
pub(crate) fn all_gather_bytes(comm: &dyn Communicator, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let world = comm.world_size();
    let len = u32::try_from(mine.len())
        .map_err(|_| CkptError::Config(format!("{} bytes is too long to gather", mine.len())))?;
    let mut lens = vec![0u32; world];
    comm.all_gather(&[len], &mut lens)?;
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    let words = max.div_ceil(4);
    if words == 0 {
        return Ok(vec![Vec::new(); world]);
    }
    let mut packed = vec![0u32; words];
    for (w, c) in packed.iter_mut().zip(mine.chunks(4)) {
        let mut b = [0u8; 4];
        b[..c.len()].copy_from_slice(c);
        *w = u32::from_le_bytes(b);
    }
    let mut all = vec![0u32; words * world];
    comm.all_gather(&packed, &mut all)?;
    Ok(all
        .chunks(words)
        .zip(&lens)
        .map(|(ws, &n)| {
            let mut v: Vec<u8> = ws.iter().flat_map(|w| w.to_le_bytes()).collect();
            v.truncate(n as usize);
            v
        })
        .collect())
}

/// Checks that every rank passed the same step: one all-reduce of `[step, -step]` with max.
pub(crate) fn agree_step(comm: &dyn Communicator, step: u64) -> Result<()> {
    let s = i64::try_from(step)
        .map_err(|_| CkptError::Config(format!("step {step} exceeds i64::MAX")))?;
    let mut v = [s, -s];
    comm.all_reduce(&mut v, ReduceOp::Max)?;
    let (max, min) = (v[0], -v[1]);
    if max != min {
        return Err(CkptError::StepMismatch {
            min: min as u64,
            max: max as u64,
        });
    }
    Ok(())
}

/// Broadcasts rank 0's verdict (`true` = success) to every rank.
pub(crate) fn broadcast_ok(comm: &dyn Communicator, ok: bool) -> Result<bool> {
    let mut v = [u32::from(!ok)];
    comm.broadcast(&mut v, 0)?;
    Ok(v[0] == 0)
}

/// Broadcasts rank 0's list of steps (or its failure) to every rank.
pub(crate) fn broadcast_steps(
    comm: &dyn Communicator,
    mine: std::result::Result<&[u64], ()>,
) -> Result<Option<Vec<u64>>> {
    let mut n = [match mine {
        Ok(s) => i64::try_from(s.len()).unwrap_or(i64::MAX),
        Err(()) => -1,
    }];
    comm.broadcast(&mut n, 0)?;
    if n[0] < 0 {
        return Ok(None);
    }
    let mut steps = vec![0i64; n[0] as usize];
    if let Ok(s) = mine {
        for (d, &x) in steps.iter_mut().zip(s) {
            *d = i64::try_from(x).unwrap_or(i64::MAX);
        }
    }
    if !steps.is_empty() {
        comm.broadcast(&mut steps, 0)?;
    }
    Ok(Some(steps.into_iter().map(|s| s as u64).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_testkit::run_ranks;

    #[test]
    fn gathers_uneven_byte_strings() {
        let out = run_ranks(3, |comm| {
            let mine: Vec<u8> = (0..comm.rank() * 5 + 1).map(|i| i as u8 ^ 0xa5).collect();
            Ok(all_gather_bytes(&comm, &mine)?)
        });
        for got in out {
            for (r, v) in got.iter().enumerate() {
                let expected: Vec<u8> = (0..r * 5 + 1).map(|i| i as u8 ^ 0xa5).collect();
                assert_eq!(v, &expected);
            }
        }
        let empty = run_ranks(2, |comm| Ok(all_gather_bytes(&comm, &[])?));
        assert_eq!(empty[1], vec![Vec::<u8>::new(); 2]);
    }

    #[test]
    fn step_disagreement_names_both_steps() {
        let out = run_ranks(3, |comm| {
            Ok(agree_step(&comm, if comm.rank() == 1 { 12 } else { 10 })
                .unwrap_err()
                .to_string())
        });
        for e in out {
            assert_eq!(
                e,
                "ranks disagree on the checkpoint step: smallest 10, largest 12"
            );
        }
        run_ranks(2, |comm| Ok(agree_step(&comm, 7)?));
    }
}
