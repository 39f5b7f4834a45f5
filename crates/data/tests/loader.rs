//! The loader's rules: batches hold the right tokens, every sample once per epoch across ranks,
//! equal batch counts, the same batches for any worker count, bitwise resume (across an epoch
//! boundary, a weight change and a skip), resharding, and faults reported instead of hanging.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_data::{
    write_shard, Batch, DataError, DataLoader, DistributedSampler, LoaderConfig, LoaderState,
    SampleId, SampleRng, SampleView, SamplerConfig, SkipSet, TailPolicy, TokenDropout, TokenDtype,
    TokenSource, Transform, Verify,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let d =
            std::env::temp_dir().join(format!("kiln-data-loader-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Token `p` of source `s` is `s * 1_000_000 + p`: every row can be checked against its id.
fn token(source: u32, pos: u64) -> u32 {
    source * 1_000_000 + pos as u32
}

/// A source of `tokens` tokens split into shards of the given sizes (cycled).
fn source(dir: &TempDir, s: u32, tokens: u64, shard_sizes: &[u64]) -> TokenSource {
    let mut paths = Vec::new();
    let mut pos = 0u64;
    let mut i = 0;
    while pos < tokens {
        let n = shard_sizes[i % shard_sizes.len()].min(tokens - pos);
        let toks: Vec<u32> = (pos..pos + n).map(|p| token(s, p)).collect();
        let p = dir.0.join(format!("src{s}_{i:04}.bin"));
        write_shard(&p, &toks, TokenDtype::U32).unwrap();
        paths.push(p);
        pos += n;
        i += 1;
    }
    TokenSource::open(format!("src{s}"), &paths, Verify::Full).unwrap()
}

fn check_rows(b: &Batch) {
    for (r, id) in b.sample_ids.iter().enumerate() {
        let start = id.index * b.ctx as u64;
        let want: Vec<u32> = (start..start + b.ctx as u64 + 1)
            .map(|p| token(id.source, p))
            .collect();
        assert_eq!(b.row_inputs(r), &want[..b.ctx], "inputs of {id}");
        assert_eq!(b.row_targets(r), &want[1..], "targets of {id}");
    }
}

fn cfg(ctx: usize, batch: usize, dp: usize, rank: usize, workers: usize) -> LoaderConfig {
    LoaderConfig {
        dp,
        rank,
        workers,
        seed: 1234,
        prefetch: 3,
        chunk_tokens: 64,
        cache_chunks: 8,
        ..LoaderConfig::new(ctx, batch)
    }
}

#[test]
fn batches_hold_the_sampler_order_and_the_source_tokens() {
    let d = TempDir::new("order");
    let src = source(&d, 0, 1000, &[300]);
    let n = src.num_samples(16);
    assert_eq!(n, 62);
    for rank in 0..2 {
        let mut l = DataLoader::new(vec![src.clone()], None, cfg(16, 4, 2, rank, 2)).unwrap();
        let mut s = DistributedSampler::new(SamplerConfig {
            num_samples: n,
            dp: 2,
            rank,
            batch_size: 4,
            seed: 1234,
            tail: TailPolicy::Drop,
        })
        .unwrap();
        assert_eq!(l.batches_per_epoch(), Some(7));
        for step in 0..20 {
            let b = l.next_batch().unwrap();
            assert_eq!(b.step, step);
            check_rows(&b);
            let want: Vec<SampleId> = s
                .next_batch(&SkipSet::new())
                .unwrap()
                .iter()
                .map(|p| p.id)
                .collect();
            assert_eq!(b.sample_ids, want);
        }
        let st = l.stats();
        assert_eq!(st.batches, 20);
        assert_eq!(st.staged_hits + st.staged_misses, 20);
        assert!(st.chunks.hits > 0 && st.chunks.misses > 0, "{st:?}");
    }
}

#[test]
fn every_sample_once_per_epoch_across_ranks_with_shards_shorter_than_ctx() {
    let d = TempDir::new("once");
    // shards of 1 to 23 tokens, ctx 24: every window spans several shards
    let src = source(&d, 0, 24 * 53 + 7, &[5, 1, 23, 9, 16, 2]);
    let n = src.num_samples(24);
    assert_eq!(n, 53);
    for dp in 1..=4usize {
        for tail in [TailPolicy::Drop, TailPolicy::Wrap] {
            let b = 3;
            let mut per_rank = Vec::new();
            for rank in 0..dp {
                let c = LoaderConfig {
                    tail,
                    ..cfg(24, b, dp, rank, 1)
                };
                let mut l = DataLoader::new(vec![src.clone()], None, c).unwrap();
                let per = l.batches_per_epoch().unwrap();
                let mut seen = Vec::new();
                for e in 0..2u64 {
                    for _ in 0..per {
                        assert_eq!(l.epoch(), e);
                        let batch = l.next_batch().unwrap();
                        check_rows(&batch);
                        assert!(batch.epochs.iter().all(|&x| x == e));
                        seen.extend(batch.sample_ids.iter().map(|id| (e, id.index)));
                    }
                }
                assert_eq!(l.epoch(), 2);
                per_rank.push(seen);
            }
            // equal batch counts
            assert!(per_rank.iter().all(|v| v.len() == per_rank[0].len()));
            let g = (dp * b) as u64;
            for e in 0..2 {
                let mut count: HashMap<u64, usize> = HashMap::new();
                for v in &per_rank {
                    for &(ep, i) in v {
                        if ep == e {
                            *count.entry(i).or_default() += 1;
                        }
                    }
                }
                match tail {
                    TailPolicy::Drop => {
                        assert!(count.values().all(|&c| c == 1));
                        assert_eq!(count.len() as u64, n - n % g, "dp {dp}");
                    }
                    TailPolicy::Wrap => {
                        assert_eq!(count.len() as u64, n, "dp {dp}");
                        let extra: usize = count.values().map(|c| c - 1).sum();
                        assert_eq!(extra as u64, (g - n % g) % g);
                    }
                }
            }
        }
    }
}

fn mixture_sources(d: &TempDir) -> Vec<TokenSource> {
    vec![
        source(d, 0, 700, &[200]),
        source(d, 1, 300, &[31, 7]),
        source(d, 2, 1500, &[1000]),
    ]
}

fn take(l: &mut DataLoader, n: usize) -> Vec<Batch> {
    (0..n).map(|_| l.next_batch().unwrap()).collect()
}

#[test]
fn worker_count_does_not_change_the_batches() {
    let d = TempDir::new("workers");
    let srcs = mixture_sources(&d);
    let run = |workers: usize, prefetch: usize| {
        let c = LoaderConfig {
            prefetch,
            ..cfg(16, 4, 2, 1, workers)
        };
        let mut l = DataLoader::new(srcs.clone(), Some(&[1.0, 2.0, 1.0]), c).unwrap();
        l.add_transform(Arc::new(TokenDropout::new(0.3, 7).unwrap()));
        let mut out = take(&mut l, 15);
        l.set_weights(&[0.0, 1.0, 5.0]).unwrap();
        out.extend(take(&mut l, 15));
        out
    };
    let reference = run(0, 1);
    // dropout applied: some inputs are 7, targets untouched
    assert!(reference.iter().any(|b| b.inputs.contains(&7)));
    for b in &reference {
        for (r, id) in b.sample_ids.iter().enumerate() {
            let start = id.index * 16 + 1;
            let want: Vec<u32> = (start..start + 16).map(|p| token(id.source, p)).collect();
            assert_eq!(b.row_targets(r), &want[..]);
        }
    }
    // after the weight change, source 0 is never drawn
    assert!(reference[15..].iter().all(|b| !b.sources().contains(&0)));
    for (w, p) in [(1, 1), (2, 3), (3, 8)] {
        assert_eq!(run(w, p), reference, "{w} workers, {p} staged");
    }
}

#[test]
fn resume_is_bitwise_at_several_k_including_an_epoch_boundary() {
    let d = TempDir::new("resume");
    // one source: 50 samples of ctx 8, global batch 8 (dp 2 x 4): 6 batches per epoch
    let single = vec![source(&d, 0, 8 * 50 + 1, &[97])];
    let c = |workers| cfg(8, 4, 2, 1, workers);
    let mut full = DataLoader::new(single.clone(), None, c(2)).unwrap();
    full.add_transform(Arc::new(TokenDropout::new(0.1, 0).unwrap()));
    assert_eq!(full.batches_per_epoch(), Some(6));
    let all = take(&mut full, 20);
    assert_eq!(all[5].epochs[0], 0);
    assert_eq!(all[6].epochs[0], 1);
    for k in [0usize, 1, 5, 6, 7, 12, 19] {
        let mut a = DataLoader::new(single.clone(), None, c(1)).unwrap();
        a.add_transform(Arc::new(TokenDropout::new(0.1, 0).unwrap()));
        take(&mut a, k);
        let json = a.loader_state().to_json().unwrap();
        drop(a);
        let state = LoaderState::from_json(&json).unwrap();
        assert_eq!(state.step, k as u64);
        let mut b = DataLoader::restore(single.clone(), None, c(3), state).unwrap();
        b.add_transform(Arc::new(TokenDropout::new(0.1, 0).unwrap()));
        assert_eq!(take(&mut b, 20 - k), all[k..], "resume at k = {k}");
    }

    // a mixture with a weight change at step 9 and a skipped window from step 4 on
    let srcs = mixture_sources(&d);
    let drive = |l: &mut DataLoader, from: usize, to: usize| -> Vec<Batch> {
        let mut out = Vec::new();
        for step in from..to {
            if step == 4 {
                l.skip_range(2, 0..40);
            }
            if step == 9 {
                l.set_weights(&[3.0, 1.0, 0.5]).unwrap();
            }
            out.push(l.next_batch().unwrap());
        }
        out
    };
    let mut full = DataLoader::new(srcs.clone(), None, cfg(16, 3, 1, 0, 2)).unwrap();
    let all = drive(&mut full, 0, 25);
    assert!(all[4..]
        .iter()
        .flat_map(|b| &b.sample_ids)
        .all(|id| !(id.source == 2 && id.index < 40)));
    for k in [0usize, 4, 5, 9, 10, 24] {
        let mut a = DataLoader::new(srcs.clone(), None, cfg(16, 3, 1, 0, 0)).unwrap();
        drive(&mut a, 0, k);
        let state = LoaderState::from_json(&a.loader_state().to_json().unwrap()).unwrap();
        let mut b = DataLoader::restore(srcs.clone(), None, cfg(16, 3, 1, 0, 2), state).unwrap();
        assert_eq!(drive(&mut b, k, 25), all[k..], "mixture resume at k = {k}");
    }
}

#[test]
fn a_state_loads_into_another_dp_size_or_names_both() {
    let d = TempDir::new("reshard");
    let src = vec![source(&d, 0, 16 * 70 + 1, &[500])];
    // dp 2 x 4 for 3 steps, then dp 4 x 2 (same global batch) or dp 3 x 4 (another one)
    let mut old: Vec<DataLoader> = (0..2)
        .map(|r| DataLoader::new(src.clone(), None, cfg(16, 4, 2, r, 1)).unwrap())
        .collect();
    let mut seen: Vec<u64> = Vec::new();
    for _ in 0..3 {
        for l in old.iter_mut() {
            seen.extend(l.next_batch().unwrap().sample_ids.iter().map(|i| i.index));
        }
    }
    let state = old[0].loader_state();
    assert_eq!(state, old[1].loader_state().clone_with_rank(0));
    // the uninterrupted dp 2 run's next global batches
    let mut cont: Vec<Vec<u64>> = Vec::new();
    for _ in 3..8 {
        let mut g = Vec::new();
        for l in old.iter_mut() {
            g.extend(l.next_batch().unwrap().sample_ids.iter().map(|i| i.index));
        }
        cont.push(g);
    }
    // same global batch size: the same global batches, split four ways
    let mut new: Vec<DataLoader> = (0..4)
        .map(|r| {
            DataLoader::restore(src.clone(), None, cfg(16, 2, 4, r, 2), state.clone()).unwrap()
        })
        .collect();
    for g in &cont {
        let mut got = Vec::new();
        for l in new.iter_mut() {
            got.extend(l.next_batch().unwrap().sample_ids.iter().map(|i| i.index));
        }
        assert_eq!(&got, g);
    }
    // another global batch size: the rest of the epoch holds each unseen sample once
    let mut three: Vec<DataLoader> = (0..3)
        .map(|r| {
            DataLoader::restore(src.clone(), None, cfg(16, 4, 3, r, 1), state.clone()).unwrap()
        })
        .collect();
    let mut rest = seen.clone();
    while three[0].epoch() == 0 {
        for l in three.iter_mut() {
            let b = l.next_batch().unwrap();
            assert_eq!(b.epochs, vec![0; 4]);
            rest.extend(b.sample_ids.iter().map(|i| i.index));
        }
    }
    let total = rest.len();
    rest.sort_unstable();
    rest.dedup();
    assert_eq!(rest.len(), total, "a sample repeated after resharding");
    // 24 samples at dp 2, then (70 - 24) / 12 = 3 full batches of 12; 10 dropped
    assert_eq!(total, 24 + 36);

    // resharding disabled: an error naming saved and current dp
    let strict = LoaderConfig {
        allow_reshard: false,
        ..cfg(16, 2, 4, 0, 1)
    };
    let e = DataLoader::restore(src.clone(), None, strict, state.clone()).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::DpMismatch {
                saved_dp: 2,
                current_dp: 4,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("dp 2") && e.to_string().contains("dp 4"),
        "{e}"
    );
    // other mismatches name the field
    let e = DataLoader::restore(src.clone(), None, cfg(8, 4, 2, 0, 1), state.clone()).unwrap_err();
    assert!(
        matches!(e, DataError::StateMismatch { field: "ctx", .. }),
        "{e}"
    );
    let other_seed = LoaderConfig {
        seed: 1,
        ..cfg(16, 4, 2, 0, 1)
    };
    let e = DataLoader::restore(src.clone(), None, other_seed, state.clone()).unwrap_err();
    assert!(
        matches!(e, DataError::StateMismatch { field: "seed", .. }),
        "{e}"
    );
    let e = DataLoader::restore(mixture_sources(&d), None, cfg(16, 4, 2, 0, 1), state).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::StateMismatch {
                field: "sources",
                ..
            }
        ),
        "{e}"
    );
}

trait WithRank {
    fn clone_with_rank(&self, rank: usize) -> LoaderState;
}

impl WithRank for LoaderState {
    fn clone_with_rank(&self, rank: usize) -> LoaderState {
        LoaderState {
            rank,
            ..self.clone()
        }
    }
}

#[test]
fn skipped_samples_stay_skipped_and_are_saved() {
    let d = TempDir::new("skip");
    let src = vec![source(&d, 0, 16 * 40 + 1, &[200])];
    let mut l = DataLoader::new(src.clone(), None, cfg(16, 4, 1, 0, 2)).unwrap();
    take(&mut l, 3);
    let before = l.loader_state();
    let bad = l.next_batch().unwrap();
    // roll back to before the bad batch and skip its samples
    let mut r = DataLoader::restore(src.clone(), None, cfg(16, 4, 1, 0, 2), before).unwrap();
    r.skip_samples(bad.sample_ids.iter().copied());
    let state = r.loader_state();
    assert!(bad.sample_ids.iter().all(|&id| state.skip.contains(id)));
    let mut rest = Vec::new();
    for _ in 0..30 {
        let b = r.next_batch().unwrap();
        check_rows(&b);
        assert!(b.sample_ids.iter().all(|id| !bad.sample_ids.contains(id)));
        rest.push(b);
    }
    // the saved skip set makes a restored loader skip them too
    let mut again = DataLoader::restore(src, None, cfg(16, 4, 1, 0, 0), state).unwrap();
    assert_eq!(take(&mut again, 30), rest);
    // 40 samples, 4 skipped, batch 4: 9 batches per epoch
    assert_eq!(again.batches_per_epoch(), Some(9));
}

/// Fails or panics on one sample; a no-op otherwise.
struct Faulty {
    bad: SampleId,
    panic: bool,
}

impl Transform for Faulty {
    fn name(&self) -> &str {
        "faulty"
    }
    fn apply(&self, s: &mut SampleView<'_>, _rng: &mut SampleRng) -> kiln_data::Result<()> {
        if s.id == self.bad {
            if self.panic {
                panic!("injected panic on {}", s.id);
            }
            return Err(DataError::Transform {
                name: "faulty".into(),
                sample: s.id,
                message: "injected failure".into(),
            });
        }
        Ok(())
    }
}

#[test]
fn a_failing_worker_names_the_worker_and_the_sample() {
    let d = TempDir::new("fail");
    let src = vec![source(&d, 0, 16 * 40 + 1, &[200])];
    let mut plain = DataLoader::new(src.clone(), None, cfg(16, 4, 1, 0, 0)).unwrap();
    let reference = take(&mut plain, 6);
    let bad = reference[4].sample_ids[2];
    for (workers, panic) in [(0, false), (2, false), (2, true)] {
        let mut l = DataLoader::new(src.clone(), None, cfg(16, 4, 1, 0, workers)).unwrap();
        l.add_transform(Arc::new(Faulty { bad, panic }));
        assert_eq!(take(&mut l, 4), reference[..4]);
        for _ in 0..2 {
            // the failure repeats on retry: the loader restarts from the last good batch
            let e = l.next_batch().unwrap_err();
            match &e {
                DataError::Worker {
                    worker,
                    batch,
                    sample,
                    ..
                } if !panic => {
                    assert!(*worker < workers.max(1));
                    assert_eq!((*batch, *sample), (4, Some(bad)));
                }
                DataError::WorkerPanicked {
                    worker,
                    batch,
                    sample,
                    message,
                } if panic => {
                    assert!(*worker < workers);
                    assert_eq!((*batch, *sample), (4, Some(bad)));
                    assert!(message.contains("injected panic"));
                }
                other => panic!("unexpected error {other}"),
            }
            let msg = e.to_string();
            assert!(
                msg.contains("data worker") && msg.contains(&bad.to_string()),
                "{msg}"
            );
            assert_eq!(l.loader_state().step, 4);
        }
    }
}

/// Blocks on one sample until the gate opens.
struct Gate {
    at: SampleId,
    open: Arc<(Mutex<bool>, Condvar)>,
}

impl Transform for Gate {
    fn name(&self) -> &str {
        "gate"
    }
    fn apply(&self, s: &mut SampleView<'_>, _rng: &mut SampleRng) -> kiln_data::Result<()> {
        if s.id == self.at {
            let (m, cv) = &*self.open;
            let mut open = m.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
        }
        Ok(())
    }
}

#[test]
fn a_stalled_worker_is_reported_and_the_batch_still_arrives() {
    let d = TempDir::new("stall");
    let src = vec![source(&d, 0, 16 * 40 + 1, &[200])];
    let mut plain = DataLoader::new(src.clone(), None, cfg(16, 4, 1, 0, 0)).unwrap();
    let reference = take(&mut plain, 8);
    let at = reference[3].sample_ids[1];
    let open = Arc::new((Mutex::new(false), Condvar::new()));
    let c = LoaderConfig {
        stall_timeout: Duration::from_millis(200),
        ..cfg(16, 4, 1, 0, 2)
    };
    let mut l = DataLoader::new(src, None, c).unwrap();
    l.add_transform(Arc::new(Gate {
        at,
        open: open.clone(),
    }));
    assert_eq!(take(&mut l, 3), reference[..3]);
    let e = l.next_batch().unwrap_err();
    match &e {
        DataError::Stalled {
            batch: 3,
            worker: Some(w),
            sample: Some(s),
            waited,
        } => {
            assert!(*w < 2);
            assert_eq!(*s, at);
            assert!(*waited >= Duration::from_millis(200));
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(e.to_string().contains(&at.to_string()), "{e}");
    // release the worker: the same batch arrives, and the order is intact
    *open.0.lock().unwrap() = true;
    open.1.notify_all();
    assert_eq!(take(&mut l, 5), reference[3..]);
}

#[test]
fn bad_configurations_are_errors() {
    let d = TempDir::new("config");
    let tiny = source(&d, 0, 10, &[10]);
    let e = DataLoader::new(vec![tiny.clone()], None, cfg(16, 1, 1, 0, 0)).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::SourceTooSmall {
                tokens: 10,
                needed: 17,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("src0"), "{e}");
    // fewer samples than a global batch with the drop policy
    let e = DataLoader::new(vec![tiny.clone()], None, cfg(3, 2, 2, 0, 0)).unwrap_err();
    assert!(matches!(e, DataError::Exhausted { needed: 4, .. }), "{e}");
    assert!(DataLoader::new(vec![tiny.clone()], None, cfg(3, 1, 2, 2, 0)).is_err());
    assert!(DataLoader::new(vec![], None, cfg(3, 1, 1, 0, 0)).is_err());
    let two = vec![tiny.clone(), source(&d, 1, 10, &[10])];
    assert!(DataLoader::new(two.clone(), Some(&[1.0]), cfg(3, 1, 1, 0, 0)).is_err());
    let mut l = DataLoader::new(two, None, cfg(3, 1, 1, 0, 0)).unwrap();
    assert_eq!(l.weights(), &[1.0, 1.0]);
    assert!(l.set_weights(&[-1.0, 1.0]).is_err());
    let mut one = DataLoader::new(vec![tiny], None, cfg(3, 1, 1, 0, 0)).unwrap();
    assert!(one.set_weights(&[1.0]).is_err());
}
