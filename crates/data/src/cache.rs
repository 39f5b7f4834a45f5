//! The middle level of the loader's three-level cache: an in-memory LRU of decoded shard chunks,
//! above the memory-mapped files and below the staged batches.

use crate::error::Result;
use crate::shard::TokenShard;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Counters of a [`ChunkCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkCacheStats {
    /// Chunk reads served from memory.
    pub hits: u64,
    /// Chunk reads that decoded from the mapped file.
    pub misses: u64,
    /// Chunks dropped to make room.
    pub evictions: u64,
    /// Chunks held now.
    pub resident: usize,
}

/// (shard id, chunk index) -> (decoded tokens, last-use tick)
type ChunkMap = HashMap<(u64, u64), (Arc<[u32]>, u64)>;

#[derive(Debug, Default)]
struct Lru {
    map: ChunkMap,
    tick: u64,
}

/// A least-recently-used cache of decoded chunks (`chunk_tokens` tokens as `u32`) of shards,
/// shared by the loader's worker threads. A capacity of 0 disables it (every read decodes from
/// the mapped file and counts as a miss).
#[derive(Debug)]
pub struct ChunkCache {
    chunk_tokens: u64,
    capacity: usize,
    lru: Mutex<Lru>,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl ChunkCache {
    /// A cache of up to `capacity` chunks of `chunk_tokens` tokens (at least 1).
    pub fn new(chunk_tokens: usize, capacity: usize) -> Self {
        ChunkCache {
            chunk_tokens: chunk_tokens.max(1) as u64,
            capacity,
            lru: Mutex::new(Lru::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// Tokens per chunk.
    pub fn chunk_tokens(&self) -> usize {
        self.chunk_tokens as usize
    }

    /// The counters so far.
    pub fn stats(&self) -> ChunkCacheStats {
        let resident = self.lock().map.len();
        ChunkCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            resident,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        // The map is never left half-updated, so a panic elsewhere cannot poison its meaning.
        self.lru.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Chunk `chunk` of `shard`, decoded.
    pub fn chunk(&self, shard: &TokenShard, chunk: u64) -> Result<Arc<[u32]>> {
        let key = (shard.id(), chunk);
        if self.capacity > 0 {
            let mut lru = self.lock();
            lru.tick += 1;
            let tick = lru.tick;
            if let Some(entry) = lru.map.get_mut(&key) {
                entry.1 = tick;
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(entry.0.clone());
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let start = chunk * self.chunk_tokens;
        let len = self.chunk_tokens.min(shard.len().saturating_sub(start));
        let mut buf = vec![0u32; len as usize];
        shard.read(start, &mut buf)?;
        let data: Arc<[u32]> = buf.into();
        if self.capacity > 0 {
            let mut lru = self.lock();
            lru.tick += 1;
            let tick = lru.tick;
            if !lru.map.contains_key(&key) && lru.map.len() >= self.capacity {
                if let Some(oldest) = lru.map.iter().min_by_key(|(_, v)| v.1).map(|(k, _)| *k) {
                    lru.map.remove(&oldest);
                    self.evictions.fetch_add(1, Ordering::Relaxed);
                }
            }
            lru.map.insert(key, (data.clone(), tick));
        }
        Ok(data)
    }

    /// Reads `out.len()` tokens of `shard` from `start`, through the cache.
    pub fn read(&self, shard: &TokenShard, start: u64, out: &mut [u32]) -> Result<()> {
        let end = start + out.len() as u64;
        if end > shard.len() {
            // let the shard produce its range error
            return shard.read(start, out);
        }
        let mut pos = start;
        let mut filled = 0usize;
        while pos < end {
            let c = pos / self.chunk_tokens;
            let data = self.chunk(shard, c)?;
            let off = (pos - c * self.chunk_tokens) as usize;
            let n = (data.len() - off).min((end - pos) as usize);
            out[filled..filled + n].copy_from_slice(&data[off..off + n]);
            filled += n;
            pos += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{write_shard, TokenDtype};

    #[test]
    fn lru_hits_misses_and_evictions() {
        let d = std::env::temp_dir().join(format!("kiln-data-cache-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let toks: Vec<u32> = (0..1000).map(|i| i * 3).collect();
        write_shard(d.join("s.bin"), &toks, TokenDtype::U16).unwrap();
        let s = TokenShard::open(d.join("s.bin")).unwrap();
        let cache = ChunkCache::new(100, 2);
        let mut out = vec![0u32; 150];
        cache.read(&s, 50, &mut out).unwrap(); // chunks 0, 1: 2 misses
        assert_eq!(out, toks[50..200]);
        cache.read(&s, 120, &mut out[..10]).unwrap(); // chunk 1: hit
        assert_eq!(out[..10], toks[120..130]);
        cache.read(&s, 250, &mut out[..10]).unwrap(); // chunk 2: miss, evicts chunk 0
        cache.read(&s, 0, &mut out[..10]).unwrap(); // chunk 0: miss, evicts chunk 1
        cache.read(&s, 990, &mut out[..10]).unwrap(); // chunk 9 (last): miss
        assert_eq!(out[..10], toks[990..]);
        assert_eq!(
            cache.stats(),
            ChunkCacheStats {
                hits: 1,
                misses: 5,
                evictions: 3,
                resident: 2
            }
        );
        assert!(cache.read(&s, 995, &mut out[..10]).is_err());
        let off = ChunkCache::new(100, 0);
        off.read(&s, 0, &mut out).unwrap();
        assert_eq!(out, toks[..150]);
        assert_eq!(off.stats().hits, 0);
        assert_eq!(off.stats().resident, 0);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
