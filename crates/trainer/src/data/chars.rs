//! Characters as tokens (`mtrain prepare --chars`, nanoGPT's shakespeare_char): the vocabulary is
//! the set of characters of the corpus, sorted by code point, and a character's id is its place
//! in that order.
//!
//! ```text
//!   "hello\n"  ->  chars "\nehlo"  ->  ids  h=2 e=1 l=3 l=3 o=4 \n=0
//! ```
//!
//! The vocabulary is written beside the shards as `chars.json` (`{"chars": "\nehlo"}`), which
//! `mtrain sample` reads back to encode the prompt and decode what the model writes.

use std::collections::BTreeMap;
use std::path::Path;

use super::DataError;
use crate::fsio::IoContext;

/// The file holding a character vocabulary in a prepared directory.
pub const CHARS_FILE: &str = "chars.json";

/// A character vocabulary: id `i` is the `i`-th character in code-point order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharVocab {
    chars: Vec<char>,
    ids: BTreeMap<char, u32>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CharsJson {
    chars: String,
}

impl CharVocab {
    /// The vocabulary of `text`: each character it holds, once, sorted.
    pub fn of_text(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Self::from_chars(chars)
    }

    fn from_chars(chars: Vec<char>) -> Self {
        let ids = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        Self { chars, ids }
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// True for the vocabulary of an empty text.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The ids of `text`; a character outside the vocabulary is named in the error.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        text.chars()
            .map(|c| {
                self.ids.get(&c).copied().ok_or_else(|| {
                    DataError::Invalid(format!(
                        "the character {c:?} is not in the corpus's vocabulary of {} characters",
                        self.len()
                    ))
                })
            })
            .collect()
    }

    /// The text of `ids`; an id outside the vocabulary is named in the error.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        ids.iter()
            .map(|&i| {
                self.chars.get(i as usize).copied().ok_or_else(|| {
                    DataError::Invalid(format!(
                        "id {i} is outside the vocabulary of {} characters",
                        self.len()
                    ))
                })
            })
            .collect()
    }

    /// Write `DIR/chars.json`.
    pub fn save(&self, dir: &Path) -> Result<(), DataError> {
        let path = dir.join(CHARS_FILE);
        let json = CharsJson {
            chars: self.chars.iter().collect(),
        };
        let text = serde_json::to_string(&json).map_err(|e| DataError::Format(e.to_string()))?;
        std::fs::write(&path, text).at("writing", &path)?;
        Ok(())
    }

    /// Read a `chars.json`, checking the characters are sorted and distinct.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let text = crate::fsio::read_to_string(path)?;
        let json: CharsJson = serde_json::from_str(&text)
            .map_err(|e| DataError::Format(format!("{}: {e}", path.display())))?;
        let chars: Vec<char> = json.chars.chars().collect();
        if chars.windows(2).any(|w| w[0] >= w[1]) {
            return Err(DataError::Format(format!(
                "{}: the characters are not sorted and distinct",
                path.display()
            )));
        }
        Ok(Self::from_chars(chars))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_the_sorted_characters_and_round_trip() {
        let v = CharVocab::of_text("hello\nwörld");
        assert_eq!(v.decode(&[0, 1, 2]).unwrap(), "\nde");
        let ids = v.encode("hello\nwörld").unwrap();
        assert_eq!(v.decode(&ids).unwrap(), "hello\nwörld");
        assert_eq!(v.len(), 9, "\\n d e h l o r w ö");
        assert_eq!(*ids.iter().max().unwrap(), 8, "ö sorts last");
        let e = v.encode("hi").unwrap_err().to_string();
        assert!(e.contains("'i'") && e.contains("9 characters"), "{e}");
        assert!(v.decode(&[9]).unwrap_err().to_string().contains("id 9"));
        let dir = tempfile::tempdir().unwrap();
        v.save(dir.path()).unwrap();
        assert_eq!(CharVocab::load(&dir.path().join(CHARS_FILE)).unwrap(), v);
        std::fs::write(dir.path().join(CHARS_FILE), "{\"chars\":\"ba\"}").unwrap();
        let e = CharVocab::load(&dir.path().join(CHARS_FILE)).unwrap_err();
        assert!(e.to_string().contains("not sorted"), "{e}");
    }
}
