//! A token source: the shards of one corpus or domain, read as one concatenated token stream and
//! cut into samples.

use crate::cache::ChunkCache;
use crate::error::{DataError, Result};
use crate::shard::{TokenShard, Verify};
use std::path::Path;
use std::sync::Arc;

/// The shards of one source (for example one corpus file's training split), in order, read as
/// one stream.
///
/// Samples are windows of `ctx + 1` tokens with stride `ctx`: window `i` covers tokens
/// `i*ctx ..= i*ctx + ctx`, so neighbouring windows share one token (the last target of one is
/// the first input of the next) and every token but the first is a prediction target exactly
/// once per epoch. Windows cross shard boundaries: a shard shorter than `ctx` loses nothing.
/// A source of `t` tokens has `(t - 1) / ctx` samples; the incomplete tail is unused.
#[derive(Debug, Clone)]
pub struct TokenSource {
    name: String,
    shards: Vec<Arc<TokenShard>>,
    /// starts[i] = first token of shard i; starts[len] = total
    starts: Vec<u64>,
}

impl TokenSource {
    /// A source over opened shards.
    pub fn new(name: impl Into<String>, shards: Vec<TokenShard>) -> Self {
        let mut starts = Vec::with_capacity(shards.len() + 1);
        let mut t = 0u64;
        for s in &shards {
            starts.push(t);
            t += s.len();
        }
        starts.push(t);
        TokenSource {
            name: name.into(),
            shards: shards.into_iter().map(Arc::new).collect(),
            starts,
        }
    }

    /// Opens the shard files, checking each as `verify` says.
    pub fn open<P: AsRef<Path>>(
        name: impl Into<String>,
        paths: &[P],
        verify: Verify,
    ) -> Result<Self> {
        let shards = paths
            .iter()
            .map(|p| TokenShard::open_with(p, verify))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::new(name, shards))
    }

    /// The source's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Total tokens.
    pub fn tokens(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The shards.
    pub fn shards(&self) -> &[Arc<TokenShard>] {
        &self.shards
    }

    /// Number of samples of `ctx + 1` tokens (stride `ctx`).
    pub fn num_samples(&self, ctx: usize) -> u64 {
        let t = self.tokens();
        if ctx == 0 || t < ctx as u64 + 1 {
            0
        } else {
            (t - 1) / ctx as u64
        }
    }

    /// Reads `out.len()` tokens from position `start` of the concatenated stream, through
    /// `cache` when given.
    pub fn read_tokens(
        &self,
        start: u64,
        out: &mut [u32],
        cache: Option<&ChunkCache>,
    ) -> Result<()> {
        let end = start + out.len() as u64;
        if end > self.tokens() {
            return Err(DataError::OutOfRange {
                what: "source token",
                index: end.saturating_sub(1),
                len: self.tokens(),
            });
        }
        let mut pos = start;
        let mut filled = 0usize;
        // the last shard whose start is <= pos
        let mut i = self.starts.partition_point(|&s| s <= pos).saturating_sub(1);
        while pos < end {
            let shard = &self.shards[i];
            let local = pos - self.starts[i];
            let n = (shard.len() - local).min(end - pos) as usize;
            if n > 0 {
                let dst = &mut out[filled..filled + n];
                match cache {
                    Some(c) => c.read(shard, local, dst)?,
                    None => shard.read(local, dst)?,
                }
            }
            filled += n;
            pos += n as u64;
            i += 1;
        }
        Ok(())
    }

    /// Reads sample `index` (`ctx + 1` tokens) into `out`, whose length must be `ctx + 1`.
    pub fn read_sample(
        &self,
        index: u64,
        ctx: usize,
        out: &mut [u32],
        cache: Option<&ChunkCache>,
    ) -> Result<()> {
        let n = self.num_samples(ctx);
        if index >= n {
            return Err(DataError::OutOfRange {
                what: "sample",
                index,
                len: n,
            });
        }
        if out.len() != ctx + 1 {
            return Err(DataError::config(
                "out",
                format!(
                    "sample buffer holds {} tokens, ctx + 1 is {}",
                    out.len(),
                    ctx + 1
                ),
            ));
        }
        self.read_tokens(index * ctx as u64, out, cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{write_shard, TokenDtype};

    #[test]
    fn windows_cross_shards_shorter_than_ctx() {
        let d = std::env::temp_dir().join(format!("kiln-data-source-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        // shards of 3, 0, 5, 1, 7 tokens; ctx 4 is longer than most of them
        let sizes = [3usize, 0, 5, 1, 7];
        let mut all = Vec::new();
        let mut paths = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let toks: Vec<u32> = (0..n as u32).map(|t| 100 * i as u32 + t).collect();
            all.extend_from_slice(&toks);
            let p = d.join(format!("s{i}.bin"));
            write_shard(&p, &toks, TokenDtype::U32).unwrap();
            paths.push(p);
        }
        let src = TokenSource::open("tiny", &paths, Verify::Full).unwrap();
        assert_eq!(src.tokens(), 16);
        let ctx = 4;
        assert_eq!(src.num_samples(ctx), 3); // (16 - 1) / 4
        let cache = ChunkCache::new(2, 3);
        for i in 0..3u64 {
            let want = &all[i as usize * ctx..i as usize * ctx + ctx + 1];
            let mut a = vec![0u32; ctx + 1];
            let mut b = vec![0u32; ctx + 1];
            src.read_sample(i, ctx, &mut a, None).unwrap();
            src.read_sample(i, ctx, &mut b, Some(&cache)).unwrap();
            assert_eq!(a, want);
            assert_eq!(b, want);
        }
        let mut a = vec![0u32; ctx + 1];
        assert!(matches!(
            src.read_sample(3, ctx, &mut a, None),
            Err(DataError::OutOfRange {
                what: "sample",
                index: 3,
                len: 3
            })
        ));
        assert_eq!(src.num_samples(15), 1);
        assert_eq!(src.num_samples(16), 0);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
