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
//! 12 words does not. A run needs 7 words with a letter ([`MIN_LETTER_WORDS`]): a 0/1 grid in
//! a HumanEval problem and an array in a registry prompt are not a quote. An item with no such
//! run (shorter than 13 words: a short MATH problem) matches a text whose words are exactly its
//! own: the MATH-500 item "How many positive whole-number divisors does 196 have?" (9 words)
//! matches the same problem copied from MATH's test set, whatever its spacing and punctuation,
//! and no longer text (its words are common phrases); such items are counted in
//! [`Overlap::short_items`].

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
    /// The whole word sequences of the short items.
    whole: HashSet<u64>,
    /// Texts that gave at least one run.
    pub items: usize,
    /// Texts with no run (shorter than [`NGRAM`] words): matched by their whole words only.
    pub short_items: usize,
}

/// `text`'s words, lower-cased. Example: "Janet's ducks, 16!" → `janet`, `s`, `ducks`, `16`.
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// Words of a run that must hold a letter: runs of numbers (a 0/1 grid, a table of values)
/// quote no one.
pub const MIN_LETTER_WORDS: usize = 7;

/// One key per window of [`NGRAM`] words (a hash of the words in order), for the windows with
/// at least [`MIN_LETTER_WORDS`] words holding a letter. Example: `1 0 1 0 1 1 0 0 1 1 1 0 1`
/// gives no key; `janet s ducks lay 16 eggs per day she eats three for breakfast` one.
fn runs_of(w: &[String]) -> Vec<u64> {
    w.windows(NGRAM)
        .filter(|win| {
            win.iter()
                .filter(|x| x.chars().any(char::is_alphabetic))
                .count()
                >= MIN_LETTER_WORDS
        })
        .map(key)
        .collect()
}

/// A hash of `w`'s words in order.
fn key(w: &[String]) -> u64 {
    let mut h = DefaultHasher::new();
    w.hash(&mut h);
    h.finish()
}

impl Overlap {
    /// The runs of every text in `items` (evaluation items' user turns, without the prompt
    /// templates the harness wraps them in).
    pub fn new<'a>(items: impl IntoIterator<Item = &'a str>) -> Self {
        let mut o = Overlap::default();
        for t in items {
            let w = words(t);
            let r = runs_of(&w);
            if r.is_empty() {
                o.short_items += 1;
                if !w.is_empty() {
                    o.whole.insert(key(&w));
                }
            } else {
                o.items += 1;
                o.runs.extend(r);
            }
        }
        o
    }

    /// Whether `text` shares a run of [`NGRAM`] words with an item, or its words are a short
    /// item's.
    pub fn hits(&self, text: &str) -> bool {
        let w = words(text);
        runs_of(&w).iter().any(|r| self.runs.contains(r)) || self.whole.contains(&key(&w))
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
        // the short item matches its own words, whatever the spacing and case, and nothing longer
        assert!(o.hits("Compute 7 + 5."));
        assert!(o.hits("  compute 7+5"));
        assert!(!o.hits("Compute 7 + 5 and then 3."));
        assert!(!o.hits("Compute 7 + 6."));
        assert!(!o.hits(""));
    }

    #[test]
    fn runs_of_numbers_quote_no_one() {
        // HumanEval/115's grid and a prompt's 0/1 array share 13 "words" of digits
        let item = "You are given a rectangular grid of wells, and each row represents a single \
                    well: grid = [[0,0,1,0,0,1,0,0,1,1,1,1,0,1]]";
        let o = Overlap::new([item]);
        assert_eq!((o.items, o.short_items), (1, 0));
        assert!(!o.hits("Array: [0,0,1,0,0,1,0,0,1,1,1,1,0,1,1,0]"));
        assert!(o.hits(
            "You are given a rectangular grid of wells and each row represents a single well."
        ));
        // digits alone give no run
        assert_eq!(
            Overlap::new(["0 1 0 1 0 1 0 1 0 1 0 1 0 1 0 1"]).short_items,
            1
        );
    }

    #[test]
    fn words_split_on_anything_not_alphanumeric() {
        assert_eq!(words("Janet's ducks, 16!"), ["janet", "s", "ducks", "16"]);
        assert_eq!(words("  "), Vec::<String>::new());
    }
}
