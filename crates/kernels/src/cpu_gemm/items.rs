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
