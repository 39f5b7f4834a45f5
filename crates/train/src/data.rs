//! The trainer's data: the prepared corpus (or sources given by the caller), one loader per
//! data-parallel rank, and the ids the circuit breaker sees.

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use candle_core::{Device, Tensor};
use kiln_comm::{CommExt, Communicator};
use kiln_data::{
    prepare_corpus, Batch, DriftMonitor, PrepareConfig, QualityReport, SampleId, TokenSource,
    Verify,
};
use kiln_memory::MicroBatch;

/// Bits of a breaker sample id that hold the window index; the source sits above them.
const INDEX_BITS: u32 = 40;

/// The `u64` the circuit breaker records for a sample: the source in the top 24 bits, the
/// window index in the low 40.
pub fn encode_sample_id(id: SampleId) -> u64 {
    (u64::from(id.source) << INDEX_BITS) | (id.index & ((1u64 << INDEX_BITS) - 1))
}

/// The sample an id of [`encode_sample_id`] names.
pub fn decode_sample_id(id: u64) -> SampleId {
    SampleId::new((id >> INDEX_BITS) as u32, id & ((1u64 << INDEX_BITS) - 1))
}

/// Training and validation sources.
#[derive(Debug, Clone, Default)]
pub struct DataSources {
    /// Training sources (several are mixed with equal weights).
    pub train: Vec<TokenSource>,
    /// Validation sources (may be empty: no evaluation).
    pub val: Vec<TokenSource>,
    /// The tokenizer's vocabulary size, when known.
    pub vocab_size: Option<usize>,
    /// What the perplexity filter kept and dropped of each corpus (when it ran).
    pub quality: Vec<(String, QualityReport)>,
}

/// Prepares the configured corpus (tokenizer and shards under the cache folder, built once)
/// and opens its splits. Rank 0 of `world` builds; the others wait for it and reuse the
/// result, so the tokenizer is trained once. When it fails (a text file of a corpus missing
/// from `RunConfig.data.data_dir`, say), rank 0 returns [`TrainError::Prepare`], which names
/// the file and keeps kiln-data's error as its source, and every other rank a
/// [`TrainError::Rank`] carrying rank 0's message.
pub fn prepare_sources(cfg: &RunConfig, world: &dyn Communicator) -> Result<DataSources> {
    let vocab = cfg.gpt_config()?.vocab_size;
    let d = &cfg.data;
    let pcfg = PrepareConfig {
        corpora: d.corpora.clone(),
        vocab_size: vocab,
        val_fraction: d.val_fraction,
        train_shards: d.train_shards,
        tokenizer_sample_bytes: d.tokenizer_sample_bytes,
        quality: d.quality.clone(),
        tokenizer: d.tokenizer.clone(),
        ..PrepareConfig::new(&d.data_dir, cfg.data_cache_dir()?)
    };
    let failed = |source| TrainError::Prepare {
        corpora: d.corpora.clone(),
        data_dir: std::path::absolute(&d.data_dir).unwrap_or_else(|_| d.data_dir.clone()),
        source: Box::new(source),
    };
    let first = if world.rank() == 0 {
        Some(prepare_corpus(&pcfg).map_err(failed))
    } else {
        None
    };
    let ok = u32::from(first.as_ref().is_none_or(|r| r.is_ok()));
    let all_ok = world.all_reduce_scalar(ok, kiln_comm::ReduceOp::Min)?;
    if all_ok == 0 {
        // rank 0's error, cause included, reaches every rank: whichever rank's error the
        // caller sees names the file that is missing
        let err = first.and_then(Result::err);
        let text = broadcast_text(world, err.as_ref().map(ToString::to_string).as_deref())?;
        return Err(err.unwrap_or(TrainError::Rank {
            rank: 0,
            message: text,
        }));
    }
    let prepared = match first {
        Some(r) => r?,
        None => prepare_corpus(&pcfg).map_err(failed)?,
    };
    if prepared.vocab_size > vocab {
        return Err(TrainError::config(
            "RunConfig.model.vocab_size",
            format!(
                "the tokenizer has {} ids but the model only {vocab}",
                prepared.vocab_size
            ),
        ));
    }
    Ok(DataSources {
        train: prepared.train_sources(Verify::Full)?,
        val: if d.val_fraction > 0.0 {
            prepared.val_sources(Verify::Full)?
        } else {
            Vec::new()
        },
        vocab_size: Some(prepared.vocab_size),
        quality: prepared
            .sources
            .iter()
            .filter_map(|s| s.quality.clone().map(|q| (s.name.clone(), q)))
            .collect(),
    })
}

/// Rank 0's `text` (the others pass `None`) on every rank of `world`: its UTF-8 bytes, one per
/// `u32` element, at most [`MAX_TEXT_BYTES`] of them.
fn broadcast_text(world: &dyn Communicator, text: Option<&str>) -> Result<String> {
    let bytes = text.unwrap_or_default().as_bytes();
    let bytes = &bytes[..bytes.len().min(MAX_TEXT_BYTES)];
    let mut len = [bytes.len() as u32];
    world.broadcast(&mut len, 0)?;
    let mut buf: Vec<u32> = if world.rank() == 0 {
        bytes.iter().map(|&b| u32::from(b)).collect()
    } else {
        vec![0; len[0] as usize]
    };
    world.broadcast(&mut buf, 0)?;
    let bytes: Vec<u8> = buf.iter().map(|&b| b as u8).collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The longest error text [`broadcast_text`] sends.
const MAX_TEXT_BYTES: usize = 16 << 10;

/// Token counts of the reference distribution of the drift monitor: about `budget` tokens of
/// the training sources, each source contributing in proportion to `weights` (equal when
/// `None`), read as 64 evenly spaced runs so a corpus is not represented by its first pages.
pub fn reference_counts(
    sources: &[TokenSource],
    weights: Option<&[f64]>,
    vocab: usize,
    budget: usize,
) -> Result<Vec<u64>> {
    const RUNS: u64 = 64;
    let equal = vec![1.0; sources.len()];
    let w = weights.unwrap_or(&equal);
    let total: f64 = w.iter().sum();
    let mut counts = vec![0u64; vocab];
    let mut buf = Vec::new();
    for (src, &wi) in sources.iter().zip(w) {
        let want = ((budget as f64 * wi / total.max(f64::MIN_POSITIVE)) as u64).min(src.tokens());
        if want == 0 {
            continue;
        }
        let run = want.div_ceil(RUNS).max(1);
        let stride = src.tokens() / RUNS.min(want.div_ceil(run)).max(1);
        let mut taken = 0u64;
        let mut start = 0u64;
        while taken < want && start < src.tokens() {
            let n = run.min(want - taken).min(src.tokens() - start);
            buf.resize(n as usize, 0);
            src.read_tokens(start, &mut buf, None)?;
            for &t in &buf {
                let Some(c) = counts.get_mut(t as usize) else {
                    return Err(TrainError::config(
                        "RunConfig.model.vocab_size",
                        format!(
                            "source {} holds token {t}, outside the model's vocabulary of {vocab}",
                            src.name()
                        ),
                    ));
                };
                *c += 1;
            }
            taken += n;
            start += stride.max(n);
        }
    }
    Ok(counts)
}

/// A drift monitor over `sources` (see [`crate::DriftSection`]) with its threshold as
/// configured, not yet calibrated.
pub fn drift_monitor(
    cfg: &crate::DriftSection,
    sources: &[TokenSource],
    weights: Option<&[f64]>,
    vocab: usize,
) -> Result<DriftMonitor> {
    let counts = reference_counts(sources, weights, vocab, cfg.reference_tokens)?;
    DriftMonitor::from_counts(&counts, cfg.alpha, cfg.window, cfg.threshold)
        .map_err(|e| TrainError::config("RunConfig.data.drift", e.to_string()))
}

/// Splits a loader batch into `parts` micro-batches of input and target tensors `[b, t]` on
/// `device` (one host-to-device copy of the token ids).
pub fn micro_batches(batch: &Batch, parts: usize, device: &Device) -> Result<Vec<MicroBatch>> {
    let (b, t) = (batch.batch_size, batch.ctx);
    if parts == 0 || b % parts != 0 {
        return Err(TrainError::Builder(format!(
            "a batch of {b} samples does not split into {parts} micro-batches"
        )));
    }
    let m = b / parts;
    (0..parts)
        .map(|k| {
            let rows = k * m * t..(k + 1) * m * t;
            let x = Tensor::from_slice(&batch.inputs[rows.clone()], (m, t), device)?;
            let y = Tensor::from_slice(&batch.targets[rows], (m, t), device)?;
            Ok(MicroBatch::new(x, y)?)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_ids_round_trip() {
        for id in [
            SampleId::new(0, 0),
            SampleId::new(2, 12345),
            SampleId::new(7, (1 << 40) - 1),
        ] {
            assert_eq!(decode_sample_id(encode_sample_id(id)), id);
        }
        assert_eq!(encode_sample_id(SampleId::new(1, 5)), (1 << 40) + 5);
    }

    #[test]
    fn micro_batches_split_rows() {
        let batch = Batch {
            step: 0,
            batch_size: 4,
            ctx: 2,
            inputs: (0..8).collect(),
            targets: (1..9).collect(),
            sample_ids: vec![SampleId::new(0, 0); 4],
            epochs: vec![0; 4],
        };
        let mb = micro_batches(&batch, 2, &Device::Cpu).unwrap();
        assert_eq!(mb[1].inputs().to_vec2::<u32>().unwrap(), [[4, 5], [6, 7]]);
        assert_eq!(mb[0].targets().to_vec2::<u32>().unwrap(), [[1, 2], [3, 4]]);
        assert!(micro_batches(&batch, 3, &Device::Cpu).is_err());
    }
}
