//! dflash-eval: datasets, the evaluation harness, reports and plots, and the doctor.

pub mod datasets;
pub mod doctor;
pub mod harness;
pub mod report;
