//! Overlap with the evaluation sets, by text: a training prompt that shares a run of
//! [`NGRAM`] consecutive words with an evaluation item quotes that item, whatever its file is
//! called. The loader's file-name refusal ([`crate::prompts::is_evaluation_file`]) catches a
//! copied evaluation file; this catches an item that reached another source (a ShareGPT
//! conversation pasting a GSM8K question, a registry task built from HumanEval).
//!
//! Words are maximal runs of alphanumeric characters, lower-cased, so punctuation, case and
//! spacing do not matter. Example: the GSM8K item "Janet's ducks lay 16 eggs per day. She eats
//! three for breakfast every morning and bakes muffins …" has the 13-word run `janet s ducks lay
//! 16 eggs per day she eats three for breakfast`; a prompt "JANET'S ducks lay 16 eggs per
//! day — she eats three for breakfast!" contains it and overlaps; a prompt with only its first
//! 12 words does not. Items shorter than 13 words are not matched (a short MATH problem's
//! words are common phrases) and are counted in [`Overlap::short_items`].

use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};

/// Words in a run that counts as quoting an item (the contamination checks of GPT-3's paper
/// use 13-word runs).
pub const NGRAM: usize = 13;

/// The 13-word runs of a set of evaluation texts.
#[derive(Debug, Default)]
pub struct Overlap {
    runs: HashSet<u64>,
    /// Texts that gave at least one run.
    pub items: usize,
    /// Texts shorter than [`NGRAM`] words (not matched).
    pub short_items: usize,
}

/// `text`'s words, lower-cased. Example: "Janet's ducks, 16!" → `janet`, `s`, `ducks`, `16`.
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// One key per window of [`NGRAM`] words (a hash of the words in order).
fn runs(text: &str) -> Vec<u64> {
    let w = words(text);
    w.windows(NGRAM)
        .map(|win| {
            let mut h = DefaultHasher::new();
            win.hash(&mut h);
            h.finish()
        })
        .collect()
}

impl Overlap {
    /// The runs of every text in `items` (evaluation items' user turns, without the prompt
    /// templates the harness wraps them in).
    pub fn new<'a>(items: impl IntoIterator<Item = &'a str>) -> Self {
        let mut o = Overlap::default();
        for t in items {
            let r = runs(t);
            if r.is_empty() {
                o.short_items += 1;
            } else {
                o.items += 1;
                o.runs.extend(r);
            }
        }
        o
    }

    /// Whether `text` shares a run of [`NGRAM`] words with an item.
    pub fn hits(&self, text: &str) -> bool {
        runs(text).iter().any(|r| self.runs.contains(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ITEM: &str = "Janet's ducks lay 16 eggs per day. She eats three for breakfast every \
                        morning and bakes muffins for her friends every day with four.";

    #[test]
    fn a_quoted_run_hits_whatever_its_case_spacing_and_punctuation() {
        let o = Overlap::new([ITEM, "Compute 7 + 5."]);
        assert_eq!((o.items, o.short_items), (1, 1));
        assert!(o.hits(ITEM));
        assert!(o.hits(
            "Please help: JANET'S ducks lay 16 eggs per day — she eats three for breakfast!"
        ));
        // twelve of the words are not a run
        assert!(!o.hits("Janet's ducks lay 16 eggs per day. She eats three for lunch."));
        // the short item is not matched, even verbatim
        assert!(!o.hits("Compute 7 + 5."));
        assert!(!o.hits(""));
    }

    #[test]
    fn words_split_on_anything_not_alphanumeric() {
        assert_eq!(words("Janet's ducks, 16!"), ["janet", "s", "ducks", "16"]);
        assert_eq!(words("  "), Vec::<String>::new());
    }
}
