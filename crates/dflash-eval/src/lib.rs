//! dflash-eval: datasets, the evaluation harness, reports and plots, the doctor, and the
//! benchmark page (docs/BENCHMARKS.md) generated from the benchmark records.

pub mod bench_doc;
pub mod datasets;
pub mod doctor;
pub mod harness;
pub mod journal;
pub mod report;
