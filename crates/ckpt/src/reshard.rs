//! Loading a checkpoint into another layout: each rank asks for the slice of each global
//! tensor it needs ([`Want`]) and gets it assembled from whichever saved shards overlap it,
//! flat (ZeRO) and dim-sliced (tensor parallel) alike.

use crate::error::{CkptError, Result};
use crate::layout::Layout;
use crate::load::{read_rank_file, VerifiedFile};
use crate::manifest::Manifest;
use crate::state::RankState;
use crate::storage::Storage;
use kiln_state::Shard;
use kiln_state::StateDict;
use kiln_state::{numel, DType, Stateful, TensorData, Want};
use std::collections::BTreeMap;

/// What each rank of the new layout wants from a checkpoint.
///
/// Rules apply by precedence: a tensor's own rule, then its part's, then the default; a
/// tensor no rule covers is not loaded. Part metadata (and tensors saved whole on one rank)
/// come from rank `meta_rank` of the saved run (default 0): replicated state such as the
/// loss scale or the schedule position is the same on every rank; rank-local state (data
/// loader positions, per-rank RNG streams) cannot be resharded generically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReshardRequest {
    /// The layout of the run loading the checkpoint.
    pub layout: Layout,
    tensors: BTreeMap<String, Want>,
    parts: BTreeMap<String, Want>,
    default: Option<Want>,
    meta_rank: usize,
}

impl ReshardRequest {
    /// An empty request for a run with `layout`.
    pub fn new(layout: Layout) -> Self {
        ReshardRequest {
            layout,
            tensors: BTreeMap::new(),
            parts: BTreeMap::new(),
            default: None,
            meta_rank: 0,
        }
    }

    /// Asks for `want` of tensor `full_name` (`<part>/<name>`); the tensor must exist.
    pub fn tensor(mut self, full_name: &str, want: Want) -> Self {
        self.tensors.insert(full_name.to_string(), want);
        self
    }

    /// Asks for what `component` needs of its part `part`: each tensor its
    /// [`Stateful::state_wants`] names, or, when it names none, every tensor of the part whole.
    pub fn component(self, part: &str, component: &dyn Stateful) -> Self {
        match component.state_wants() {
            Some(wants) => wants.into_iter().fold(self, |r, (name, want)| {
                r.tensor(&format!("{part}/{name}"), want)
            }),
            None => self.part(part, Want::Full),
        }
    }

    /// Asks for `want` of every tensor of part `part`.
    pub fn part(mut self, part: &str, want: Want) -> Self {
        self.parts.insert(part.to_string(), want);
        self
    }

    /// Asks for `want` of every tensor no other rule covers.
    pub fn otherwise(mut self, want: Want) -> Self {
        self.default = Some(want);
        self
    }

    /// Takes part metadata from rank `rank` of the saved run.
    pub fn meta_from_rank(mut self, rank: usize) -> Self {
        self.meta_rank = rank;
        self
    }

    fn rule(&self, full: &str) -> Option<&Want> {
        if let Some(w) = self.tensors.get(full) {
            return Some(w);
        }
        let part = full.split_once('/').map_or(full, |(p, _)| p);
        self.parts.get(part).or(self.default.as_ref())
    }
}

/// A tensor of a checkpoint as a whole: its dtype, global shape and who holds what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalTensor {
    /// Element type.
    pub dtype: DType,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// `(rank, shard)` for every saved piece (`None`: the rank saved it whole).
    pub pieces: Vec<(usize, Option<Shard>)>,
}

impl Manifest {
    /// Every tensor name in any rank file.
    pub fn tensor_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .files
            .iter()
            .flat_map(|f| f.tensors.keys().cloned())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// The global view of tensor `name`, checking that every rank's piece agrees on dtype
    /// and global shape; `None` if no rank saved it.
    pub fn global_tensor(&self, name: &str) -> Result<Option<GlobalTensor>> {
        let mut out: Option<GlobalTensor> = None;
        for f in &self.files {
            let Some(t) = f.tensors.get(name) else {
                continue;
            };
            let global = t
                .shard
                .as_ref()
                .map_or_else(|| t.shape.clone(), |s| s.global_shape().to_vec());
            match &mut out {
                None => {
                    out = Some(GlobalTensor {
                        dtype: t.dtype,
                        global_shape: global,
                        pieces: vec![(f.rank, t.shard.clone())],
                    })
                }
                Some(g) => {
                    if g.dtype != t.dtype || g.global_shape != global {
                        let (r0, _) = g.pieces[0];
                        return Err(CkptError::Reshard {
                            name: name.to_string(),
                            reason: format!(
                                "rank {r0} saved {} {:?} but rank {} saved {} {:?}",
                                g.dtype, g.global_shape, f.rank, t.dtype, global
                            ),
                        });
                    }
                    g.pieces.push((f.rank, t.shard.clone()));
                }
            }
        }
        Ok(out)
    }
}

/// Element runs `(global start, len)` of a region (`None`: the whole tensor of `n`).
fn region_runs(region: Option<&Shard>, n: usize) -> Vec<(usize, usize)> {
    match region {
        Some(s) => s.runs(),
        None if n == 0 => Vec::new(),
        None => vec![(0, n)],
    }
}

/// The copies `(src element offset, dst element offset, len)` that move the overlap of two
/// sorted, disjoint run lists from the source's local layout to the destination's.
pub(crate) fn overlaps(
    dst: &[(usize, usize)],
    src: &[(usize, usize)],
) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    let (mut dst_local, mut src_local) = (0usize, 0usize);
    while i < dst.len() && j < src.len() {
        let (ds, dl) = dst[i];
        let (ss, sl) = src[j];
        let lo = ds.max(ss);
        let hi = (ds + dl).min(ss + sl);
        if lo < hi {
            out.push((src_local + (lo - ss), dst_local + (lo - ds), hi - lo));
        }
        if ds + dl <= ss + sl {
            dst_local += dl;
            i += 1;
        } else {
            src_local += sl;
            j += 1;
        }
    }
    out
}

/// Verified rank files, read on first use.
struct Files<'a> {
    storage: &'a dyn Storage,
    manifest: &'a Manifest,
    dir: &'a str,
    loaded: BTreeMap<usize, VerifiedFile>,
}

impl Files<'_> {
    fn get(&mut self, rank: usize) -> Result<&VerifiedFile> {
        let missing = || CkptError::Manifest {
            path: self.dir.to_string(),
            reason: format!("no file for rank {rank}"),
        };
        if !self.loaded.contains_key(&rank) {
            let entry = self.manifest.file(rank).ok_or_else(missing)?;
            let file = read_rank_file(self.storage, self.dir, entry)?;
            self.loaded.insert(rank, file);
        }
        self.loaded.get(&rank).ok_or_else(missing)
    }
}

/// Assembles the requested slice of one tensor.
fn assemble(
    name: &str,
    g: &GlobalTensor,
    region: Option<&Shard>,
    files: &mut Files<'_>,
) -> Result<TensorData> {
    let total_global = numel(&g.global_shape).ok_or_else(|| CkptError::Reshard {
        name: name.to_string(),
        reason: format!("global shape {:?} overflows", g.global_shape),
    })?;
    let dst = region_runs(region, total_global);
    let want_elems: usize = dst.iter().map(|r| r.1).sum();
    let esize = g.dtype.size_in_bytes();
    let mut out = vec![0u8; want_elems * esize];
    let mut covered: Vec<(usize, usize)> = Vec::new();
    // Identical pieces (replicas) are read once, from the lowest rank.
    let mut seen: Vec<&Option<Shard>> = Vec::new();
    for (rank, shard) in &g.pieces {
        if seen.contains(&shard) {
            continue;
        }
        seen.push(shard);
        let src = region_runs(shard.as_ref(), total_global);
        let copies = overlaps(&dst, &src);
        if copies.is_empty() {
            continue;
        }
        let data = files
            .get(*rank)?
            .tensors
            .get(name)
            .ok_or_else(|| kiln_state::StateError::MissingTensor {
                name: name.to_string(),
            })?
            .bytes();
        for (s, d, l) in copies {
            let (s, d, l) = (s * esize, d * esize, l * esize);
            let (Some(from), Some(to)) = (data.get(s..s + l), out.get_mut(d..d + l)) else {
                return Err(CkptError::Reshard {
                    name: name.to_string(),
                    reason: format!("rank {rank}'s piece is shorter than its shard says"),
                });
            };
            to.copy_from_slice(from);
            covered.push((d / esize, l / esize));
        }
    }
    covered.sort_unstable();
    let mut next = 0usize;
    for (s, l) in covered {
        if s > next {
            break;
        }
        next = next.max(s + l);
    }
    if next < want_elems {
        return Err(CkptError::Reshard {
            name: name.to_string(),
            reason: format!(
                "elements from {next} of the {want_elems} requested are held by no rank"
            ),
        });
    }
    let shape = region.map_or_else(|| g.global_shape.clone(), Shard::local_shape);
    Ok(TensorData::new(g.dtype, shape, out).map_err(|e| e.named(name))?)
}

/// One rank's resharded load of the checkpoint in directory `dir` whose verified manifest is
/// `manifest`.
pub(crate) fn load_resharded_local(
    storage: &dyn Storage,
    manifest: &Manifest,
    dir: &str,
    req: &ReshardRequest,
) -> Result<RankState> {
    if req.meta_rank >= manifest.files.len() {
        return Err(CkptError::Config(format!(
            "metadata rank {} but the checkpoint has {} ranks",
            req.meta_rank,
            manifest.files.len()
        )));
    }
    for name in req.tensors.keys() {
        if !manifest.files.iter().any(|f| f.tensors.contains_key(name)) {
            return Err(kiln_state::StateError::MissingTensor { name: name.clone() }.into());
        }
    }
    let mut files = Files {
        storage,
        manifest,
        dir,
        loaded: BTreeMap::new(),
    };
    let mut parts: BTreeMap<String, StateDict> = BTreeMap::new();
    for (part, meta) in &files.get(req.meta_rank)?.meta {
        let mut sd = StateDict::new();
        *sd.meta_map_mut() = meta.clone();
        parts.insert(part.clone(), sd);
    }
    for name in manifest.tensor_names() {
        let Some(want) = req.rule(&name) else {
            continue;
        };
        let Some(g) = manifest.global_tensor(&name)? else {
            continue;
        };
        let region = want.resolve(&name, &g.global_shape)?;
        let t = assemble(&name, &g, region.as_ref(), &mut files)?;
        let (part, tname) = name.split_once('/').unwrap_or(("", &name));
        let sd = parts.entry(part.to_string()).or_default();
        match region {
            Some(s) => sd.insert_sharded(tname, t, s)?,
            None => sd.insert(tname, t)?,
        }
    }
    let mut state = RankState::new();
    for (part, sd) in parts {
        state.insert(&part, sd)?;
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: the global flat indices of a region, in the region's row-major order.
    fn indices(global: &[usize], region: Option<&Shard>) -> Vec<usize> {
        let n: usize = global.iter().product();
        match region {
            None => (0..n).collect(),
            Some(Shard::Flat(f)) => (f.start..f.start + f.len).collect(),
            Some(Shard::Dim(s)) => (0..n)
                .filter(|&flat| {
                    let inner: usize = global[s.dim + 1..].iter().product();
                    let i = (flat / inner) % global[s.dim];
                    i >= s.start && i < s.start + s.len
                })
                .collect(),
        }
    }

    /// Tiny deterministic generator for the randomized cases.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((self.0 >> 33) % n.max(1) as u64) as usize
        }
    }

    fn random_region(rng: &mut Lcg, g: &[usize]) -> Option<Shard> {
        let n: usize = g.iter().product();
        match rng.next(3) {
            0 => None,
            1 => {
                let start = rng.next(n + 1);
                let len = rng.next(n - start + 1);
                Some(Shard::flat(g, start, len))
            }
            _ => {
                let dim = rng.next(g.len());
                let start = rng.next(g[dim] + 1);
                let len = rng.next(g[dim] - start + 1);
                Some(Shard::dim(g, dim, start, len))
            }
        }
    }

    /// Randomized: save-side pieces (a random flat or dim partition) and a random request;
    /// the overlap copies must reproduce the reference gather element for element.
    #[test]
    fn overlap_copies_match_index_enumeration() {
        let mut rng = Lcg(7);
        for _case in 0..2000 {
            let nd = 1 + rng.next(3);
            let g: Vec<usize> = (0..nd).map(|_| 1 + rng.next(5)).collect();
            let n: usize = g.iter().product();
            // global tensor values = their flat index
            let parts = 1 + rng.next(4);
            let pieces: Vec<Shard> = if rng.next(2) == 0 {
                (0..parts)
                    .map(|p| Shard::flat_chunk(&g, parts, p).unwrap())
                    .collect()
            } else {
                let dim = rng.next(nd);
                (0..parts)
                    .map(|p| {
                        let r = kiln_comm::chunk_range(g[dim], parts, p);
                        Shard::dim(&g, dim, r.start, r.len())
                    })
                    .collect()
            };
            let region = random_region(&mut rng, &g);
            let dst = region_runs(region.as_ref(), n);
            let want = indices(&g, region.as_ref());
            let mut out = vec![usize::MAX; want.len()];
            for p in &pieces {
                let local = indices(&g, Some(p));
                for (s, d, l) in overlaps(&dst, &region_runs(Some(p), n)) {
                    out[d..d + l].copy_from_slice(&local[s..s + l]);
                }
            }
            assert_eq!(out, want, "g {g:?} region {region:?} pieces {pieces:?}");
        }
    }
}
