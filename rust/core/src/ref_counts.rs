//! `RefCounts`: one reference count per block, four 16-bit counts packed in each 64-bit
//! word, so that a batch of neighbouring ids is checked and changed with one atomic
//! read-modify-write per word instead of one per id (design: `free_list.md`, "Per-block
//! reference counts").
//!
//! A count of 0 means free. Every change of a count is an RMW of its whole word (other
//! threads own the other lanes), except one: when `set_first` hands out all four blocks of a
//! word at once, no other thread may write any of its lanes, and a plain store does.

use smallvec::SmallVec;

use crate::error::CoreError;
use crate::sync::{AtomicU64, Ordering};

/// The most references one block can hold (its lane is 16 bits wide).
pub const MAX_REF_CNT: u32 = u16::MAX as u32;
/// The most references a share (a fork) raises a count to. Only the prefix cache, under its
/// lock and after checking the count is below [`MAX_REF_CNT`], adds the last one, so no
/// lane ever overflows into its neighbour.
pub(crate) const MAX_SHARED: u32 = MAX_REF_CNT - 1;

const LANES: usize = 4;
const LANE_BITS: u32 = 16;
/// A 1 in every lane.
const ONES: u64 = 0x0001_0001_0001_0001;
/// The top bit of every lane.
const HIGH: u64 = 0x8000_8000_8000_8000;
/// Batches up to this many ids (or runs of ids sharing a word) are handled without the heap.
pub(crate) const INLINE_IDS: usize = 32;

pub(crate) struct RefCounts {
    words: Box<[AtomicU64]>,
    len: usize,
}

/// The longest stretch of ids next to each other in a batch that share a word: bit `k` of
/// `lanes` is set if one of them is in lane `k`, and of `zeroed`, once the run is committed,
/// if the run took that lane's count to 0. Eight bytes, because a batch keeps up to
/// [`INLINE_IDS`] of them on the stack; which ids a run holds follows from the order (the
/// next ones of the batch while their word is the run's).
#[derive(Clone, Copy)]
struct Run {
    word: u32,
    lanes: u8,
    zeroed: u8,
}

impl Run {
    const EMPTY: Run = Run { word: 0, lanes: 0, zeroed: 0 };

    fn units(&self) -> u64 {
        spread(self.lanes)
    }
}

/// Room for the runs of a batch: on the stack up to [`INLINE_IDS`] ids, else on the heap.
/// (A batch has at most one run per id, so the room is known before splitting.) The inline
/// variant's size is the point: it lives on the caller's stack for one call, so a batch of up
/// to `INLINE_IDS` ids allocates nothing.
#[allow(clippy::large_enum_variant)]
enum RunsRoom {
    Inline([Run; INLINE_IDS]),
    Heap(Vec<Run>),
}

impl RunsRoom {
    fn for_batch(ids: &[u32]) -> Self {
        if ids.len() <= INLINE_IDS {
            RunsRoom::Inline([Run::EMPTY; INLINE_IDS])
        } else {
            RunsRoom::Heap(vec![Run::EMPTY; ids.len()])
        }
    }
    fn slots(&mut self) -> &mut [Run] {
        match self {
            RunsRoom::Inline(runs) => runs,
            RunsRoom::Heap(runs) => runs,
        }
    }
}

impl RefCounts {
    /// `len` counts, all 0, lazily committed (`zeroed.rs`).
    pub(crate) fn new(len: usize) -> Result<Self, CoreError> {
        Ok(RefCounts { words: crate::zeroed::zeroed_atomic_u64s(len.div_ceil(LANES))?, len })
    }

    /// How many counts there are (the allocator's capacity).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn get(&self, id: u32) -> u32 {
        lane_value(self.word(id).load(Ordering::Acquire), id)
    }

    fn word(&self, id: u32) -> &AtomicU64 {
        &self.words[id as usize / LANES]
    }

    /// Count 0 -> 1 for ids just taken off the free list (ours alone, distinct). Runs of
    /// ids sharing a word are one RMW; a run covering a whole word is one plain store,
    /// because nobody else may write a lane of a block that is free or ours: every other
    /// writer either took that block off the free list itself or needs a non-zero count.
    pub(crate) fn set_first(&self, ids: &[u32]) {
        let mut run: Option<(usize, u64)> = None;
        for &id in ids {
            let word = id as usize / LANES;
            match &mut run {
                Some((w, units)) if *w == word => *units += unit(id),
                _ => {
                    if let Some((w, units)) = run {
                        self.set_first_in_word(w, units);
                    }
                    run = Some((word, unit(id)));
                }
            }
        }
        if let Some((w, units)) = run {
            self.set_first_in_word(w, units);
        }
    }

    fn set_first_in_word(&self, word: usize, units: u64) {
        let word = &self.words[word];
        if units == ONES {
            debug_assert_eq!(
                word.load(Ordering::Relaxed),
                0,
                "a block was on the free list in use"
            );
            word.store(ONES, Ordering::Release);
        } else {
            let _old = word.fetch_add(units, Ordering::Release);
            debug_assert_eq!(
                nonzero_lanes(_old) & lanes_high(units),
                0,
                "a block was on the free list in use"
            );
        }
    }

    /// Count -> 0 for blocks nobody references any more but someone held off the free list
    /// (the prefix cache's evictable blocks).
    pub(crate) fn clear(&self, id: u32) {
        self.word(id).fetch_and(!(u64::from(u16::MAX) << shift(id)), Ordering::Release);
    }

    /// Adds a reference to a block that has one and cannot lose its last meanwhile (the
    /// prefix cache, under its lock, having checked the count is below [`MAX_REF_CNT`]).
    pub(crate) fn add_held(&self, id: u32) {
        let _old = self.word(id).fetch_add(unit(id), Ordering::AcqRel);
        debug_assert!(
            lane_value(_old, id) < MAX_REF_CNT,
            "block {id} would exceed {MAX_REF_CNT} references"
        );
    }

    /// Adds a reference unless the block has none (freed meanwhile: `Err(0)`) or already has
    /// [`MAX_SHARED`] (`Err(count)`); returns the new count.
    pub(crate) fn share(&self, id: u32) -> Result<u32, u32> {
        let old = self.word(id).fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            let count = lane_value(w, id);
            (count != 0 && count < MAX_SHARED).then(|| w + unit(id))
        });
        old.map(|w| lane_value(w, id) + 1).map_err(|w| lane_value(w, id))
    }

    /// Drops one reference unless there is none; returns the count left.
    pub(crate) fn drop_one(&self, id: u32) -> Option<u32> {
        self.word(id)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (lane_value(w, id) != 0).then(|| w - unit(id))
            })
            .ok()
            .map(|w| lane_value(w, id) - 1)
    }

    /// Range and repeat checks of a batch (ids `>= num_blocks`, an id twice), before anything
    /// changes.
    pub(crate) fn check_batch(&self, ids: &[u32], num_blocks: usize) -> Result<(), CoreError> {
        split_into_runs(ids, num_blocks, RunsRoom::for_batch(ids).slots()).map(drop)
    }

    /// Drops one reference to each of `ids` (distinct, each referenced, all `< num_blocks`,
    /// or nothing changes) and returns those whose count reached 0, in the order of `ids`:
    /// `ids` itself when that is all of them (the common case, nothing copied), else the
    /// ones it put in `released`. One RMW per run of ids sharing a word.
    ///
    /// Checked before any write: range, repeats (a repeat within a run shows as a lane set
    /// twice; across runs, as two runs of one word with a lane in common), and a load of every
    /// word (a count of 0 is a double free). The commit then re-checks each word in its RMW:
    /// a racing free of one of our references (caller misuse) can still take a count to 0
    /// between the two passes, and then the runs already committed are undone.
    pub(crate) fn release_many<'a>(
        &self,
        ids: &'a [u32],
        num_blocks: usize,
        released: &'a mut SmallVec<[u32; INLINE_IDS]>,
    ) -> Result<&'a [u32], CoreError> {
        let mut room = RunsRoom::for_batch(ids);
        let runs = split_into_runs(ids, num_blocks, room.slots())?;
        if runs.iter().any(|run| {
            !all_referenced(self.words[run.word as usize].load(Ordering::Acquire), run.units())
        }) {
            return Err(self.first_unreferenced(ids));
        }
        let mut all_zeroed = true;
        for done in 0..runs.len() {
            let run = &runs[done];
            let units = run.units();
            let word = &self.words[run.word as usize];
            match word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                all_referenced(w, units).then(|| w - units)
            }) {
                Ok(old) => {
                    let zeroed = run.lanes & !gather(nonzero_lanes(old - units));
                    all_zeroed &= zeroed == run.lanes;
                    runs[done].zeroed = zeroed;
                }
                Err(w) => {
                    // The id of the first lane that the racing call took to 0.
                    let (word, gone) = (run.word, run.lanes & !gather(nonzero_lanes(w)));
                    let culprit = ids
                        .iter()
                        .copied()
                        .find(|&id| id / LANES as u32 == word && gone & lane_bit(id) != 0);
                    let culprit = CoreError::DoubleFree { block_id: culprit.unwrap_or(ids[0]) };
                    runs[..done].iter().for_each(|run| self.undo(run));
                    return Err(culprit);
                }
            }
        }
        if all_zeroed {
            return Ok(ids);
        }
        let mut run = runs.iter();
        let mut current = run.next();
        for &id in ids {
            let in_current = current.filter(|r| r.word == id / LANES as u32);
            let Some(r) = in_current.or_else(|| run.next()) else { break };
            current = Some(r);
            if r.zeroed & lane_bit(id) != 0 {
                released.push(id);
            }
        }
        Ok(released)
    }

    /// Gives back the references a committed run dropped. The counts it took to 0 are ours
    /// alone (not yet on the free list): +1. A count it lowered to 1 or more may have been
    /// taken to 0 by another holder and pushed since (racing misuse): such a block must not
    /// regain a count while on the free list, so only counts still above 0 (and below
    /// [`MAX_SHARED`]) are raised; otherwise our reference stays dropped.
    fn undo(&self, run: &Run) {
        let lowered = run.lanes & !run.zeroed;
        let _ =
            self.words[run.word as usize].fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                let raisable = lowered & gather(nonzero_lanes(w)) & !gather(at_least_shared_max(w));
                Some(w + spread(run.zeroed | raisable))
            });
    }

    /// The first id of `ids` whose count is 0, as a double free (the error path only).
    fn first_unreferenced(&self, ids: &[u32]) -> CoreError {
        let id = ids.iter().copied().find(|&id| self.get(id) == 0);
        // Every caller saw a zero count among `ids`; a racing caller may have raised it since.
        CoreError::DoubleFree { block_id: id.unwrap_or(ids[0]) }
    }
}

/// Splits a batch into runs of neighbours sharing a word; rejects ids `>= num_blocks` (the
/// first one) and ids repeated (the first one seen a second time, in the order of `ids`).
fn split_into_runs<'a>(
    ids: &[u32],
    num_blocks: usize,
    room: &'a mut [Run],
) -> Result<&'a mut [Run], CoreError> {
    // The largest id first (a loop without early exit, which vectorises), then the first
    // culprit only on the error path.
    if ids.iter().copied().max().is_some_and(|max| max as usize >= num_blocks) {
        let id = ids.iter().copied().find(|&id| id as usize >= num_blocks).unwrap_or_default();
        return Err(CoreError::out_of_range_id(id, num_blocks));
    }
    let Some(&first) = ids.first() else { return Ok(&mut room[..0]) };
    // The run being built stays in plain locals (registers); it is stored once it ends.
    // Ids are below 2^31 (`MAX_NUM_BLOCKS`), so words fit in 32 bits.
    let (mut word, mut lanes, mut repeated, mut n) =
        (first / LANES as u32, lane_bit(first), 0u8, 0);
    for &id in &ids[1..] {
        if id / LANES as u32 == word {
            repeated |= lanes & lane_bit(id);
            lanes |= lane_bit(id);
        } else {
            room[n] = Run { word, lanes, zeroed: 0 };
            n += 1;
            (word, lanes) = (id / LANES as u32, lane_bit(id));
        }
    }
    room[n] = Run { word, lanes, zeroed: 0 };
    let runs = &mut room[..n + 1];
    if repeated != 0 || runs_overlap(runs, ids) {
        return Err(CoreError::InvalidBlock {
            value: first_repeated(ids).to_string(),
            reason: "repeated in one call".into(),
        });
    }
    Ok(runs)
}

/// Whether two runs of one word share a lane (the same id twice). Up to [`INLINE_IDS`]
/// runs: a 64-bit filter of the words seen (`word % 64`) lets only a run whose word may
/// have been seen search the earlier runs, so neighbours (consecutive words) and most
/// scattered batches cost one pass; words that collide in the filter cost a pairwise
/// search, no worse than comparing every pair. More runs: a sorted copy of the ids.
fn runs_overlap(runs: &[Run], ids: &[u32]) -> bool {
    if runs.len() <= INLINE_IDS {
        let mut seen = 0u64;
        runs.iter().enumerate().any(|(i, b)| {
            let bit = 1u64 << (b.word % 64);
            let maybe_seen = seen & bit != 0;
            seen |= bit;
            maybe_seen && runs[..i].iter().any(|a| a.word == b.word && a.lanes & b.lanes != 0)
        })
    } else {
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        sorted.windows(2).any(|p| p[0] == p[1])
    }
}

/// The first id that appears earlier in `ids` (the error path only; one exists).
fn first_repeated(ids: &[u32]) -> u32 {
    let mut seen = rustc_hash::FxHashSet::default();
    ids.iter().copied().find(|&id| !seen.insert(id)).unwrap_or(ids[0])
}

fn shift(id: u32) -> u32 {
    (id % LANES as u32) * LANE_BITS
}

/// A 1 in `id`'s lane.
fn unit(id: u32) -> u64 {
    1 << shift(id)
}

/// Bit `k` set for `id` in lane `k`.
fn lane_bit(id: u32) -> u8 {
    1 << (id % LANES as u32)
}

/// A 1 in lane `k` for each bit `k` of `lanes`.
fn spread(lanes: u8) -> u64 {
    let lanes = u64::from(lanes);
    (lanes & 1)
        | (lanes & 2) << (LANE_BITS - 1)
        | (lanes & 4) << (2 * LANE_BITS - 2)
        | (lanes & 8) << (3 * LANE_BITS - 3)
}

/// Bit `k` set for each lane `k` whose top bit is set in `high` (a mask of lane top bits).
fn gather(high: u64) -> u8 {
    let bits = high >> (LANE_BITS - 1) & (ONES);
    (bits | bits >> (LANE_BITS - 1) | bits >> (2 * LANE_BITS - 2) | bits >> (3 * LANE_BITS - 3))
        as u8
        & 0xf
}

fn lane_value(word: u64, id: u32) -> u32 {
    u32::from((word >> shift(id)) as u16)
}

/// The top bit of each lane of `units` (a 1 in some lanes).
fn lanes_high(units: u64) -> u64 {
    units << (LANE_BITS - 1)
}

/// The top bit of every lane that is not 0. Adding `0x7fff` to a lane's low 15 bits carries
/// into its top bit iff they are not all 0, and never past it, so lanes do not interfere.
fn nonzero_lanes(word: u64) -> u64 {
    (((word & !HIGH) + !HIGH) | word) & HIGH
}

/// The top bit of every lane holding [`MAX_SHARED`] or more (all ones but maybe the lowest).
fn at_least_shared_max(word: u64) -> u64 {
    let all_but_lowest = !ONES;
    // A lane is >= 0xfffe iff its bits other than the lowest are all set.
    !nonzero_lanes(!word & all_but_lowest) & HIGH
}

/// Whether every lane of `units` holds a count above 0 in `word`.
fn all_referenced(word: u64, units: u64) -> bool {
    nonzero_lanes(word) & lanes_high(units) == lanes_high(units)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn lane_tests_do_not_cross_lanes() {
        let w = 0x0000_8000_0001_ffffu64;
        assert_eq!(nonzero_lanes(w), 0x0000_8000_8000_8000);
        assert_eq!(at_least_shared_max(0xfffe_fffd_ffff_0000), 0x8000_0000_8000_0000);
        assert!(all_referenced(w, unit(0) | unit(1) | unit(2)));
        assert!(!all_referenced(w, unit(3)));
    }

    #[test]
    fn spread_and_gather_are_inverse() {
        for lanes in 0..16u8 {
            assert_eq!(gather(lanes_high(spread(lanes))), lanes);
            assert_eq!(spread(lanes).count_ones(), lanes.count_ones());
        }
        assert_eq!(spread(0b1010), unit(1) | unit(3));
    }

    #[test]
    fn counts_of_one_word_are_independent() {
        let refs = RefCounts::new(8).unwrap();
        refs.set_first(&[1, 2]);
        refs.set_first(&[4, 5, 6, 7]);
        assert_eq!((0..8).map(|id| refs.get(id)).collect::<Vec<_>>(), [0, 1, 1, 0, 1, 1, 1, 1]);
        assert_eq!(refs.share(2), Ok(2));
        assert_eq!(refs.share(0), Err(0));
        assert_eq!(refs.drop_one(1), Some(0));
        assert_eq!(refs.drop_one(1), None);
        refs.clear(2);
        assert_eq!((0..4).map(|id| refs.get(id)).collect::<Vec<_>>(), [0, 0, 0, 0]);
    }

    #[test]
    fn a_share_stops_below_the_lane_width() {
        let refs = RefCounts::new(4).unwrap();
        refs.set_first(&[0, 1, 2, 3]);
        for _ in 1..MAX_SHARED {
            refs.share(1).unwrap();
        }
        assert_eq!(refs.share(1), Err(MAX_SHARED));
        refs.add_held(1);
        assert_eq!((0..4).map(|id| refs.get(id)).collect::<Vec<_>>(), [1, MAX_REF_CNT, 1, 1]);
    }

    #[test]
    fn release_many_finds_repeats_across_runs_and_keeps_the_batch_order() {
        let refs = RefCounts::new(16).unwrap();
        refs.set_first(&(0..16).collect::<Vec<_>>());
        let release =
            |ids: &[u32]| refs.release_many(ids, 16, &mut SmallVec::new()).map(<[u32]>::to_vec);
        let repeated = |value: &str| CoreError::InvalidBlock {
            value: value.into(),
            reason: "repeated in one call".into(),
        };
        assert_eq!(release(&[0, 5, 1, 0]).unwrap_err(), repeated("0"));
        assert_eq!(release(&[2, 3, 3]).unwrap_err(), repeated("3"));
        assert!(matches!(release(&[2, 16]), Err(CoreError::InvalidBlock { .. })));
        assert!((0..16).all(|id| refs.get(id) == 1));
        refs.share(9).unwrap();
        assert_eq!(release(&[3, 2, 9, 8, 0]).unwrap(), [3, 2, 8, 0]);
        assert_eq!(refs.get(9), 1);
        assert_eq!(release(&[12, 15, 14]).unwrap(), [12, 15, 14]);
        assert_eq!(release(&[1, 2]).unwrap_err(), CoreError::DoubleFree { block_id: 2 });
        assert_eq!(refs.get(1), 1);
        // One word in two runs, a shared block between them.
        refs.share(4).unwrap();
        assert_eq!(release(&[5, 4, 1, 6]).unwrap(), [5, 1, 6]);
        assert_eq!(refs.get(4), 1);
    }

    #[test]
    fn undo_restores_what_it_dropped_and_never_raises_a_zero() {
        let refs = RefCounts::new(4).unwrap();
        refs.set_first(&[0, 1, 2]);
        refs.share(1).unwrap();
        let run = Run { word: 0, lanes: 0b11, zeroed: 0b01 };
        refs.words[0].fetch_sub(unit(0) | unit(1), Ordering::AcqRel);
        refs.undo(&run);
        assert_eq!([refs.get(0), refs.get(1), refs.get(2)], [1, 2, 1]);
        // Lowered to 1, then freed by another holder: it stays free.
        refs.words[0].fetch_sub(unit(0) | unit(1), Ordering::AcqRel);
        refs.drop_one(1);
        refs.undo(&run);
        assert_eq!([refs.get(0), refs.get(1), refs.get(2)], [1, 0, 1]);
    }
}
