//! The plan of a batch of block copies (a swap, a spill): which destination block each
//! source block gets, and the runs of consecutive blocks that one copy each moves.
//!
//! Sources sorted ascending get the destinations sorted ascending, so wherever both sides are
//! consecutive (a request admitted into a fresh pool, a tier that was emptied) many blocks
//! move in one copy. Nothing here touches memory: the engines do.

/// One copy: `num_blocks` blocks from block `src` of the source pool onwards to block `dst`
/// of the destination pool onwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub src: u32,
    pub dst: u32,
    pub num_blocks: u32,
}

/// The destination of each source (in the order of `sources`): the k-th smallest source gets
/// the k-th smallest destination. `dests` holds exactly one id per source.
pub fn assign(sources: &[u32], mut dests: Vec<u32>) -> Vec<u32> {
    debug_assert_eq!(sources.len(), dests.len());
    let mut order: Vec<usize> = (0..sources.len()).collect();
    order.sort_unstable_by_key(|&i| sources[i]);
    dests.sort_unstable();
    let mut out = vec![0u32; sources.len()];
    for (&i, &dst) in order.iter().zip(&dests) {
        out[i] = dst;
    }
    out
}

/// The pairs `(sources[i], dests[i])` as runs: sorted by source, a pair extends the current
/// run when both its source and its destination follow the run's last ones.
pub fn runs(sources: &[u32], dests: &[u32]) -> Vec<Run> {
    let mut pairs: Vec<(u32, u32)> = sources.iter().copied().zip(dests.iter().copied()).collect();
    pairs.sort_unstable();
    let mut out: Vec<Run> = Vec::new();
    for (src, dst) in pairs {
        match out.last_mut() {
            Some(r) if r.src + r.num_blocks == src && r.dst + r.num_blocks == dst => {
                r.num_blocks += 1
            }
            _ => out.push(Run { src, dst, num_blocks: 1 }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_assignment_coalesces_consecutive_blocks() {
        // A request whose blocks are 7, 5, 6 (in logical order) gets host blocks 10..13 so that
        // device 5,6,7 -> host 10,11,12: one copy.
        let dests = assign(&[7, 5, 6], vec![12, 10, 11]);
        assert_eq!(dests, vec![12, 10, 11]);
        assert_eq!(runs(&[7, 5, 6], &dests), vec![Run { src: 5, dst: 10, num_blocks: 3 }]);
    }

    #[test]
    fn gaps_on_either_side_split_runs() {
        let sources = [0, 1, 2, 4, 5];
        let dests = assign(&sources, vec![3, 4, 8, 9, 10]);
        assert_eq!(
            runs(&sources, &dests),
            vec![
                Run { src: 0, dst: 3, num_blocks: 2 },
                Run { src: 2, dst: 8, num_blocks: 1 },
                Run { src: 4, dst: 9, num_blocks: 2 },
            ]
        );
        assert!(runs(&[], &[]).is_empty());
    }

    #[test]
    fn a_shared_source_is_copied_once_per_holder() {
        // Two requests of one swap sharing block 3 (a fork): it is copied to two destinations.
        let sources = [3, 3];
        let dests = assign(&sources, vec![0, 1]);
        let total: u32 = runs(&sources, &dests).iter().map(|r| r.num_blocks).sum();
        assert_eq!(total, 2);
    }
}
