//! Resharding: checkpoints saved with ZeRO flat shards or tensor-parallel dim shards load
//! into other layouts bitwise equal to the corresponding slices of the full tensors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{values, TempDir};
use kiln_ckpt::ZeroStage;
use kiln_ckpt::{
    CheckpointConfig, Checkpointer, CkptError, Layout, RankState, ReshardRequest, Shard, StateDict,
    Storage, TensorData, Want,
};
use kiln_comm::{chunk_range, Communicator};
use kiln_testkit::{assert_bitwise_eq, run_ranks};
use std::sync::Arc;

const N: usize = 1003;

fn cfg(dp: usize, tp: usize, zero: u8) -> CheckpointConfig {
    CheckpointConfig::new(
        Layout::new(dp, tp, ZeroStage::from_number(zero).unwrap()).unwrap(),
        "gpt-reshard",
    )
}

fn flat_params() -> Vec<f32> {
    values(11, N)
}

fn flat_moments() -> Vec<f32> {
    values(12, N)
}

/// Rank `r` of `dp`'s ZeRO state: its chunk of the flat parameters and first moments.
fn zero_state(dp: usize, r: usize) -> RankState {
    let range = chunk_range(N, dp, r);
    let mut model = StateDict::new();
    let mut optim = StateDict::new();
    for (sd, full) in [(&mut model, flat_params()), (&mut optim, flat_moments())] {
        let t = TensorData::from_vec1(&full[range.clone()]);
        sd.insert_sharded("flat", t, Shard::flat(&[N], range.start, range.len()))
            .unwrap();
    }
    optim.set_meta("t", 5).unwrap();
    let mut s = RankState::new();
    s.insert("model", model).unwrap();
    s.insert("optim", optim).unwrap();
    s
}

#[test]
fn zero_flat_shards_load_at_any_dp() {
    let dir = TempDir::new("zero");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(4, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), cfg(4, 1, 3))?;
        ck.save(&comm, 100, &zero_state(4, comm.rank()))?;
        Ok(())
    });
    for dp in [2usize, 1, 3, 4, 5] {
        run_ranks(dp, |comm| {
            let r = comm.rank();
            let ck = Checkpointer::new(Arc::clone(&storage), cfg(dp, 1, 3))?;
            let want = Want::FlatChunk {
                parts: dp,
                index: r,
            };
            let req = ReshardRequest::new(Layout::new(dp, 1, ZeroStage::Zero3)?).otherwise(want);
            let loaded = ck.load_resharded(&comm, 100, &req)?;
            let range = chunk_range(N, dp, r);
            let model = loaded.state.part("model").unwrap();
            let optim = loaded.state.part("optim").unwrap();
            assert_bitwise_eq(&model.get::<f32>("flat")?, &flat_params()[range.clone()]);
            assert_bitwise_eq(&optim.get::<f32>("flat")?, &flat_moments()[range.clone()]);
            assert_eq!(
                model.shard("flat"),
                Some(&Shard::flat(&[N], range.start, range.len()))
            );
            assert_eq!(optim.meta::<u64>("t")?, 5);
            Ok(())
        });
    }
    // the whole buffer on one rank, and the resharded state saved again at dp=3 then
    // loaded back at dp=4 gives the original shards
    let dir3 = TempDir::new("zero3");
    let storage3: Arc<dyn Storage> = dir3.storage();
    run_ranks(3, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), cfg(3, 1, 1))?;
        let req =
            ReshardRequest::new(Layout::new(3, 1, ZeroStage::Zero1)?).otherwise(Want::FlatChunk {
                parts: 3,
                index: comm.rank(),
            });
        let loaded = ck.load_resharded(&comm, 100, &req)?;
        let mut ck3 = Checkpointer::new(Arc::clone(&storage3), cfg(3, 1, 1))?;
        ck3.save(&comm, 101, &loaded.state)?;
        Ok(())
    });
    run_ranks(4, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage3), cfg(4, 1, 3))?;
        let req =
            ReshardRequest::new(Layout::new(4, 1, ZeroStage::Zero3)?).otherwise(Want::FlatChunk {
                parts: 4,
                index: comm.rank(),
            });
        let loaded = ck.load_resharded(&comm, 101, &req)?;
        assert_eq!(loaded.state, zero_state(4, comm.rank()));
        Ok(())
    });
    run_ranks(1, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), cfg(1, 1, 0))?;
        let req = ReshardRequest::new(Layout::single()).otherwise(Want::Full);
        let loaded = ck.load_resharded(&comm, 100, &req)?;
        let model = loaded.state.part("model").unwrap();
        assert_bitwise_eq(&model.get_shaped::<f32>("flat", &[N])?, &flat_params());
        assert_eq!(model.shard("flat"), None);
        Ok(())
    });
}

/// Reference slice of a row-major matrix along `dim`, by index arithmetic.
fn slice(full: &[f32], shape: [usize; 2], dim: usize, start: usize, len: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for i in 0..shape[0] {
        for j in 0..shape[1] {
            let k = if dim == 0 { i } else { j };
            if k >= start && k < start + len {
                out.push(full[i * shape[1] + j]);
            }
        }
    }
    out
}

fn col() -> Vec<f32> {
    values(21, 48) // [8, 6], column-parallel: split dim 0
}
fn row() -> Vec<f32> {
    values(22, 48) // [6, 8], row-parallel: split dim 1
}
fn bias() -> Vec<f32> {
    values(23, 6) // replicated
}
fn emb() -> Vec<f32> {
    values(24, 40) // [10, 4], vocab-parallel: split dim 0
}

/// Tensor-parallel rank `t` of `tp`.
fn tp_state(tp: usize, t: usize) -> RankState {
    let mut m = StateDict::new();
    let put = |m: &mut StateDict, name: &str, full: Vec<f32>, shape: [usize; 2], dim: usize| {
        let len = shape[dim] / tp;
        let s = Shard::dim(&shape, dim, t * len, len);
        let data = slice(&full, shape, dim, t * len, len);
        let local = s.local_shape();
        m.insert_sharded(name, TensorData::from_slice(&local, &data).unwrap(), s)
            .unwrap();
    };
    put(&mut m, "col", col(), [8, 6], 0);
    put(&mut m, "row", row(), [6, 8], 1);
    put(&mut m, "emb", emb(), [10, 4], 0);
    m.put("bias", &[6], &bias()).unwrap();
    let mut s = RankState::new();
    s.insert("model", m).unwrap();
    s
}

#[test]
fn tensor_parallel_shards_load_at_tp1_and_tp4() {
    let dir = TempDir::new("tp");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let mut ck = Checkpointer::new(Arc::clone(&storage), cfg(1, 2, 0))?;
        ck.save(&comm, 9, &tp_state(2, comm.rank()))?;
        Ok(())
    });
    run_ranks(1, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), cfg(1, 1, 0))?;
        let req = ReshardRequest::new(Layout::single()).part("model", Want::Full);
        let m = ck
            .load_resharded(&comm, 9, &req)?
            .state
            .take_part("model")?;
        assert_bitwise_eq(&m.get_shaped::<f32>("col", &[8, 6])?, &col());
        assert_bitwise_eq(&m.get_shaped::<f32>("row", &[6, 8])?, &row());
        assert_bitwise_eq(&m.get_shaped::<f32>("emb", &[10, 4])?, &emb());
        assert_bitwise_eq(&m.get_shaped::<f32>("bias", &[6])?, &bias());
        Ok(())
    });
    run_ranks(4, |comm| {
        let t = comm.rank();
        let ck = Checkpointer::new(Arc::clone(&storage), cfg(1, 4, 0))?;
        let req = ReshardRequest::new(Layout::new(1, 4, ZeroStage::Replicated)?)
            .tensor(
                "model/col",
                Want::DimChunk {
                    dim: 0,
                    parts: 4,
                    index: t,
                },
            )
            .tensor(
                "model/row",
                Want::DimChunk {
                    dim: 1,
                    parts: 4,
                    index: t,
                },
            )
            .tensor("model/bias", Want::Full);
        let m = ck
            .load_resharded(&comm, 9, &req)?
            .state
            .take_part("model")?;
        assert_bitwise_eq(
            &m.get_shaped::<f32>("col", &[2, 6])?,
            &slice(&col(), [8, 6], 0, 2 * t, 2),
        );
        assert_bitwise_eq(
            &m.get_shaped::<f32>("row", &[6, 2])?,
            &slice(&row(), [6, 8], 1, 2 * t, 2),
        );
        assert_bitwise_eq(&m.get::<f32>("bias")?, &bias());
        assert!(m.tensor("emb").is_none());
        assert_eq!(m.shard("col"), Some(&Shard::dim(&[8, 6], 0, 2 * t, 2)));
        Ok(())
    });
    // the vocabulary (10) is not divisible by tp=4: every rank gets the same clear error
    let errs = run_ranks(4, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), cfg(1, 4, 0))?;
        let chunk = Want::DimChunk {
            dim: 0,
            parts: 4,
            index: comm.rank(),
        };
        let req = ReshardRequest::new(Layout::new(1, 4, ZeroStage::Replicated)?)
            .tensor("model/col", chunk.clone())
            .tensor("model/emb", chunk);
        Ok(ck.load_resharded(&comm, 9, &req).unwrap_err())
    });
    for e in errs {
        assert!(
            matches!(&e, CkptError::State(kiln_ckpt::StateError::NotDivisible { name, dim: 0, size: 10, factor: 4 }) if name == "model/emb"),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "cannot reshard tensor model/emb: dim 0 of size 10 is not divisible by 4"
        );
    }
}

#[test]
fn dp_by_tp_replicas_and_flat_to_dim() {
    // dp=2 x tp=2: rank = d * 2 + t holds tensor-parallel shard t (replicated over d), and
    // its ZeRO chunk of a flat [8, 6] buffer over all four ranks
    let dir = TempDir::new("grid");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(4, |comm| {
        let r = comm.rank();
        let mut s = tp_state(2, r % 2);
        let c = chunk_range(48, 4, r);
        let t = TensorData::from_vec1(&col()[c.clone()]);
        s.part_mut("model").unwrap().insert_sharded(
            "colflat",
            t,
            Shard::flat(&[8, 6], c.start, c.len()),
        )?;
        let mut ck = Checkpointer::new(Arc::clone(&storage), cfg(2, 2, 1))?;
        ck.save(&comm, 4, &s)?;
        Ok(())
    });
    run_ranks(2, |comm| {
        let i = comm.rank();
        let ck = Checkpointer::new(Arc::clone(&storage), cfg(2, 1, 0))?;
        let req = ReshardRequest::new(Layout::new(2, 1, ZeroStage::Replicated)?)
            .tensor("model/row", Want::Full)
            .tensor(
                "model/colflat",
                Want::DimChunk {
                    dim: 1,
                    parts: 2,
                    index: i,
                },
            );
        let m = ck
            .load_resharded(&comm, 4, &req)?
            .state
            .take_part("model")?;
        assert_bitwise_eq(&m.get_shaped::<f32>("row", &[6, 8])?, &row());
        assert_bitwise_eq(
            &m.get_shaped::<f32>("colflat", &[8, 3])?,
            &slice(&col(), [8, 6], 1, 3 * i, 3),
        );
        Ok(())
    });
}

#[test]
fn incomplete_or_inconsistent_shards_are_errors() {
    let dir = TempDir::new("holes");
    let storage: Arc<dyn Storage> = dir.storage();
    run_ranks(2, |comm| {
        let r = comm.rank();
        let mut s = zero_state(2, r);
        if r == 1 {
            // rank 1 drops its chunk of the parameters, and saves the moments with another
            // global shape
            s.part_mut("model").unwrap().remove("flat");
            let o = s.part_mut("optim").unwrap();
            let t = TensorData::from_vec1(&[0.0f32; 4]);
            o.insert_sharded("flat", t, Shard::flat(&[N + 1], 0, 4))?;
        }
        let mut ck = Checkpointer::new(Arc::clone(&storage), cfg(2, 1, 1))?;
        ck.save(&comm, 1, &s)?;
        Ok(())
    });
    let errs = run_ranks(1, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), cfg(1, 1, 0))?;
        let full = |name: &str| ReshardRequest::new(Layout::single()).tensor(name, Want::Full);
        Ok([
            ck.load_resharded(&comm, 1, &full("model/flat"))
                .unwrap_err()
                .to_string(),
            ck.load_resharded(&comm, 1, &full("optim/flat"))
                .unwrap_err()
                .to_string(),
            ck.load_resharded(&comm, 1, &full("model/nope"))
                .unwrap_err()
                .to_string(),
        ])
    });
    assert_eq!(
        errs[0],
        [
            "cannot reshard tensor model/flat: elements from 502 of the 1003 requested are held by no rank",
            "cannot reshard tensor optim/flat: rank 0 saved f32 [1003] but rank 1 saved f32 [1004]",
            "missing tensor model/nope",
        ]
    );
    // a request for a world the communicator does not have
    let e = run_ranks(1, |comm| {
        let ck = Checkpointer::new(Arc::clone(&storage), cfg(1, 1, 0))?;
        let req =
            ReshardRequest::new(Layout::new(2, 1, ZeroStage::Replicated)?).otherwise(Want::Full);
        Ok(ck.load_resharded(&comm, 1, &req).unwrap_err().to_string())
    });
    assert_eq!(
        e[0],
        "layout dp=2 tp=1 zero=0 needs 2 ranks but the communicator has 1"
    );
}
