//! sha256 computed on a second thread while the caller writes or reads the same bytes, so
//! checksumming a checkpoint costs little extra wall time.
//!
//! Saving uses [`sha256_beside`]: the bytes are all in memory, so the hashing thread walks
//! them on its own and the writer never waits for it (the write and its fsync overlap the
//! hash). Loading uses [`sha256_alongside`], whose hasher follows the reader piece by piece.

use crate::error::{CkptError, Result};
use crate::manifest::hex;
use sha2::{Digest, Sha256};
use std::sync::mpsc;

/// Hands byte slices, in order, to the hashing thread.
pub(crate) struct HashSink<'a> {
    tx: mpsc::SyncSender<&'a [u8]>,
}

impl<'a> HashSink<'a> {
    /// Appends `bytes` to the hashed stream.
    pub fn feed(&self, bytes: &'a [u8]) {
        // The receiver lives until the sink is dropped, so the send cannot fail.
        let _ = self.tx.send(bytes);
    }
}

/// Runs `produce`, which feeds slices to the sink in stream order, while another thread
/// computes their sha256; returns `produce`'s value and the hex digest.
pub(crate) fn sha256_alongside<'a, T>(
    produce: impl FnOnce(&HashSink<'a>) -> Result<T>,
) -> Result<(T, String)> {
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::sync_channel::<&'a [u8]>(16);
        let hasher = s.spawn(move || {
            let mut h = Sha256::new();
            for b in rx {
                h.update(b);
            }
            hex(&h.finalize())
        });
        let sink = HashSink { tx };
        let out = produce(&sink);
        drop(sink);
        let digest = hasher
            .join()
            .map_err(|_| CkptError::WriterPanicked("the sha256 thread panicked".to_string()))?;
        Ok((out?, digest))
    })
}

/// Runs `produce` while another thread computes the sha256 of the concatenation of
/// `chunks`; returns `produce`'s value and the hex digest. The two sides share nothing but
/// the (immutable) bytes, so neither waits for the other.
pub(crate) fn sha256_beside<T>(
    chunks: &[&[u8]],
    produce: impl FnOnce() -> Result<T>,
) -> Result<(T, String)> {
    std::thread::scope(|s| {
        let hasher = s.spawn(|| {
            let mut h = Sha256::new();
            for c in chunks {
                h.update(c);
            }
            hex(&h.finalize())
        });
        let out = produce();
        let digest = hasher
            .join()
            .map_err(|_| CkptError::WriterPanicked("the sha256 thread panicked".to_string()))?;
        Ok((out?, digest))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beside_matches_a_one_shot_digest() {
        let data: Vec<u8> = (0..100_003u32).map(|i| (i * 31 % 251) as u8).collect();
        let chunks: Vec<&[u8]> = data.chunks(4099).collect();
        let (n, d) = sha256_beside(&chunks, || Ok(chunks.len())).unwrap();
        assert_eq!(n, 25);
        assert_eq!(d, hex(&Sha256::digest(&data)));
        let (_, d) = sha256_beside(&[b"a".as_slice(), b"", b"bc"], || Ok(())).unwrap();
        assert_eq!(
            d,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let e = sha256_beside(&[b"a".as_slice()], || -> Result<()> {
            Err(CkptError::Config("no".to_string()))
        });
        assert!(matches!(e, Err(CkptError::Config(_))));
    }

    #[test]
    fn matches_a_one_shot_digest() {
        let data: Vec<u8> = (0..100_003u32).map(|i| (i * 31 % 251) as u8).collect();
        let ((), d) = sha256_alongside(|sink| {
            for c in data.chunks(4096) {
                sink.feed(c);
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(d, hex(&Sha256::digest(&data)));
        // sha256("abc"), FIPS 180-2 example
        let ((), d) = sha256_alongside(|sink| {
            sink.feed(b"a");
            sink.feed(b"bc");
            Ok(())
        })
        .unwrap();
        assert_eq!(
            d,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
