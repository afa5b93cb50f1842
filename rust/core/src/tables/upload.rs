//! Asynchronous upload of block tables to the GPU (design: `upload.md`).
//!
//! Device layout, one allocation: `[seq_lens: max_seqs i32][table: max_seqs x width i32]`.
//! Two pinned staging buffers of the same layout alternate between syncs. A sync:
//!   1. waits for the event of the buffer it is about to write (the copy from two syncs
//!      ago; normally long finished), so a buffer is never rewritten while its copy is in
//!      flight;
//!   2. brings that buffer up to date: rows whose version differs from the one it last
//!      staged, plus all seq_lens;
//!   3. copies seq_lens and the rows changed since the last upload with
//!      `cuMemcpyHtoDAsync` on the given stream (contiguous dirty rows share one copy; past
//!      `MAX_COPIES_PER_SYNC` runs, one copy of their bounding range);
//!   4. records the buffer's event on the stream.
//!
//! Kernels launched afterwards on the same stream see the new table with no other sync.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use super::TablesState;
use crate::driver::{self, DeviceBuffer, Event, PinnedBuffer};
use crate::error::CoreError;

/// Beyond this many separate row runs, one copy of the bounding range is cheaper: each
/// `cuMemcpyHtoDAsync` costs ~2 us of CPU, while an extra KiB of rows costs nanoseconds.
const MAX_COPIES_PER_SYNC: usize = 4;

/// Where the last sync put the batch on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBatch {
    /// `[num_seqs, max_blocks_per_seq]` int32, row-major.
    pub block_table_ptr: u64,
    /// `[num_seqs]` int32.
    pub seq_lens_ptr: u64,
    pub num_seqs: usize,
    pub max_blocks_per_seq: usize,
    /// The stream the upload was ordered on.
    pub stream: u64,
}

struct Staging {
    buffer: PinnedBuffer,
    copied: Event,
    /// Version of each row as last written into this buffer.
    staged_version: Vec<u64>,
}

pub struct Uploader {
    ctx: Arc<CudaContext>,
    device: DeviceBuffer,
    staging: [Staging; 2],
    next: usize,
    /// Version of each row as last uploaded to the device.
    uploaded_version: Vec<u64>,
    /// The stream of the last sync: a sync on another stream first waits for it.
    last_stream: Option<u64>,
    max_seqs: usize,
    width: usize,
}

impl Uploader {
    pub fn new(ctx: &Arc<CudaContext>, max_seqs: usize, width: usize) -> Result<Self, CoreError> {
        let bytes = 4 * max_seqs * (1 + width);
        let staging = || -> Result<Staging, CoreError> {
            Ok(Staging {
                buffer: PinnedBuffer::zeroed(ctx, bytes)?,
                copied: Event::new(ctx)?,
                staged_version: vec![0; max_seqs],
            })
        };
        Ok(Uploader {
            ctx: ctx.clone(),
            device: DeviceBuffer::zeroed(ctx, bytes)?,
            staging: [staging()?, staging()?],
            next: 0,
            uploaded_version: vec![0; max_seqs],
            last_stream: None,
            max_seqs,
            width,
        })
    }

    /// The device this uploader uploads to.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Uploads what changed in `st` since the last sync, ordered on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this uploader's context.
    pub unsafe fn sync(
        &mut self,
        st: &TablesState,
        stream: sys::CUstream,
    ) -> Result<DeviceBatch, CoreError> {
        driver::bind(&self.ctx)?;
        let num_rows = st.num_rows();
        let (max_seqs, width) = (self.max_seqs, self.width);
        // A sync on another stream than the last one must not overtake the last upload: make
        // this stream wait for it on the device (no CPU wait).
        if self.last_stream != Some(stream as u64) {
            // SAFETY: the caller guarantees `stream` is live in this context.
            unsafe { self.staging[self.next ^ 1].copied.make_wait(stream) }?;
        }
        let staging = &mut self.staging[self.next];
        staging.copied.wait()?;

        let host = staging.buffer.as_i32_mut();
        let (seq_lens, table) = host.split_at_mut(max_seqs);
        for (dst, len) in seq_lens.iter_mut().zip(st.seq_lens()) {
            *dst = len;
        }
        // Rows past `num_rows` are never read by a kernel, but keep them in step too so a
        // bounding-range copy never uploads stale rows.
        for row in 0..max_seqs {
            if staging.staged_version[row] != st.row_version[row] {
                table[row * width..(row + 1) * width]
                    .copy_from_slice(&st.table[row * width..(row + 1) * width]);
                staging.staged_version[row] = st.row_version[row];
            }
        }

        let dirty: Vec<usize> =
            (0..max_seqs).filter(|&r| self.uploaded_version[r] != st.row_version[r]).collect();
        let runs = row_runs(&dirty);
        let runs = if runs.len() > MAX_COPIES_PER_SYNC {
            vec![(runs[0].0, runs[runs.len() - 1].1)]
        } else {
            runs
        };

        let base_host = staging.buffer.as_ptr();
        let base_dev = self.device.ptr();
        let table_offset = 4 * max_seqs;
        let copy = |offset: usize, bytes: usize| -> Result<(), CoreError> {
            if bytes == 0 {
                return Ok(());
            }
            // SAFETY: `offset + bytes` lies inside both the pinned buffer and the device buffer
            // (same layout, `4 * max_seqs * (1 + width)` bytes). The pinned buffer is not
            // written again until its event, recorded below after this copy, has completed.
            let src = unsafe { std::slice::from_raw_parts(base_host.add(offset), bytes) };
            // SAFETY: as above for the destination; the caller guarantees `stream` is live.
            unsafe { result::memcpy_htod_async(base_dev + offset as u64, src, stream) }
                .map_err(|e| driver::driver_error("cuMemcpyHtoDAsync", e))
        };
        let copied = std::iter::once((0, 4 * num_rows))
            .chain(runs.iter().map(|&(first, last)| {
                (table_offset + 4 * first * width, 4 * (last + 1 - first) * width)
            }))
            .try_for_each(|(offset, bytes)| copy(offset, bytes));
        // Record the event and flip buffers even when a copy failed: copies queued before the
        // failure still read this buffer, and the next sync must not rewrite it under them.
        // SAFETY: the caller guarantees `stream` is live in this context.
        let recorded = unsafe { staging.copied.record(stream) };
        self.next ^= 1;
        self.last_stream = Some(stream as u64);
        copied?;
        recorded?;
        for &row in &dirty {
            self.uploaded_version[row] = st.row_version[row];
        }

        Ok(DeviceBatch {
            block_table_ptr: base_dev + table_offset as u64,
            seq_lens_ptr: base_dev,
            num_seqs: num_rows,
            max_blocks_per_seq: width,
            stream: stream as u64,
        })
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        // The staging buffers are freed right after this; in-flight copies must not read them.
        for staging in &self.staging {
            let _ = staging.copied.wait();
        }
    }
}

/// Sorted row indices -> inclusive runs of consecutive rows.
fn row_runs(sorted: &[usize]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &row in sorted {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == row => *last = row,
            _ => runs.push((row, row)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_merge_consecutive_rows() {
        assert_eq!(super::row_runs(&[]), vec![]);
        assert_eq!(super::row_runs(&[0, 1, 2, 5, 7, 8]), vec![(0, 2), (5, 5), (7, 8)]);
    }
}
