//! A layer's state in the cache: the committed conv inputs and recurrent state, the last
//! forward's rows kept pending, and their settling on rollback (a chain prefix, a tree path).

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

use super::GdnDims;

/// The committed state of one layer, f32 on the layer's device: conv inputs of the last K-1
/// rows `[K-1, C]` (oldest first) and S `[Hv·dk·dv]`. Allocated once and then updated in place,
/// so that a captured forward (a CUDA graph) reads the current state at every replay.
#[derive(Debug, Clone)]
pub struct GdnState {
    pub conv: Tensor,
    pub rec: Tensor,
}

/// The last forward's rows, kept for rollback (on the layer's device).
#[derive(Debug, Clone)]
pub struct GdnRows {
    /// The conv inputs of the rows, `[n, C]`.
    pub inputs: Tensor,
    pub parents: Vec<Option<usize>>,
    /// State after each row `[n, S]` (recurrent path), or only after the last `[1, S]`.
    pub states: Tensor,
    pub per_row: bool,
}

/// Cloning copies the committed state (updated in place, so a clone must not share it); the
/// pending rows are shared (never written in place, except a captured forward's, which its
/// next replay overwrites).
#[derive(Debug)]
pub struct GdnCache {
    pub dims: GdnDims,
    device: Device,
    /// `None` until the first forward: the empty state (zeros).
    committed: Option<GdnState>,
    pub last: Option<GdnRows>,
    /// False until the first forward (a prefill from the empty state).
    pub started: bool,
}

impl Clone for GdnCache {
    fn clone(&self) -> Self {
        let committed = self.committed.as_ref().map(|c| GdnState {
            conv: c.conv.copy().expect("copying a linear-attention state"),
            rec: c.rec.copy().expect("copying a linear-attention state"),
        });
        Self {
            dims: self.dims,
            device: self.device.clone(),
            committed,
            last: self.last.clone(),
            started: self.started,
        }
    }
}

impl GdnCache {
    pub fn new(dims: GdnDims, device: &Device) -> Self {
        Self {
            dims,
            device: device.clone(),
            committed: None,
            last: None,
            started: false,
        }
    }

    /// A sequence's cache whose committed state is `state` (from a batched cache's slot),
    /// before its first forward here (a prefill from it takes the chunked rule).
    pub fn from_state(dims: GdnDims, state: GdnState) -> Self {
        Self {
            dims,
            device: state.rec.device().clone(),
            committed: Some(state),
            last: None,
            started: false,
        }
    }

    /// The committed state (zeros before the first forward).
    pub fn committed(&mut self) -> Result<GdnState> {
        if self.committed.is_none() {
            let d = self.dims;
            self.committed = Some(GdnState {
                conv: Tensor::zeros((d.kernel - 1, d.conv_dim()), DType::F32, &self.device)?,
                rec: Tensor::zeros(d.state_len(), DType::F32, &self.device)?,
            });
        }
        Ok(self.committed.clone().expect("set above"))
    }

    /// The committed state without allocating it here (zeros before the first forward).
    pub fn committed_or_zero(&self) -> Result<GdnState> {
        match &self.committed {
            Some(c) => Ok(c.clone()),
            None => {
                let d = self.dims;
                Ok(GdnState {
                    conv: Tensor::zeros((d.kernel - 1, d.conv_dim()), DType::F32, &self.device)?,
                    rec: Tensor::zeros(d.state_len(), DType::F32, &self.device)?,
                })
            }
        }
    }

    /// Rows appended by the last forward that are not settled yet.
    pub fn pending(&self) -> usize {
        self.last.as_ref().map(|l| l.parents.len()).unwrap_or(0)
    }

    /// Keep the root-to-node path `path` (indices into the last forward's rows, each the
    /// child of the one before, the first a root) and drop the other rows.
    pub fn settle_path(&mut self, path: &[usize]) -> Result<()> {
        let Some(rows) = self.last.take() else {
            if path.is_empty() {
                return Ok(());
            }
            bail!("linear-attention state: no pending rows to keep");
        };
        if path.is_empty() {
            return Ok(());
        }
        for (j, &r) in path.iter().enumerate() {
            let want = if j == 0 { None } else { Some(path[j - 1]) };
            if r >= rows.parents.len() || rows.parents[r] != want {
                bail!("linear-attention state: kept rows {path:?} are not a root-to-node path of the last forward");
            }
        }
        let end = *path.last().unwrap();
        let rec = if rows.per_row {
            rows.states.get(end)?
        } else if end + 1 == rows.parents.len() {
            rows.states.get(0)?
        } else {
            bail!("linear-attention state: cannot roll back into a chunked (prefill) forward");
        };
        // the conv window: the committed inputs, then the path's, the last K-1 of them
        let k1 = self.dims.kernel - 1;
        let tail = &path[path.len().saturating_sub(k1)..];
        let state = self.committed()?;
        // in place: the committed state's buffers stay the ones a captured forward reads
        crate::ops::gdn_settle::settle_conv(&state.conv, &rows.inputs, tail)?;
        state.rec.slice_set(&rec.contiguous()?, 0, 0)?;
        Ok(())
    }

    /// Keep only the first `keep` rows of the last forward pending (drop a padded forward's
    /// padding rows, which no real row descends from).
    pub fn trim_pending(&mut self, keep: usize) -> Result<()> {
        let Some(rows) = self.last.as_mut() else {
            return Ok(());
        };
        let n = rows.parents.len();
        if keep >= n {
            return Ok(());
        }
        if !rows.per_row {
            bail!("linear-attention state: cannot trim the rows of a chunked (prefill) forward");
        }
        rows.parents.truncate(keep);
        rows.inputs = rows.inputs.narrow(0, 0, keep)?;
        rows.states = rows.states.narrow(0, 0, keep)?;
        Ok(())
    }

    /// Keep the first `keep` rows of the last forward (a chain prefix).
    pub fn settle_prefix(&mut self, keep: usize) -> Result<()> {
        let path: Vec<usize> = (0..keep).collect();
        self.settle_path(&path)
    }

    /// Before a new forward: all pending rows become committed (they must form a chain).
    pub fn settle_all(&mut self) -> Result<()> {
        let n = self.pending();
        if n > 0
            && !self
                .last
                .as_ref()
                .unwrap()
                .parents
                .iter()
                .enumerate()
                .all(|(i, p)| *p == i.checked_sub(1))
        {
            bail!("a tree verify must be compacted (keep_rows) before the next forward");
        }
        self.settle_prefix(n)
    }
}
