//! Work shared out over candle's CPU worker pool: disjoint chunks of an output handed to work
//! items through mutex slots, and items run one at a time by whichever thread is free. The
//! matrix products, the fused kernels and the data-parallel engine's host loops run on it.

use std::sync::Mutex;

/// Mutex slots handing out disjoint chunks of `data` to work items.
pub fn slots<T>(data: &mut [T], chunk: usize) -> Vec<Mutex<Option<&mut [T]>>> {
    data.chunks_mut(chunk.max(1))
        .map(|c| Mutex::new(Some(c)))
        .collect()
}

/// The chunk of a slot, once.
pub fn take<'a, T>(slot: &Mutex<Option<&'a mut [T]>>) -> Option<&'a mut [T]> {
    slot.lock().ok().and_then(|mut g| g.take())
}

/// The threads candle's worker pool runs an op on: its workers and the calling thread.
/// (`candle_core::utils::get_num_threads` parses `/proc/cpuinfo` on every call, which showed
/// in profiles when asked once per product.)
pub fn pool_threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

/// Runs `f(i, chunk)` once for every slot's chunk (slots from [`slots`]), on candle's worker
/// pool when the work is large; a chunk no worker took (none, unless the pool failed) runs
/// here afterwards, so every chunk has run when this returns.
pub fn for_each_slot<T: Send>(
    chunks: &[Mutex<Option<&mut [T]>>],
    work_per_item: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let run = |i: usize| {
        if let Some(chunk) = take(&chunks[i]) {
            f(i, chunk);
        }
    };
    run_items(chunks.len(), work_per_item, run);
    (0..chunks.len()).for_each(run);
}

/// Runs `f(i)` for `i` in `0..n` on candle's worker pool when the work is large enough, each
/// thread taking the next item as it finishes one. (candle's `execute_chunked` hands out
/// chunks of `n / (8 threads)` items, so 18 items went out as 9 chunks of 2, 5 to one thread
/// and 4 to the other: a tenth of the product on one core.) Entered through
/// `execute_chunked` with one slot per thread, which runs everything inline where the caller
/// is itself on the pool.
pub fn run_items(n: usize, work_per_item: usize, f: impl Fn(usize) + Sync) {
    if n <= 1 || n * work_per_item < 1 << 16 {
        (0..n).for_each(f);
    } else {
        let next = std::sync::atomic::AtomicUsize::new(0);
        candle_core::utils::barrier_pool().execute_chunked(pool_threads(), |_| loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if i >= n {
                break;
            }
            f(i);
        });
    }
}
