//! `dflash-rs data prompts`: a frozen prompt set, several sources cut, checked against the
//! evaluation sets, templated and mixed by a seeded shuffle.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use dflash_model::io::loader::dflash_home;
use dflash_train::overlap::Overlap;
use dflash_train::prompts::{self, Prompt};

#[derive(Args, Debug)]
pub struct PromptsArgs {
    /// A source as for `data generate --prompts`; repeat to mix several.
    #[arg(long, required = true)]
    pub prompts: Vec<String>,
    /// At most this many prompts from a source (after --max-chars): once for all sources, or
    /// once per --prompts, in the same order.
    #[arg(long)]
    pub limit: Vec<usize>,
    /// Skip prompts whose text is longer than this many characters.
    #[arg(long)]
    pub max_chars: Option<usize>,
    /// At most this many prompts from each file of a directory source (evals registry).
    #[arg(long, default_value_t = 50)]
    pub cap_per_file: usize,
    /// Seed of the shuffle that mixes the sources.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Continue this frozen prompt file: its prompts first, in its order (a regeneration of it
    /// resumes on the output), then the new mix without the prompts it already has.
    #[arg(long)]
    pub extend: Option<PathBuf>,
    /// Wrap each prompt's last user turn in this text, where `{prompt}` stands for the turn (e.g.
    /// "{prompt}\nWrite the solution in Python."): once for all sources, or once per --prompts,
    /// in the same order (`{prompt}` alone leaves a source as it is; `\n`, `\t` and `\\` are
    /// a newline, a tab and a backslash). Applied after --max-chars and --limit.
    #[arg(long)]
    pub template: Vec<String>,
    /// Drop every prompt that shares a run of 13 words with an item of GSM8K, HumanEval,
    /// MT-Bench or MATH-500, or whose words are exactly a shorter item's (all four sets must be
    /// in the asset cache). Without it such prompts are counted and kept.
    #[arg(long)]
    pub drop_eval_overlap: bool,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what `--out` already holds (without it, an output that holds anything is
    /// refused by name).
    #[arg(long)]
    pub force: bool,
}

pub(super) fn run_prompts(a: PromptsArgs) -> Result<()> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    check_args(&a)?;
    crate::args::OUT_REPLACEABLE.check_file(&a.out, a.force)?;
    let (items, missing) = dflash_eval::datasets::item_texts(&dflash_home())?;
    if a.drop_eval_overlap && !missing.is_empty() {
        anyhow::bail!(
            "--drop-eval-overlap needs every evaluation set in the asset cache ({}); missing: {} \
             (scripts/fetch-assets.sh datasets)",
            dflash_home().display(),
            missing.join(", ")
        );
    }
    let overlap = missing
        .is_empty()
        .then(|| Overlap::new(items.iter().map(String::as_str)));
    let mut all = Vec::new();
    for (k, src) in a.prompts.iter().enumerate() {
        all.extend(source_prompts(&a, k, src, overlap.as_ref(), &missing)?);
    }
    all.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(a.seed));
    if let Some(old) = &a.extend {
        all = extended(old, all)?;
    }
    let mut text = String::new();
    for p in &all {
        text.push_str(&serde_json::to_string(
            &serde_json::json!({ "messages": p.messages }),
        )?);
        text.push('\n');
    }
    dflash_model::io::atomic::write_file(&a.out, text.as_bytes())?;
    eprintln!("wrote {}: {} prompts", a.out.display(), all.len());
    Ok(())
}

/// `--limit` and `--template`: one for all sources or one per source; each template holds the
/// prompt's slot.
fn check_args(a: &PromptsArgs) -> Result<()> {
    if a.limit.len() > 1 && a.limit.len() != a.prompts.len() {
        anyhow::bail!(
            "{} --limit values for {} --prompts sources: give one for all, or one per source",
            a.limit.len(),
            a.prompts.len()
        );
    }
    if a.template.len() > 1 && a.template.len() != a.prompts.len() {
        anyhow::bail!(
            "{} --template values for {} --prompts sources: give one for all, or one per source",
            a.template.len(),
            a.prompts.len()
        );
    }
    if let Some(t) = a
        .template
        .iter()
        .find(|t| !t.contains(prompts::TEMPLATE_SLOT))
    {
        anyhow::bail!(
            "--template {t:?} has no {} for the prompt's text",
            prompts::TEMPLATE_SLOT
        );
    }
    Ok(())
}

/// Source `k` (`src`) loaded, its prompts that quote an evaluation item counted (dropped with
/// `--drop-eval-overlap`; `overlap` is `None` when sets are `missing` from the asset cache),
/// then cut to `--max-chars` and `--limit` and templated.
fn source_prompts(
    a: &PromptsArgs,
    k: usize,
    src: &str,
    overlap: Option<&Overlap>,
    missing: &[&str],
) -> Result<Vec<Prompt>> {
    let mut ps = prompts::load(src, a.cap_per_file)?;
    let n0 = ps.len();
    match overlap {
        Some(o) => {
            let quotes = |p: &Prompt| p.messages.iter().any(|m| o.hits(&m.content));
            let hits = ps.iter().filter(|p| quotes(p)).count();
            if a.drop_eval_overlap {
                ps.retain(|p| !quotes(p));
                eprintln!("{src}: {hits} of {n0} prompts quote an evaluation item: dropped");
            } else {
                eprintln!("{src}: {hits} of {n0} prompts quote an evaluation item: kept (--drop-eval-overlap drops them)");
            }
        }
        None => eprintln!(
            "{src}: overlap with the evaluation sets not checked ({} not in the asset cache)",
            missing.join(", ")
        ),
    }
    if let Some(m) = a.max_chars {
        ps.retain(|p| {
            p.messages
                .iter()
                .map(|m| m.content.chars().count())
                .sum::<usize>()
                <= m
        });
    }
    if let Some(&l) = a.limit.get(k).or(a.limit.first()) {
        ps.truncate(l);
    }
    if let Some(t) = a.template.get(k).or(a.template.first()) {
        let t = prompts::unescape_template(t);
        ps.iter_mut().for_each(|p| prompts::apply_template(p, &t));
    }
    eprintln!("{src}: {} of {n0} prompts", ps.len());
    Ok(ps)
}

/// The frozen prompt file `old` continued: its prompts first, in its order, then those of
/// `all` it does not hold yet.
fn extended(old: &Path, all: Vec<Prompt>) -> Result<Vec<Prompt>> {
    let old = prompts::load(&format!("jsonl:{}", old.display()), usize::MAX)?;
    let n_old = old.len();
    let (ext, already) = prompts::extend(old, all);
    eprintln!(
        "extending {n_old} prompts: {} new, {already} already there",
        ext.len() - n_old
    );
    Ok(ext)
}
