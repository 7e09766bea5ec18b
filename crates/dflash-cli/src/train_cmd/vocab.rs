//! `dflash-rs data vocab`: a drafter's vocabulary subset, the most frequent supervised tokens
//! of a data directory.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct VocabArgs {
    /// A data directory (`data generate`'s shards + manifest).
    #[arg(long)]
    pub data: PathBuf,
    /// Tokens to keep.
    #[arg(long, default_value_t = 8192)]
    pub size: usize,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what `--out` already holds (without it, an output that holds anything is
    /// refused by name).
    #[arg(long)]
    pub force: bool,
}

pub(super) fn run_vocab(a: VocabArgs) -> Result<()> {
    if a.size == 0 {
        anyhow::bail!("--size must be at least 1");
    }
    crate::args::OUT_REPLACEABLE.check_file(&a.out, a.force)?;
    let (_, seqs) = dflash_train::data::read_sequences(&a.data)?;
    let (ids, coverage) = dflash_train::vocab::frequent_tokens(&seqs, a.size);
    let v = dflash_model::models::draft_vocab::DraftVocab {
        source: format!(
            "the {} most frequent supervised tokens of {} ({} sequences)",
            ids.len(),
            a.data.display(),
            seqs.len()
        ),
        coverage: Some(coverage),
        token_ids: ids,
    };
    dflash_model::io::atomic::write_file(&a.out, serde_json::to_string(&v)?.as_bytes())?;
    eprintln!(
        "wrote {}: {} tokens, {:.2} % of the supervised tokens",
        a.out.display(),
        v.token_ids.len(),
        100.0 * coverage
    );
    Ok(())
}
