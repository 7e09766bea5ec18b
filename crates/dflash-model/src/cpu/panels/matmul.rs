//! The products `x · Wᵀ`: the rows in blocks against each panel, the panels split over the
//! calling thread and the helpers; the exact kernels ([`super::kernels`]) or the integer ones
//! ([`crate::cpu::q8`]).

use super::kernels::Stream;
#[cfg(target_arch = "x86_64")]
use super::kernels::{avx2, avx512};
use super::{Isa, PanelData, Panels, SyncPtr, INLINE_FMAS, PANEL};
use crate::cpu::q8::{self, IntKind};
use crate::cpu::quant::QBLOCK;

impl Panels {
    /// `y[rows, n] = x[rows, k] · Wᵀ` on [`Isa::detect`]'s kernels, panels split over the
    /// calling thread and [`crate::cpu::helpers`].
    /// Panics if the CPU runs no kernel ([`Self::supported`]) or the lengths disagree (callers
    /// check both).
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let isa = Isa::detect().expect("Panels::matmul needs AVX-512F or AVX2 + FMA + F16C");
        self.matmul_on(isa, x, rows)
    }

    /// [`Self::matmul`] on the kernels of `isa`, which the CPU must run ([`Isa::available`]).
    pub fn matmul_on(&self, isa: Isa, x: &[f32], rows: usize) -> Vec<f32> {
        assert!(
            Isa::available().contains(&isa),
            "Panels::matmul_on: no {isa:?} here"
        );
        assert_eq!(x.len(), rows * self.k, "Panels::matmul: input length");
        match &self.data {
            PanelData::F32(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Bf16(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Q4_1(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Q8_0(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Q4K(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Q6K(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Int(kind, d) => self.matmul_int(isa, *kind, d, x, rows),
        }
    }

    /// The integer products ([`crate::cpu::q8`]): the rows quantized once, then each panel's
    /// blocks of rows on [`q8::IntIsa::for_isa`]'s kernel.
    fn matmul_int(&self, isa: Isa, kind: IntKind, data: &[u8], x: &[f32], rows: usize) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let a = q8::quantize_rows(x, rows, k);
        let ii = q8::IntIsa::for_isa(isa);
        let mut y = vec![0f32; rows * n];
        let out = SyncPtr(y.as_mut_ptr());
        let len = k / QBLOCK * kind.block_bytes();
        let run = |range: std::ops::Range<usize>| {
            let y = out.ptr();
            for p in range {
                let cols = PANEL.min(n - p * PANEL);
                let panel = &data[p * len..][..len];
                let mut r0 = 0;
                while r0 < rows {
                    let r = ii.block_rows().min(rows - r0);
                    let y = y.wrapping_add(r0 * n + p * PANEL);
                    // SAFETY: the CPU runs `isa` (checked by matmul_on) and so `ii`; the block
                    // writes y[r0..r0+r, 16p..16p+cols] only, disjoint from every other chunk's
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        q8::block(ii, kind, &a, r0, r, panel, y, n, cols)
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    {
                        let _ = (y, panel, cols, &a);
                    }
                    r0 += r;
                }
            }
        };
        self.over_panels(rows, &run);
        if let Some(bounds) = &self.screen {
            crate::cpu::screen::settle(&mut y, &a, x, bounds, &|c| {
                (&data[c / PANEL * len..][..len], c % PANEL)
            });
        }
        y
    }

    /// `run` over every panel: on the calling thread for a small product, else in chunks of
    /// panels (≈ 8 per thread) on the calling thread and [`crate::cpu::helpers`].
    fn over_panels(&self, rows: usize, run: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let panels = self.n.div_ceil(PANEL);
        if rows * self.n * self.k < INLINE_FMAS {
            run(0..panels);
        } else {
            let chunk = panels
                .div_ceil(rayon::current_num_threads().max(1) * 8)
                .max(1);
            crate::cpu::helpers::for_each_chunk(panels.div_ceil(chunk), &|c| {
                run(c * chunk..((c + 1) * chunk).min(panels))
            });
        }
    }

    fn matmul_of<E: Stream>(&self, isa: Isa, data: &[E], x: &[f32], rows: usize) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let mut y = vec![0f32; rows * n];
        let out = SyncPtr(y.as_mut_ptr());
        // rows per block: 16 accumulators and a weight vector within AVX-512's 32 registers;
        // 6 × 2 halves and a weight's 2 within AVX2's 16
        let block_rows = match isa {
            Isa::Avx512 => 16,
            Isa::Avx2 => 6,
        };
        let run = |range: std::ops::Range<usize>| {
            let y = out.ptr();
            for p in range {
                let cols = PANEL.min(n - p * PANEL);
                let len = E::panel_len(k);
                let panel = &data[p * len..][..len];
                let mut r0 = 0;
                while r0 < rows {
                    let r = block_rows.min(rows - r0);
                    let x = &x[r0 * k..(r0 + r) * k];
                    let y = y.wrapping_add(r0 * n + p * PANEL);
                    // SAFETY: the CPU runs `isa` (checked above); the block writes
                    // y[r0..r0+r, 16p..16p+cols] only, inside y (rows × n) and disjoint from
                    // every other chunk's columns
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        match isa {
                            Isa::Avx512 => avx512::block(x, r, k, panel, y, n, cols),
                            Isa::Avx2 => avx2::block(x, r, k, panel, y, n, cols),
                        }
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    let _ = (x, y, panel, cols);
                    r0 += r;
                }
            }
        };
        self.over_panels(rows, &run);
        y
    }
}
