//! Small instruction and preference sets generated deterministically in code, with properties
//! a tiny model can learn in minutes on a CPU, and the evaluation that says whether it did.
//!
//! Sequences use four special ids ([`BOS`], [`SEP`], [`EOS`], and 0 as padding) and "words"
//! `FIRST_WORD .. FIRST_WORD + words`. A prompt is `BOS w1 .. wk SEP`.
//! - [`reverse_examples`]: the instruction "reverse": the response is `wk .. w1 EOS`.
//! - [`last_word_pairs`]: the preferred response repeats the prompt's last word (`wk EOS`), the
//!   dispreferred one is another word (`w' EOS`).

use crate::batch::{sft_batch, Example, PreferencePair, IGNORE_INDEX};
use crate::error::{Result, TuneError};
use candle_core::{DType, Tensor};
use kiln_model::Gpt;
use kiln_state::splitmix64;

/// Start of a sequence.
pub const BOS: u32 = 1;
/// End of the prompt.
pub const SEP: u32 = 2;
/// End of the response.
pub const EOS: u32 = 3;
/// The first word id.
pub const FIRST_WORD: u32 = 8;

/// Words `0..words` drawn uniformly by `(seed, index, position)`.
fn word(seed: u64, index: u64, pos: u64, words: u32) -> u32 {
    let h = splitmix64(splitmix64(seed ^ index.wrapping_mul(0x9E37_79B9)) ^ pos);
    FIRST_WORD + (h % u64::from(words)) as u32
}

fn check(words: u32, len: usize) -> Result<()> {
    if words < 2 || len == 0 {
        return Err(TuneError::config(
            "synthetic task",
            format!("needs at least 2 words and 1 word per prompt, got {words} and {len}"),
        ));
    }
    Ok(())
}

fn prompt(seed: u64, i: u64, words: u32, len: usize) -> Vec<u32> {
    let mut p = vec![BOS];
    p.extend((0..len as u64).map(|k| word(seed, i, k, words)));
    p.push(SEP);
    p
}

/// `n` "reverse" examples of `len` words out of `words`, keyed by `seed` (another seed gives
/// held-out prompts).
pub fn reverse_examples(n: usize, words: u32, len: usize, seed: u64) -> Result<Vec<Example>> {
    check(words, len)?;
    Ok((0..n as u64)
        .map(|i| {
            let prompt = prompt(seed, i, words, len);
            let mut response: Vec<u32> = prompt[1..=len].iter().rev().copied().collect();
            response.push(EOS);
            Example { prompt, response }
        })
        .collect())
}

/// `n` preference pairs: the chosen response repeats the prompt's last word, the rejected one
/// is a different word, keyed by `seed`.
pub fn last_word_pairs(n: usize, words: u32, len: usize, seed: u64) -> Result<Vec<PreferencePair>> {
    check(words, len)?;
    Ok((0..n as u64)
        .map(|i| {
            let prompt = prompt(seed, i, words, len);
            let last = prompt[len];
            // another word: shift by 1 ..= words - 1
            let shift = 1 + (splitmix64(seed ^ 0xD1CE ^ i) % u64::from(words - 1)) as u32;
            let other = FIRST_WORD + (last - FIRST_WORD + shift) % words;
            PreferencePair {
                prompt,
                chosen: vec![last, EOS],
                rejected: vec![other, EOS],
            }
        })
        .collect())
}

/// How well a model answers instruction examples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnswerQuality {
    /// Mean cross-entropy over the response tokens, nats.
    pub response_loss: f64,
    /// Fraction of response tokens that are the model's most likely next token.
    pub token_accuracy: f64,
    /// Fraction of examples whose whole response is what greedy decoding produces (every
    /// response token the argmax given the right prefix, which is what greedy decoding
    /// follows).
    pub exact_match: f64,
}

/// Scores `model` on `examples` (in batches of 64, rows of width `ctx`), teacher-forced.
pub fn answer_quality(model: &Gpt, examples: &[Example], ctx: usize) -> Result<AnswerQuality> {
    let device = model.options().device.clone();
    let (mut loss, mut tokens, mut right, mut exact) = (0.0f64, 0usize, 0usize, 0usize);
    for chunk in examples.chunks(64) {
        let refs: Vec<&Example> = chunk.iter().collect();
        let b = sft_batch(&refs, ctx, &device)?;
        let logits = model.forward(&b.inputs)?.detach().to_dtype(DType::F32)?;
        let (rows, t, v) = logits.dims3()?;
        let lsm = log_softmax_rows(&logits.reshape((rows * t, v))?)?;
        let lsm: Vec<f32> = lsm.flatten_all()?.to_vec1()?;
        let targets: Vec<u32> = b.targets.flatten_all()?.to_vec1()?;
        for r in 0..rows {
            let mut all = true;
            for j in 0..t {
                let y = targets[r * t + j];
                if y == IGNORE_INDEX {
                    continue;
                }
                let row = &lsm[(r * t + j) * v..(r * t + j + 1) * v];
                loss -= f64::from(row[y as usize]);
                tokens += 1;
                // greedy: the lowest id among ties
                let best = row
                    .iter()
                    .enumerate()
                    .fold(0usize, |b, (i, &x)| if x > row[b] { i } else { b });
                if best == y as usize {
                    right += 1;
                } else {
                    all = false;
                }
            }
            exact += usize::from(all);
        }
    }
    if tokens == 0 {
        return Err(TuneError::input("examples", "at least one", "none"));
    }
    Ok(AnswerQuality {
        response_loss: loss / tokens as f64,
        token_accuracy: right as f64 / tokens as f64,
        exact_match: exact as f64 / examples.len() as f64,
    })
}

/// Row-wise log-softmax of `[n, v]` (evaluation only: no backward needed).
fn log_softmax_rows(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(1)?;
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}
