//! A closed-form backward attached to a value that a fused kernel computed without a graph.
//!
//! candle-nn's fused kernels (softmax, RMSNorm, RoPE) have no backward. The pattern here: run
//! the kernel on detached inputs (`y`), then pass `y` through a custom op whose inputs are the
//! tracked tensors and whose backward is the closed form; the forward costs one copy of `y`,
//! and only where an input carries a graph (the drafter in training): in decoding `y` is
//! returned as it is. Users: [`crate::ops::softmax`], [`crate::layers::norm`], [`crate::layers::rope`].
//! Example: `with_grad(&x, softmax(x.detach()), "softmax", |y, g| y·(g − Σ g·y))`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

type Bwd1 = dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync;
/// A backward of three inputs: `g ↦ (da, db, dc)` (the attentions' written backwards, which the
/// drafter's taped backward calls directly).
pub type Grad3 = Box<dyn Fn(&Tensor) -> Result<(Tensor, Tensor, Tensor)> + Send + Sync>;
type Bwd2 = dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)> + Send + Sync;

/// `y` with `x`'s graph and the gradient `bwd(y, g)` (for `x`).
pub fn with_grad(
    x: &Tensor,
    y: Tensor,
    name: &'static str,
    bwd: impl Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !x.track_op() {
        return Ok(y);
    }
    x.apply_op2(
        &y,
        PassThrough1 {
            name,
            bwd: Box::new(bwd),
        },
    )
}

/// `y` with the graphs of `x` and `w` and the gradients `bwd(x, w, y, g)` (for `x`, `w`).
pub fn with_grad2(
    x: &Tensor,
    w: &Tensor,
    y: Tensor,
    name: &'static str,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !x.track_op() && !w.track_op() {
        return Ok(y);
    }
    x.apply_op3(
        w,
        &y,
        PassThrough2 {
            name,
            bwd: Box::new(bwd),
        },
    )
}

struct PassThrough1 {
    name: &'static str,
    bwd: Box<Bwd1>,
}

struct PassThrough2 {
    name: &'static str,
    bwd: Box<Bwd2>,
}

/// The value passed through: a copy of `y`, which must be fresh and contiguous (the fused
/// kernel's output).
fn pass<S: BackendStorage>(name: &str, y: &S, ly: &Layout) -> Result<(S, Shape)> {
    if !ly.is_contiguous() || ly.start_offset() != 0 {
        candle_core::bail!("{name}: the fused result must be fresh and contiguous");
    }
    Ok((y.try_clone(ly)?, ly.shape().clone()))
}

impl CustomOp2 for PassThrough1 {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        pass(self.name, y, ly)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        pass(self.name, y, ly)
    }
    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some((self.bwd)(res, grad)?), None))
    }
}

impl CustomOp3 for PassThrough2 {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        pass(self.name, y, ly)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        pass(self.name, y, ly)
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = (self.bwd)(x, w, res, grad)?;
        Ok((Some(dx), Some(dw), None))
    }
}

type Bwd3 = dyn Fn(&Tensor) -> Result<(Tensor, Tensor, Tensor)> + Send + Sync;

/// `y` with the graphs of `a`, `b` and `c` and their gradients `bwd(g)` (the closure holds
/// whatever it needs from the forward). `y` must be fresh and contiguous; it is copied once.
/// User: [`crate::ops::block_attention::attend_blocks`] (q, k, v).
pub fn with_grad3(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    y: Tensor,
    name: &'static str,
    bwd: impl Fn(&Tensor) -> Result<(Tensor, Tensor, Tensor)> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !a.track_op() && !b.track_op() && !c.track_op() {
        return Ok(y);
    }
    a.apply_op3(
        b,
        c,
        PassThrough3 {
            name,
            y,
            bwd: Box::new(bwd),
        },
    )
}

struct PassThrough3 {
    name: &'static str,
    y: Tensor,
    bwd: Box<Bwd3>,
}

impl CustomOp3 for PassThrough3 {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (s, l) = self.y.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(y) => pass(self.name, y, l),
            _ => candle_core::bail!("{}: the value is not on the CPU", self.name),
        }
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (s, l) = self.y.storage_and_layout();
        match &*s {
            candle_core::Storage::Cuda(y) => pass(self.name, y, l),
            _ => candle_core::bail!("{}: the value is not on the GPU", self.name),
        }
    }
    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (da, db, dc) = (self.bwd)(grad)?;
        Ok((Some(da), Some(db), Some(dc)))
    }
}
