//! `RequestMap`: the requests of `HybridTables` in one dense vector, found by id through a
//! map of row numbers, as `BlockTables` keeps its rows (`row_of`).
//!
//! A decode step reads every request it appends to: its counters and each group's first
//! page and page ids. Kept as the values of a hash map keyed by id, each request was a
//! bucket of its own (spread over two or three cache lines by its hash chain fields) plus a
//! separately allocated vector of groups: several scattered lines per request, so a
//! 256-request step missed L1 about 8 times a request (`hybrid.md`, "Cost"). Here the map
//! holds only `id -> row` (16 bytes a bucket), the requests lie side by side in the order
//! they came, their groups inline (`RequestPages::groups`), and a step over requests added
//! together walks them in order.

use std::fmt;
use std::ops::{Deref, Index};

use rustc_hash::FxHashMap;

use crate::hybrid::tables::RequestPages;

/// One group's page ids of one request, with a copy of the last one beside the vector's
/// header: a decode step asks whether the partly filled last page of each token group is
/// shared, and reading the copy (inline in the request's row) spares it the line of the
/// heap buffer, scattered per request and group. Read through `Deref<Target = [u32]>`;
/// written only through [`edit`](Self::edit), which refreshes the copy, so it cannot go
/// stale.
#[derive(Clone, Default, PartialEq, Eq)]
pub(super) struct PageIds {
    ids: Vec<u32>,
    /// `ids`' last element; 0 when `ids` is empty.
    last: u32,
}

impl PageIds {
    /// Changes the ids with `change`, then refreshes the copy of the last one.
    pub(super) fn edit<R>(&mut self, change: impl FnOnce(&mut Vec<u32>) -> R) -> R {
        let result = change(&mut self.ids);
        self.last = self.ids.last().copied().unwrap_or(0);
        result
    }

    /// The last id, read from the copy: `self.last()` without touching the heap buffer.
    pub(super) fn last_id(&self) -> Option<u32> {
        debug_assert_eq!(self.ids.last().map(|_| self.last), self.ids.last().copied());
        (!self.ids.is_empty()).then_some(self.last)
    }
}

impl From<Vec<u32>> for PageIds {
    fn from(ids: Vec<u32>) -> Self {
        let mut page_ids = PageIds::default();
        page_ids.edit(|held| *held = ids);
        page_ids
    }
}

impl Deref for PageIds {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        &self.ids
    }
}

/// As the vector: what error messages and test snapshots print.
impl fmt::Debug for PageIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.ids.fmt(f)
    }
}

/// Requests by id, stored densely: `rows[row_of[id]]` is request `id`, `ids[row]` its id.
/// Removing a request moves the last row into its place (order is not kept: nothing reads
/// the requests in an order of their own).
#[derive(Default)]
pub(super) struct RequestMap {
    row_of: FxHashMap<u64, u32>,
    ids: Vec<u64>,
    rows: Vec<RequestPages>,
}

impl RequestMap {
    pub(super) fn len(&self) -> usize {
        self.rows.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub(super) fn contains_key(&self, request_id: &u64) -> bool {
        self.row_of.contains_key(request_id)
    }

    /// The row holding `request_id`, valid until the next `insert` or `remove`.
    pub(super) fn row_of(&self, request_id: u64) -> Option<usize> {
        self.row_of.get(&request_id).map(|&row| row as usize)
    }

    pub(super) fn row(&self, row: usize) -> &RequestPages {
        &self.rows[row]
    }

    pub(super) fn row_mut(&mut self, row: usize) -> &mut RequestPages {
        &mut self.rows[row]
    }

    pub(super) fn get(&self, request_id: &u64) -> Option<&RequestPages> {
        self.row_of(*request_id).map(|row| &self.rows[row])
    }

    pub(super) fn get_mut(&mut self, request_id: &u64) -> Option<&mut RequestPages> {
        self.row_of(*request_id).map(|row| &mut self.rows[row])
    }

    /// Adds `request` as `request_id`, or replaces (and returns) the one it names.
    pub(super) fn insert(
        &mut self,
        request_id: u64,
        request: RequestPages,
    ) -> Option<RequestPages> {
        if let Some(row) = self.row_of(request_id) {
            return Some(std::mem::replace(&mut self.rows[row], request));
        }
        let row = u32::try_from(self.rows.len()).expect("fewer than 2^32 requests");
        self.row_of.insert(request_id, row);
        self.ids.push(request_id);
        self.rows.push(request);
        None
    }

    /// Takes `request_id` out; the last row moves into its place.
    pub(super) fn remove(&mut self, request_id: &u64) -> Option<RequestPages> {
        let row = self.row_of.remove(request_id)? as usize;
        self.ids.swap_remove(row);
        let request = self.rows.swap_remove(row);
        if let Some(&moved) = self.ids.get(row) {
            self.row_of.insert(moved, row as u32);
        }
        Some(request)
    }

    /// `row_of` and `ids` are inverse, one id and one row per request:
    /// `len(row_of) == len(ids) == len(rows)` and `row_of[ids[r]] == r` for every row `r`.
    pub(super) fn check(&self) -> Result<(), String> {
        if self.row_of.len() != self.ids.len() || self.ids.len() != self.rows.len() {
            return Err(format!(
                "request map: {} ids mapped, {} listed, {} rows",
                self.row_of.len(),
                self.ids.len(),
                self.rows.len()
            ));
        }
        for (row, id) in self.ids.iter().enumerate() {
            if self.row_of(*id) != Some(row) {
                return Err(format!(
                    "request map: row {row} holds request {id}, the map says {:?}",
                    self.row_of(*id)
                ));
            }
        }
        Ok(())
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&u64, &RequestPages)> + '_ {
        self.ids.iter().zip(&self.rows)
    }

    #[cfg(test)]
    pub(super) fn keys(&self) -> impl Iterator<Item = &u64> + '_ {
        self.ids.iter()
    }
}

impl Index<&u64> for RequestMap {
    type Output = RequestPages;

    fn index(&self, request_id: &u64) -> &RequestPages {
        self.get(request_id).expect("a request the tables hold")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::hybrid::tables::GroupTables;

    fn request(num_tokens: usize) -> RequestPages {
        RequestPages {
            num_tokens,
            next_query: 0,
            groups: GroupTables::new(),
            hashes: None,
            quiet_until: 0,
        }
    }

    /// Random inserts, replacements and removals against a `BTreeMap`: the same requests
    /// under the same ids, and the rows consistent, after every call.
    #[test]
    fn matches_a_plain_map() {
        let mut map = RequestMap::default();
        let mut model: BTreeMap<u64, usize> = BTreeMap::new();
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |bound: u64| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) % bound
        };
        for step in 0..4000 {
            let id = next(40);
            if next(3) == 0 {
                assert_eq!(map.remove(&id).map(|r| r.num_tokens), model.remove(&id), "{step}");
            } else {
                let old = map.insert(id, request(step)).map(|r| r.num_tokens);
                assert_eq!(old, model.insert(id, step), "{step}");
            }
            map.check().unwrap();
            assert_eq!(map.len(), model.len());
            let mut held: Vec<(u64, usize)> =
                map.iter().map(|(&id, r)| (id, r.num_tokens)).collect();
            held.sort_unstable();
            assert_eq!(held, model.iter().map(|(&id, &n)| (id, n)).collect::<Vec<_>>());
            for probe in 0..40 {
                assert_eq!(map.get(&probe).map(|r| r.num_tokens), model.get(&probe).copied());
                assert_eq!(map.contains_key(&probe), model.contains_key(&probe));
            }
        }
    }
}
