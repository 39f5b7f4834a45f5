//! Cutting a model into pipeline stages: contiguous runs of blocks, the embedding with the
//! first and the head (with the loss) with the last, balanced by each segment's compute or as
//! the user says.

use crate::error::{ParallelError, Result};
use kiln_memory::ModelShape;
use std::ops::Range;

/// How the blocks are shared out over the pipeline's model stages (`pp x virtual_stages` of
/// them).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageSplit {
    /// Balanced by each segment's forward FLOPs ([`segment_flops`]): the contiguous split whose
    /// most expensive stage is cheapest (the earliest such split where several tie). A stage
    /// with the head gets fewer blocks when the logits cost more than a block.
    #[default]
    Balanced,
    /// The same number of blocks on every stage (Megatron-LM's default), which needs the stage
    /// count to divide the blocks.
    Even,
    /// The blocks of each stage, first to last, as the user gives them.
    Blocks(Vec<usize>),
}

/// Forward FLOPs per token of each segment of a decoder with `shape`: the embedding (a lookup
/// and an add, `2h`), each block (two FLOPs per weight of its products, plus `4sq` for the
/// attention of `q = n_heads * head_dim` query columns over `s` positions) and the head
/// (`2hV`, the logits). A block's products: the query and output projections (`2hq` each),
/// the key and value ones (`2h kv` each, `kv = kv_heads * head_dim`), and the MLP (`4hf`, or
/// `6hf` gated: gate, up and down). GPT: `24h² + 4sh`.
pub fn segment_flops(shape: &ModelShape) -> Vec<u64> {
    let (h, s, v) = (shape.d_model, shape.ctx, shape.vocab);
    let (q, kv, f) = (shape.q_width(), shape.kv_width(), shape.d_ff());
    let mlp = if shape.gated_mlp { 3 * f } else { 2 * f };
    let block = 2 * h * (2 * q + 2 * kv + mlp) + 4 * s * q;
    let mut out = vec![2 * h];
    out.extend((0..shape.n_layers).map(|_| block));
    out.push(2 * h * v);
    out
}

/// The segments of each model stage (`stages` of them, in order; a rank with virtual stages
/// holds stages `rank, rank + pp, ...`): ranges covering `0..n_layers + 2`, each stage with at
/// least one block, the embedding (segment 0) on the first and the head on the last. Errors
/// name the factor and the rule.
pub fn stage_segments(
    shape: &ModelShape,
    stages: usize,
    split: &StageSplit,
) -> Result<Vec<Range<usize>>> {
    let layers = shape.n_layers as usize;
    if stages == 0 {
        return Err(ParallelError::Config(
            "the pipeline needs at least one stage, got 0".into(),
        ));
    }
    let blocks: Vec<usize> = match split {
        StageSplit::Blocks(b) => {
            if b.len() != stages {
                return Err(ParallelError::Config(format!(
                    "the stage split gives {} stages' blocks ({b:?}) for {stages} stages",
                    b.len()
                )));
            }
            if let Some(k) = b.iter().position(|&x| x == 0) {
                return Err(ParallelError::Config(format!(
                    "the stage split {b:?} leaves stage {k} without a block: every stage needs \
                     at least one"
                )));
            }
            let sum: usize = b.iter().sum();
            if sum != layers {
                return Err(ParallelError::Config(format!(
                    "the stage split {b:?} holds {sum} blocks, the model has n_layers = {layers}"
                )));
            }
            b.clone()
        }
        _ if layers < stages => {
            return Err(ParallelError::Config(format!(
                "{stages} pipeline stages need at least one block each, the model has n_layers \
                 = {layers}"
            )))
        }
        StageSplit::Even => {
            if layers % stages != 0 {
                return Err(ParallelError::Config(format!(
                    "an even split needs the stages ({stages}) to divide n_layers ({layers})"
                )));
            }
            vec![layers / stages; stages]
        }
        StageSplit::Balanced => balanced(&segment_flops(shape), stages),
    };
    let mut out = Vec::with_capacity(stages);
    let mut start = 0;
    let mut block = 0;
    for (k, &b) in blocks.iter().enumerate() {
        block += b;
        // segment i + 1 is block i; the first stage starts at the embedding, the last ends
        // with the head
        let end = if k + 1 == stages {
            layers + 2
        } else {
            block + 1
        };
        out.push(start..end);
        start = end;
    }
    Ok(out)
}

/// Blocks per stage minimising the most expensive stage (embedding cost on the first, head
/// cost on the last), by dynamic programming over the cut points; ties go to the earliest cut.
fn balanced(costs: &[u64], stages: usize) -> Vec<usize> {
    let layers = costs.len() - 2;
    let (emb, head) = (costs[0], costs[layers + 1]);
    // prefix[i]: the cost of blocks 0..i
    let mut prefix = vec![0u64; layers + 1];
    for i in 0..layers {
        prefix[i + 1] = prefix[i] + costs[i + 1];
    }
    let stage_cost = |k: usize, a: usize, b: usize| {
        let mut c = prefix[b] - prefix[a];
        if k == 0 {
            c += emb;
        }
        if k + 1 == stages {
            c += head;
        }
        c
    };
    // best[k][b]: the least worst cost of stages 0..=k over blocks 0..b, with its cut
    let inf = u64::MAX;
    let mut best = vec![vec![inf; layers + 1]; stages];
    let mut cut = vec![vec![0usize; layers + 1]; stages];
    for (b, slot) in best[0].iter_mut().enumerate().skip(1) {
        *slot = stage_cost(0, 0, b);
    }
    for k in 1..stages {
        for b in (k + 1)..=layers {
            for a in k..b {
                if best[k - 1][a] == inf {
                    continue;
                }
                let c = best[k - 1][a].max(stage_cost(k, a, b));
                if c < best[k][b] {
                    best[k][b] = c;
                    cut[k][b] = a;
                }
            }
        }
    }
    let mut blocks = vec![0; stages];
    let mut b = layers;
    for k in (0..stages).rev() {
        let a = if k == 0 { 0 } else { cut[k][b] };
        blocks[k] = b - a;
        b = a;
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(layers: u64, vocab: u64) -> ModelShape {
        ModelShape::gpt(layers, 64, 4, 32, vocab)
    }

    /// Every split against the brute force over all contiguous splits.
    #[test]
    fn balanced_is_the_cheapest_worst_stage() {
        for layers in 1..=9u64 {
            for vocab in [16u64, 256, 4096, 65536] {
                let s = shape(layers, vocab);
                let costs = segment_flops(&s);
                for stages in 1..=layers as usize {
                    let got = stage_segments(&s, stages, &StageSplit::Balanced).unwrap();
                    let worst = |r: &[Range<usize>]| {
                        r.iter()
                            .map(|r| costs[r.clone()].iter().sum::<u64>())
                            .max()
                            .unwrap()
                    };
                    // brute force: every way to place stages - 1 cuts among the blocks
                    let l = layers as usize;
                    let mut best = u64::MAX;
                    let mut cuts = vec![0usize; stages.saturating_sub(1)];
                    fn rec(
                        i: usize,
                        from: usize,
                        l: usize,
                        cuts: &mut Vec<usize>,
                        f: &mut dyn FnMut(&[usize]),
                    ) {
                        if i == cuts.len() {
                            f(cuts);
                            return;
                        }
                        for c in from..l {
                            cuts[i] = c;
                            rec(i + 1, c + 1, l, cuts, f);
                        }
                    }
                    rec(0, 1, l, &mut cuts, &mut |c: &[usize]| {
                        let mut bounds = vec![0usize];
                        bounds.extend(c.iter().map(|x| x + 1));
                        bounds.push(l + 2);
                        let ranges: Vec<Range<usize>> =
                            bounds.windows(2).map(|w| w[0]..w[1]).collect();
                        best = best.min(worst(&ranges));
                    });
                    assert_eq!(worst(&got), best, "L {layers} V {vocab} stages {stages}");
                    assert_eq!(got.len(), stages);
                    assert_eq!(got[0].start, 0);
                    assert_eq!(got[stages - 1].end, l + 2);
                    assert!(got.windows(2).all(|w| w[0].end == w[1].start));
                    // at least one block each: the first two segments, the last two, or one
                    assert!(got.iter().enumerate().all(|(k, r)| {
                        let extra = usize::from(k == 0) + usize::from(k + 1 == stages);
                        r.len() > extra
                    }));
                }
            }
        }
    }

    #[test]
    fn even_and_given_splits_and_their_errors() {
        let s = shape(8, 256);
        assert_eq!(
            stage_segments(&s, 4, &StageSplit::Even).unwrap(),
            vec![0..3, 3..5, 5..7, 7..10]
        );
        assert_eq!(
            stage_segments(&s, 2, &StageSplit::Blocks(vec![5, 3])).unwrap(),
            vec![0..6, 6..10]
        );
        let e = stage_segments(&s, 3, &StageSplit::Even)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the stages (3) to divide n_layers (8)"), "{e}");
        let e = stage_segments(&s, 3, &StageSplit::Blocks(vec![4, 0, 4]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("leaves stage 1 without a block"), "{e}");
        let e = stage_segments(&s, 2, &StageSplit::Blocks(vec![4, 3]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("holds 7 blocks, the model has n_layers = 8"),
            "{e}"
        );
        let e = stage_segments(&s, 9, &StageSplit::Balanced)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("9 pipeline stages need at least one block each"),
            "{e}"
        );
        // a costly head takes blocks off the last stage
        let big = shape(8, 65536);
        let r = stage_segments(&big, 2, &StageSplit::Balanced).unwrap();
        assert!(r[1].len() < r[0].len(), "{r:?}");
    }

    #[test]
    fn block_flops_follow_the_layout() {
        // GPT: 24h² + 4sh
        let gpt = shape(2, 256);
        assert_eq!(segment_flops(&gpt)[1], 24 * 64 * 64 + 4 * 32 * 64);
        // Llama 3 8B: q and o 2·h² each, k and v 2·h·(8·128) each, SwiGLU 3 products of
        // 2·h·f, and the attention 4·s·h
        let (h, kv, f, s) = (4096u64, 1024u64, 14_336u64, 8192u64);
        let llama = ModelShape::llama(32, h, 32, 8, f, s, 128_256);
        let flops = segment_flops(&llama);
        let block = 2 * 2 * h * h + 2 * 2 * h * kv + 3 * 2 * h * f + 4 * s * h;
        assert_eq!(flops[1], block);
        assert_eq!((flops[0], flops[33]), (2 * h, 2 * h * 128_256));
        // two FLOPs per weight of the block's matrices (its RMSNorm weights aside)
        let matrices = llama.params() - 2 * 128_256 * h - h - 32 * 2 * h;
        assert_eq!(32 * (block - 4 * s * h), 2 * matrices);
    }
}
