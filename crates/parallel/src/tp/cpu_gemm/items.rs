//! How a product's work is shared out: work items of whole row panels, and candle's worker
//! pool running them one at a time.

use super::MR;
use std::sync::Mutex;

/// Bytes of packed `A` one work item may hold: an item packs all its rows before it multiplies
/// them, and a larger buffer no longer stays in L2 between the packing and the kernel.
pub(super) const A_ITEM_BYTES: usize = 1 << 20;
/// The first row panel of each work item of an `m`-row product (and the panel count last),
/// with `units` reduction units a row and `A` packed (`a_packed`) or read in place. An item
/// streams all of `B` from L3 or memory once, so the fewer the items, the less `B` is read:
/// as few as leave two items a thread (the pool's threads take them one at a time), more
/// where a packed `A` item would exceed [`A_ITEM_BYTES`], always a multiple of the thread
/// count (where there are panels enough), their sizes differing by one panel at most, so that
/// no thread is left with an item more or a larger one. Against 5 to 8 panels an item before,
/// measured on 1024 rows x 2 threads (same process, alternated): the MLP's down-projection
/// weight gradient (512 rows, `B` 8 MB) 192-208 → 230-259 GFLOP/s, the vocabulary
/// product's input gradient (`B` 16 MB) 219-237 → 236-256, the rest level or a few percent
/// faster.
pub(super) fn item_panels(m: usize, units: usize, a_packed: bool, threads: usize) -> Vec<usize> {
    let threads = threads.max(1);
    let panels = m.div_ceil(MR);
    let max_panels = if a_packed {
        (A_ITEM_BYTES / (4 * MR * units.max(1))).max(1)
    } else {
        panels.max(1)
    };
    let items = (2 * threads)
        .max(panels.div_ceil(max_panels))
        .next_multiple_of(threads)
        .min(panels)
        .max(1);
    (0..=items).map(|i| i * panels / items).collect()
}

/// Mutex slots handing out disjoint chunks of `data` to work items.
pub(crate) fn slots<T>(data: &mut [T], chunk: usize) -> Vec<Mutex<Option<&mut [T]>>> {
    data.chunks_mut(chunk.max(1))
        .map(|c| Mutex::new(Some(c)))
        .collect()
}

/// Mutex slots handing out the chunks of `data` from `starts[i] * unit` to `starts[i + 1] *
/// unit` (the last ending at the end of `data`) to work items.
pub(super) fn slots_at<'a, T>(
    data: &'a mut [T],
    starts: &[usize],
    unit: usize,
) -> Vec<Mutex<Option<&'a mut [T]>>> {
    let mut rest = data;
    let mut out = Vec::with_capacity(starts.len().saturating_sub(1));
    for w in starts.windows(2) {
        let len = ((w[1] - w[0]) * unit).min(rest.len());
        let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(len);
        out.push(Mutex::new(Some(chunk)));
        rest = tail;
    }
    out
}

/// The chunk of a slot, once.
pub(crate) fn take<'a, T>(slot: &Mutex<Option<&'a mut [T]>>) -> Option<&'a mut [T]> {
    slot.lock().ok().and_then(|mut g| g.take())
}

/// The threads candle's worker pool runs an op on: its workers and the calling thread.
/// (`candle_core::utils::get_num_threads` parses `/proc/cpuinfo` on every call, which showed
/// in profiles when asked once per product.)
pub(crate) fn pool_threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

/// Runs `f(i, chunk)` once for every slot's chunk (slots from [`slots`]), on candle's worker
/// pool when the work is large; a chunk no worker took (none, unless the pool failed) runs
/// here afterwards, so every chunk has run when this returns.
pub(crate) fn for_each_slot<T: Send>(
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
pub(crate) fn run_items(n: usize, work_per_item: usize, f: impl Fn(usize) + Sync) {
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
