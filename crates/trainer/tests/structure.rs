//! The layout of the repository as a reader meets it: no source file too long to read in one
//! sitting, and no document pointing at a file that is not there.
//!
//! ```text
//!   every .rs under crates/*/src                  at most MAX_LINES lines
//!   README.md, ARCHITECTURE.md, docs/*.md,        every repository path they cite exists
//!   the //! docs of crates/*/src/lib.rs
//! ```
//!
//! Both walk the working tree and read text only: they take milliseconds.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The longest a source file may be.
const MAX_LINES: usize = 700;

/// Extensions a citation of a repository file ends in.
const CITED_EXTENSIONS: [&str; 6] = [".rs", ".md", ".toml", ".sh", ".py", ".cu"];

/// Top-level folders whose paths are citations whatever they end in (a folder, a file).
const CITED_ROOTS: [&str; 4] = ["crates/", "configs/", "scripts/", "docs/"];

/// Flags whose argument is a file a command writes, not one the repository holds.
const OUTPUT_FLAGS: [&str; 6] = ["--fit", "--out", "--json", "--run-dir", "-o", ">"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every file and folder under `root`, as `/`-separated paths relative to it (folders with a
/// trailing `/`), skipping build output and version control.
fn repo_paths(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            let rel = path.strip_prefix(root).expect("under the root");
            let rel = rel.to_string_lossy().replace('\\', "/");
            if rel == "target" || rel == ".git" {
                continue;
            }
            if path.is_dir() {
                out.insert(format!("{rel}/"));
                walk(root, &path, out);
            } else {
                out.insert(rel);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

/// The `.rs` files under `crates/*/src`.
fn source_files(paths: &BTreeSet<String>) -> Vec<&str> {
    paths
        .iter()
        .map(String::as_str)
        .filter(|p| p.starts_with("crates/") && p.ends_with(".rs"))
        .filter(|p| p.split('/').nth(2) == Some("src"))
        .collect()
}

#[test]
fn no_source_file_is_over_700_lines() {
    let root = repo_root();
    let paths = repo_paths(&root);
    let sources = source_files(&paths);
    assert!(
        sources.iter().any(|p| *p == "crates/trainer/src/lib.rs"),
        "the walk found no source files under {}",
        root.display()
    );
    let long: Vec<String> = sources
        .iter()
        .filter_map(|p| {
            let text = std::fs::read_to_string(root.join(p)).expect("a source file");
            let n = text.lines().count();
            (n > MAX_LINES).then(|| format!("{p}: {n} lines"))
        })
        .collect();
    assert!(
        long.is_empty(),
        "source files over {MAX_LINES} lines (split them by concern):\n  {}",
        long.join("\n  ")
    );
}

/// `text` without its URLs (an address cites another site, not this repository).
fn without_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("http://").or_else(|| rest.find("https://")) {
        out.push_str(&rest[..i]);
        let end = rest[i..]
            .find(|c: char| c.is_whitespace() || matches!(c, ')' | '>' | '`' | '"'))
            .map_or(rest.len(), |j| i + j);
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// A placeholder, not a name: `<machine>.toml`, `pipeline-rank{N}.jsonl`, `crates/*/src`, or a
/// folder written in capitals, `PREFIX/env.sh`, `RUN_DIR/loss.svg` (a file in capitals is a
/// name: `README.md`).
fn is_placeholder(token: &str) -> bool {
    let folders = token.rsplit_once('/').map_or("", |(folders, _)| folders);
    token.contains(['<', '>', '{', '}', '*'])
        || folders.split('/').any(|part| {
            part.len() > 1
                && part.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                && part.chars().any(|c| c.is_ascii_uppercase())
        })
}

/// The repository paths `text` cites: words ending in a source or document extension, and
/// words starting with one of [`CITED_ROOTS`]; URLs, placeholders and the files a command in
/// `text` writes (the argument of one of [`OUTPUT_FLAGS`]) are not citations.
fn citations(text: &str) -> BTreeSet<String> {
    let text = without_urls(text);
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_./-<>{}*".contains(c);
    let words: Vec<&str> = text
        .split(|c: char| !is_path_char(c))
        .map(|w| w.trim_end_matches(['.', '-']))
        .filter(|w| !w.is_empty())
        .collect();
    let written: BTreeSet<&str> = text
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| OUTPUT_FLAGS.contains(&w[0]))
        .map(|w| w[1].trim_matches(|c: char| !is_path_char(c)))
        .collect();
    words
        .into_iter()
        .filter(|w| {
            CITED_EXTENSIONS
                .iter()
                .any(|e| w.ends_with(e) && w.len() > e.len())
                || CITED_ROOTS.iter().any(|r| w.starts_with(r))
        })
        .filter(|w| !is_placeholder(w) && !written.contains(w))
        .map(str::to_string)
        .collect()
}

/// Whether `cited` names a file or folder in `paths`: as written from the root, as the tail of
/// a longer path (`memory/kept.rs`, `ring.rs`), or as a crate's shorthand (`parallel/ddp.rs` for
/// `crates/parallel/src/ddp.rs`).
fn exists(cited: &str, paths: &BTreeSet<String>) -> bool {
    let cited = cited.trim_end_matches('/');
    let mut forms = vec![cited.to_string()];
    if let Some((krate, rest)) = cited.split_once('/') {
        forms.push(format!("crates/{krate}/src/{rest}"));
    }
    forms.iter().any(|f| {
        paths.iter().any(|p| {
            let p = p.trim_end_matches('/');
            p == f || p.ends_with(&format!("/{f}"))
        })
    })
}

/// The documents a reader is pointed to: the README, the codemap, docs/, and each crate's
/// lib.rs map (its `//!` lines).
fn documents(root: &Path, paths: &BTreeSet<String>) -> Vec<(String, String)> {
    let read = |p: &str| std::fs::read_to_string(root.join(p)).expect("a document");
    let mut docs = vec![
        ("README.md".to_string(), read("README.md")),
        ("ARCHITECTURE.md".to_string(), read("ARCHITECTURE.md")),
    ];
    for p in paths {
        let in_docs = p.starts_with("docs/") && p.ends_with(".md") && p.matches('/').count() == 1;
        let lib = p.starts_with("crates/") && p.ends_with("/src/lib.rs");
        if in_docs {
            docs.push((p.clone(), read(p)));
        } else if lib {
            let text = read(p);
            let doc: Vec<&str> = text
                .lines()
                .filter(|l| l.trim_start().starts_with("//!"))
                .collect();
            docs.push((p.clone(), doc.join("\n")));
        }
    }
    docs
}

#[test]
fn docs_cite_only_files_in_the_repo() {
    let root = repo_root();
    let paths = repo_paths(&root);
    let docs = documents(&root, &paths);
    let mut cited = 0;
    let mut missing = Vec::new();
    for (doc, text) in &docs {
        for c in citations(text) {
            cited += 1;
            if !exists(&c, &paths) {
                missing.push(format!("{doc}: {c}"));
            }
        }
    }
    // The README and the codemap cite dozens of files: finding none means the scan is broken.
    assert!(
        cited > 50,
        "only {cited} citations found in {} documents",
        docs.len()
    );
    assert!(
        missing.is_empty(),
        "documents cite files that are not in the repository:\n  {}",
        missing.join("\n  ")
    );
}

/// The scan itself: what counts as a citation, and how a citation is resolved.
#[test]
fn the_citation_scan_reads_paths_as_a_reader_would() {
    let text = "See `crates/comm/src/cpu/ring.rs`, then parallel/ddp.rs and `memory/kept.rs`.\n\
                The folder crates/comm/src/nccl/ holds it; gone.rs is not here.\n\
                https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md\n\
                mtrain bench-comm --fit configs/alpha-beta/mybox.toml; `PREFIX/env.sh`, <machine>.toml";
    let got = citations(text);
    let want: BTreeSet<String> = [
        "crates/comm/src/cpu/ring.rs",
        "parallel/ddp.rs",
        "memory/kept.rs",
        "crates/comm/src/nccl/",
        "gone.rs",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(got, want);
    let paths: BTreeSet<String> = [
        "crates/",
        "crates/comm/src/cpu/ring.rs",
        "crates/comm/src/nccl/",
        "crates/parallel/src/ddp.rs",
        "crates/trainer/src/memory/kept.rs",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let missing: Vec<&String> = got.iter().filter(|c| !exists(c, &paths)).collect();
    assert_eq!(missing, ["gone.rs"]);
    assert!(!exists("kept.rs/extra.rs", &paths) && !exists("ept.rs", &paths));
}

/// One crate's modules and which of them each imports: `a -> b` when a file of top-level
/// module `a` (its own file or any file under its folder) names `crate::b` (or reaches `b`
/// through enough `super::`s). Comments, the trailing `#[cfg(test)] mod tests` and a module's
/// `tests.rs` are left out: a doc link or a test's import is not the module's dependency.
struct ModuleGraph {
    edges: BTreeSet<(String, String)>,
}

impl ModuleGraph {
    fn of_crate(src: &Path, paths: &BTreeSet<String>, root: &Path) -> Self {
        let prefix = format!(
            "{}/",
            src.strip_prefix(root).expect("under the root").display()
        );
        let top_of = |rel: &str| -> Option<String> {
            let first = rel.split('/').next()?;
            match first {
                "lib.rs" | "main.rs" | "bin" => None,
                f => Some(f.trim_end_matches(".rs").to_string()),
            }
        };
        let files: Vec<&str> = paths
            .iter()
            .filter_map(|p| p.strip_prefix(&prefix))
            .filter(|p| p.ends_with(".rs"))
            // A module's test file (`a/tests.rs`) is its trailing test module moved out.
            .filter(|p| !p.ends_with("/tests.rs"))
            .collect();
        let modules: BTreeSet<String> = files.iter().filter_map(|f| top_of(f)).collect();
        let mut edges = BTreeSet::new();
        for file in &files {
            let Some(top) = top_of(file) else { continue };
            let depth = file.split('/').count() - usize::from(file.ends_with("/mod.rs"));
            let text = std::fs::read_to_string(src.join(file)).expect("a source file");
            for name in imported_modules(&code_of(&text), depth) {
                if name != top && modules.contains(&name) {
                    edges.insert((top.clone(), name));
                }
            }
        }
        Self { edges }
    }

    /// Modules `from` imports directly or through others.
    fn reachable(&self, from: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for (a, b) in &self.edges {
                if *a == m && seen.insert(b.clone()) {
                    todo.push(b.clone());
                }
            }
        }
        seen
    }

    /// The modules that import each other, directly or around a longer cycle: each group once.
    fn cycles(&self) -> Vec<BTreeSet<String>> {
        let nodes: BTreeSet<&String> = self.edges.iter().map(|(a, _)| a).collect();
        let mut groups: Vec<BTreeSet<String>> = Vec::new();
        for n in nodes {
            let out = self.reachable(n);
            if !out.contains(n.as_str()) || groups.iter().any(|g| g.contains(n.as_str())) {
                continue;
            }
            let group = out
                .into_iter()
                .filter(|m| self.reachable(m).contains(n.as_str()))
                .collect();
            groups.push(group);
        }
        groups
    }
}

/// A file's code: without its trailing test module and without comments.
fn code_of(text: &str) -> String {
    let text = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |i| &text[..i]);
    text.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The crate-level modules `code` names: `crate::a`, `crate::{a, b::c}`, and from a file
/// `depth` folders below `src` (1 for `src/a.rs`), `super::…::a` with at least `depth` supers.
fn imported_modules(code: &str, depth: usize) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    // `{a, b::{c, d}, e}` at the start of `s`: a, b, e.
    let group = |s: &str| -> Vec<String> {
        let (mut depth, mut items, mut item) = (0, Vec::new(), String::new());
        for c in s.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 1 => break,
                '}' => depth -= 1,
                ',' if depth == 1 => items.push(std::mem::take(&mut item)),
                _ if depth == 1 => item.push(c),
                _ => {}
            }
        }
        items.push(item);
        items.iter().map(|i| ident(i)).collect()
    };
    let after = |rest: &str| -> Vec<String> {
        match rest.strip_prefix('{') {
            Some(_) => group(rest),
            None => vec![ident(rest)],
        }
    };
    let mut out = BTreeSet::new();
    let starts_word = |i: usize| {
        i == 0 || {
            let c = code.as_bytes()[i - 1];
            !(c.is_ascii_alphanumeric() || c == b'_' || c == b':')
        }
    };
    for (i, _) in code.match_indices("crate::") {
        if starts_word(i) {
            out.extend(after(&code[i + "crate::".len()..]));
        }
    }
    for (i, _) in code.match_indices("super::") {
        if !starts_word(i) {
            continue;
        }
        let mut rest = &code[i..];
        let mut supers = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            rest = r;
            supers += 1;
        }
        if supers >= depth {
            out.extend(after(rest));
        }
    }
    out.retain(|m| !m.is_empty() && m != "self" && m != "super");
    out
}

/// Modules that must not import each other do not: in each crate, neither module of a pair
/// reaches the other and back, directly or around a longer cycle. (`layers <-> kernels` cannot return as
/// long as the kernels are a crate of their own: cargo refuses a cycle between crates.)
#[test]
fn these_modules_do_not_import_each_other() {
    let root = repo_root();
    let paths = repo_paths(&root);
    let removed = [
        ("model", "gpt", "explicit"),
        ("parallel", "ddp", "mixed_precision"),
        ("trainer", "cli", "parity"),
        ("trainer", "cli", "plan"),
        ("trainer", "cli", "cost"),
        ("trainer", "launch", "layout"),
    ];
    let mut back = Vec::new();
    for krate in ["comm", "kernels", "model", "parallel", "trainer"] {
        let graph =
            ModuleGraph::of_crate(&root.join("crates").join(krate).join("src"), &paths, &root);
        assert!(
            !graph.edges.is_empty(),
            "no imports found in crates/{krate}/src: the scan is broken"
        );
        let cycles = graph.cycles();
        for (k, a, b) in removed.iter().filter(|r| r.0 == krate) {
            let a_to_b = graph.reachable(a).contains(*b);
            let b_to_a = graph.reachable(b).contains(*a);
            if a_to_b && b_to_a {
                back.push(format!(
                    "{k}: {a} <-> {b} (cycles in the crate: {cycles:?})"
                ));
            }
        }
    }
    assert!(
        back.is_empty(),
        "modules import each other:\n  {}",
        back.join("\n  ")
    );
}

/// The import scan on a small file: grouped and nested imports, `super::` from a folder, and
/// comments and tests left out.
#[test]
fn the_import_scan_reads_use_lines() {
    let code = code_of(
        "use crate::{config::TrainConfig, layout::{self, Layout}, plan};\n\
         use super::super::train::run; // crate::progress in a comment\n\
         use super::sibling::x;\n\
         let n = crate::cost::today();\n\
         let m = mtrain_crate::ignored();\n\
         #[cfg(test)]\nmod tests {\n    use crate::parity;\n}\n",
    );
    let two_down: Vec<String> = imported_modules(&code, 2).into_iter().collect();
    assert_eq!(two_down, ["config", "cost", "layout", "plan", "train"]);
    let one_down: Vec<String> = imported_modules(&code, 1).into_iter().collect();
    assert_eq!(
        one_down,
        ["config", "cost", "layout", "plan", "sibling", "train"]
    );
}
