//! Splitting one model over the ranks of an MLX distributed group.
//!
//! **Expert parallel** (always on with more than one rank): every MoE layer's routed experts are divided
//! into contiguous ranges, one per rank, and each rank loads only its range; the shared experts are split
//! along their intermediate dimension (gate/up rows, down columns). Each rank computes the routed partial
//! sum of the tokens' experts it holds plus its shared-expert partial sum, and one all_sum per MoE layer
//! (the two partial sums concatenated) combines them.
//!
//! **Tensor parallel** (`tp`): KDA and MLA heads are divided among the ranks (their projections' rows,
//! o_proj's columns), and the dense MLP layers are split like the shared experts; each such block ends in an
//! all_sum of partial sums accumulated in f32.
//!
//! Everything else (embeddings, head, norms, routers, latent projections, attention residuals) is
//! replicated, so every rank ends each layer with the same hidden state and the same logits.

use std::ops::Range;
use std::sync::Arc;

use crate::distributed::Group;
use crate::{Array, Dtype, Error, Result};

/// Which rank this process is and how the model is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Tensor-parallel attention and dense layers.
    pub tp: bool,
}

impl Shard {
    /// A shard description; `rank < size`.
    pub fn new(rank: usize, size: usize, tp: bool) -> Result<Shard> {
        if size == 0 || rank >= size {
            return Err(Error::invalid("shard", format!("rank {rank} is not in 0..{size}")));
        }
        Ok(Shard { rank, size, tp })
    }

    /// This rank's contiguous range of `n` items split as evenly as possible (the first `n % size` ranks
    /// get one more).
    pub fn range_of(&self, n: usize) -> Range<usize> {
        split_range(n, self.rank, self.size)
    }

    /// This rank's range of `n` items that must split evenly (heads, intermediate units); the error says
    /// what did not divide.
    pub fn even_range(&self, n: usize, what: &str) -> Result<Range<usize>> {
        if n % self.size != 0 {
            return Err(Error::invalid(
                "shard",
                format!("{what}: {n} do not divide among {} ranks; use a rank count that divides it", self.size),
            ));
        }
        let k = n / self.size;
        Ok(self.rank * k..(self.rank + 1) * k)
    }
}

/// Range `rank` of `n` items over `size` parts, the first `n % size` parts one longer.
pub fn split_range(n: usize, rank: usize, size: usize) -> Range<usize> {
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The part of a weight a rank keeps, in the coordinates of the unquantized weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// All of it.
    Whole,
    /// These ranges along axis 0 (output features, heads or experts), concatenated in order.
    Rows(Vec<Range<usize>>),
    /// This range along the last axis (input features).
    Cols(Range<usize>),
}

impl Part {
    /// One row range.
    pub fn rows(r: Range<usize>) -> Part {
        Part::Rows(vec![r])
    }

    /// Rows `r` of each of `blocks` consecutive blocks of `block` rows (a fused q/k/v projection).
    pub fn rows_in_blocks(r: Range<usize>, block: usize, blocks: usize) -> Part {
        Part::Rows((0..blocks).map(|b| b * block + r.start..b * block + r.end).collect())
    }

    /// Number of axis-0 rows (or last-axis columns) kept out of `n`.
    pub fn kept(&self, n: usize) -> usize {
        match self {
            Part::Whole => n,
            Part::Rows(rs) => rs.iter().map(|r| r.len()).sum(),
            Part::Cols(r) => r.len(),
        }
    }

    /// The unquantized shape this part has, for a weight of `full` shape.
    pub fn shape(&self, full: &[i32]) -> Vec<i32> {
        let mut s = full.to_vec();
        match self {
            Part::Whole => {}
            Part::Rows(_) => s[0] = self.kept(full[0] as usize) as i32,
            Part::Cols(r) => {
                let n = s.len() - 1;
                s[n] = r.len() as i32;
            }
        }
        s
    }
}

/// The collective a sharded model runs its all_sums through.
pub struct Comm {
    group: Group,
    shard: Shard,
}

// SAFETY: MLX's distributed group is used by one model at a time (the engine thread, or the caller); the
// handle itself is a shared_ptr to an immutable communicator.
unsafe impl Send for Comm {}
// SAFETY: see above; collectives are only built (not run) through `&Comm`, and evaluation happens on the
// model's thread.
unsafe impl Sync for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {}/{}, tp {})", self.shard.rank, self.shard.size, self.shard.tp)
    }
}

impl Comm {
    /// Wraps `group`; its rank and size must match `shard`'s.
    pub fn new(group: Group, tp: bool) -> Result<Arc<Comm>> {
        let shard = Shard::new(group.rank() as usize, group.size() as usize, tp)?;
        Ok(Arc::new(Comm { group, shard }))
    }

    /// The split.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// The group.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Rank 0's `data` on every rank (the others pass `None`): its length, then its bytes, each as one
    /// all_sum in which the other ranks add zeros (MLX's collectives have no broadcast). Blocks until rank 0
    /// sends.
    pub fn broadcast_bytes(&self, data: Option<&[u8]>) -> Result<Vec<u8>> {
        let mine = if self.shard.rank == 0 {
            data.ok_or_else(|| Error::invalid("distributed", "rank 0 must give the bytes it broadcasts"))?
        } else {
            &[]
        };
        let len = i32::try_from(mine.len())
            .map_err(|_| Error::invalid("distributed", format!("{} bytes are too many to broadcast", mine.len())))?;
        let n = self.group.all_sum(&Array::from_slice(&[len], &[1])?)?.to_vec::<i32>()?[0];
        if n < 0 {
            return Err(Error::invalid("distributed", format!("a broadcast announced {n} bytes")));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let words: Vec<i32> =
            if self.shard.rank == 0 { mine.iter().map(|&b| b as i32).collect() } else { vec![0; n as usize] };
        let got = self.group.all_sum(&Array::from_slice(&words, &[n])?)?.to_vec::<i32>()?;
        got.into_iter()
            .map(|v| {
                u8::try_from(v).map_err(|_| Error::invalid("distributed", format!("a broadcast byte summed to {v}")))
            })
            .collect()
    }

    /// Sum over ranks, accumulated in f32 whatever `x`'s dtype, returned in `x`'s dtype.
    pub fn all_sum_f32(&self, x: &Array) -> Result<Array> {
        let dt = x.dtype();
        let y = self.group.all_sum(&if dt == Dtype::F32 { x.clone() } else { x.astype(Dtype::F32)? })?;
        if dt == Dtype::F32 {
            Ok(y)
        } else {
            y.astype(dt)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_everything_once() {
        for n in [0usize, 1, 7, 16, 896] {
            for size in 1..=5 {
                let mut next = 0;
                for rank in 0..size {
                    let r = split_range(n, rank, size);
                    assert_eq!(r.start, next);
                    assert!(r.len() == n / size || r.len() == n / size + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn uneven_head_split_is_an_error_naming_the_count() {
        let s = Shard::new(1, 3, true).unwrap();
        let e = s.even_range(8, "KDA heads").unwrap_err().to_string();
        assert!(e.contains("KDA heads") && e.contains("8") && e.contains("3 ranks"), "{e}");
        assert_eq!(s.even_range(9, "x").unwrap(), 3..6);
    }

    #[test]
    fn parts_shape() {
        assert_eq!(Part::rows_in_blocks(2..4, 8, 3), Part::Rows(vec![2..4, 10..12, 18..20]));
        assert_eq!(Part::rows_in_blocks(2..4, 8, 3).shape(&[24, 5]), vec![6, 5]);
        assert_eq!(Part::Cols(4..8).shape(&[3, 16]), vec![3, 4]);
    }
}
