//! The layout of the repository as a reader meets it: no source file too long to read in one
//! sitting, no document pointing at a file that is not there, a README that is a door, and line
//! counts in the documents that are the files' own.
//!
//! ```text
//!   every .rs under crates/*/src                  at most MAX_LINES lines
//!   README.md, ARCHITECTURE.md, docs/*.md,        every repository path they cite exists
//!   the //! docs of crates/*/src/lib.rs
//!   README.md                                     at most 150 lines, with the technique table
//!   README.md, ARCHITECTURE.md's reader's path    every `path (N lines)` is current
//!   each technique's path in ARCHITECTURE.md      at most 4 files and 800 lines
//! ```
//!
//! They walk the working tree and read text only: they take milliseconds.

use std::collections::{BTreeMap, BTreeSet};
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
/// `tests.rs` are left out: a doc link or a test's import is not the module's dependency. The
/// modules of the subcommands' folder (`tools/`, `crate::tools::b`) count as top-level ones.
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
            let mut parts = rel.split('/');
            match parts.next()? {
                "lib.rs" | "main.rs" | "bin" => None,
                "tools" => match parts.next()? {
                    "mod.rs" => Some("tools".to_string()),
                    m => Some(m.trim_end_matches(".rs").to_string()),
                },
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
            let rest = &code[i + "crate::".len()..];
            out.extend(after(rest.strip_prefix("tools::").unwrap_or(rest)));
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

/// One crate's files as modules (`src/a/b.rs` and `src/a/b/mod.rs` are `a::b`, `src/lib.rs` is
/// the root) and which file uses which: `a -> b` when file `a` names an item of module `b` by
/// `crate::`, `super::`, `self::` or a child module's name, in a `use` or in its code. A `pub
/// use` hands names on and is no use of its own; a name taken through one is followed to the
/// module that defines it. A module using its own child modules is no edge (the parts of a
/// folder are the folder); the parts using their parent or each other are. Comments, string
/// literals and trailing test modules are left out.
struct FileGraph {
    /// Module path (`nccl::group`) to its file, relative to `src`.
    files: BTreeMap<String, String>,
    edges: BTreeSet<(String, String)>,
}

impl FileGraph {
    fn of_crate(src: &Path) -> Self {
        let mut files = BTreeMap::new();
        fn walk(src: &Path, dir: &Path, files: &mut BTreeMap<String, String>) {
            for entry in std::fs::read_dir(dir).expect("a source folder") {
                let path = entry.expect("an entry").path();
                let rel = path.strip_prefix(src).expect("under src");
                let rel = rel.to_string_lossy().replace('\\', "/");
                if path.is_dir() {
                    walk(src, &path, files);
                    continue;
                }
                let Some(stem) = rel.strip_suffix(".rs") else {
                    continue;
                };
                if stem == "main" || stem.starts_with("bin/") || stem.ends_with("tests") {
                    continue;
                }
                let module = match stem {
                    "lib" => String::new(),
                    s => s.strip_suffix("/mod").unwrap_or(s).replace('/', "::"),
                };
                files.insert(module, rel);
            }
        }
        walk(src, src, &mut files);
        let codes: BTreeMap<String, String> = files
            .iter()
            .map(|(m, f)| {
                let text = std::fs::read_to_string(src.join(f)).expect("a source file");
                (m.clone(), without_strings(&code_of(&text)))
            })
            .collect();
        let mut graph = Self {
            files,
            edges: BTreeSet::new(),
        };
        for (module, code) in &codes {
            let (uses, _) = split_reexports(code);
            for path in graph.paths_named(module, &uses) {
                let target = graph.defining_module(path, &codes, 0);
                // A module using its own parts (`fsdp` its `fsdp::scheduler`) is how a folder
                // is composed; the parts using each other or their parent are edges.
                let own_part = target.starts_with(&format!("{module}::")) || module.is_empty();
                if target != *module && !own_part {
                    graph.edges.insert((module.clone(), target));
                }
            }
        }
        graph
    }

    /// The absolute paths (from the crate root) that `code` of `module` names.
    fn paths_named(&self, module: &str, code: &str) -> Vec<Vec<String>> {
        let here: Vec<String> = segments(module);
        let children: BTreeSet<String> = self
            .files
            .keys()
            .filter_map(|m| {
                let s = segments(m);
                (s.len() == here.len() + 1 && s.starts_with(&here)).then(|| s[here.len()].clone())
            })
            .collect();
        let mut out = Vec::new();
        for (start, rel) in use_paths(code) {
            let mut base = here.clone();
            let mut rest = rel.as_slice();
            match start.as_str() {
                "crate" => base.clear(),
                "self" => {}
                "super" => {
                    base.pop();
                    while rest.first().is_some_and(|s| s == "super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                }
                child if children.contains(child) => base.push(child.to_string()),
                _ => continue,
            }
            base.extend(rest.iter().cloned());
            out.push(base);
        }
        out
    }

    /// The module whose file defines what `path` names: its longest module prefix, and through
    /// that module's `pub use` when the name is one it hands on.
    fn defining_module(
        &self,
        path: Vec<String>,
        codes: &BTreeMap<String, String>,
        hops: usize,
    ) -> String {
        let mut n = path.len();
        while n > 0 && !self.files.contains_key(&path[..n].join("::")) {
            n -= 1;
        }
        let module = path[..n].join("::");
        let Some(item) = path.get(n) else {
            return module;
        };
        if hops < 8 {
            let (_, reexports) = split_reexports(&codes[&module]);
            for p in self.paths_named(&module, &reexports) {
                if p.last() == Some(item) {
                    return self.defining_module(p, codes, hops + 1);
                }
            }
        }
        module
    }

    /// The files that use each other, directly or around a longer cycle: each group once.
    fn cycles(&self) -> Vec<BTreeSet<String>> {
        let graph = ModuleGraph {
            edges: self.edges.clone(),
        };
        graph
            .cycles()
            .into_iter()
            .map(|g| g.iter().map(|m| self.files[m].clone()).collect())
            .collect()
    }
}

fn segments(module: &str) -> Vec<String> {
    module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// `code` with every string and character literal emptied (a path in a message is no use).
fn without_strings(code: &str) -> String {
    let b: Vec<char> = code.chars().collect();
    let mut out = String::with_capacity(code.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == '"' {
            // A raw string's hashes, if any, precede the quote.
            let hashes = out.chars().rev().take_while(|&h| h == '#').count();
            let raw = out.chars().rev().nth(hashes) == Some('r');
            out.push('"');
            i += 1;
            while i < b.len() {
                if !raw && b[i] == '\\' {
                    i += 2;
                    continue;
                }
                if b[i] == '"'
                    && b[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes
                {
                    break;
                }
                i += 1;
            }
            out.push('"');
            i += 1;
        } else if c == '\'' && i + 2 < b.len() && (b[i + 2] == '\'' || b[i + 1] == '\\') {
            // A character literal ('"', '\n'); a lifetime has no closing quote.
            let end = (i + 2..b.len()).find(|&j| b[j] == '\'').unwrap_or(i + 2);
            out.push_str("' '");
            i = end + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `code` split into (everything but its `pub use` statements, those statements).
fn split_reexports(code: &str) -> (String, String) {
    let (mut uses, mut reexports) = (String::new(), String::new());
    let mut rest = code;
    while let Some(i) = rest.find("pub") {
        let after = &rest[i + 3..];
        let vis_end = match after.strip_prefix('(') {
            Some(a) => a.find(')').map_or(0, |j| j + 2),
            None => 0,
        };
        let stmt = after[vis_end..].trim_start();
        let word_start = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric();
        if word_start && stmt.starts_with("use ") {
            let end = i
                + 3
                + vis_end
                + (after.len() - vis_end - stmt.len())
                + stmt.find(';').map_or(stmt.len(), |j| j + 1);
            uses.push_str(&rest[..i]);
            reexports.push_str(&rest[i..end]);
            reexports.push('\n');
            rest = &rest[end..];
        } else {
            uses.push_str(&rest[..i + 3]);
            rest = &rest[i + 3..];
        }
    }
    uses.push_str(rest);
    (uses, reexports)
}

/// Every path `code` names, as (its first segment, the segments after it), with grouped
/// imports expanded (`a::{b, c::{d, e as f}}`: a::b, a::c::d, a::c::e) and `self` in a group
/// naming the group's module.
fn use_paths(code: &str) -> Vec<(String, Vec<String>)> {
    let chars: Vec<char> = code.chars().collect();
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let boundary = i == 0 || !(is_ident(chars[i - 1]) || chars[i - 1] == ':');
        if !(boundary && is_ident(chars[i])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && is_ident(chars[i]) {
            i += 1;
        }
        let first: String = chars[start..i].iter().collect();
        if chars.get(i) == Some(&':') && chars.get(i + 1) == Some(&':') {
            let mut paths = Vec::new();
            i = tree(&chars, i + 2, Vec::new(), &mut paths);
            out.extend(paths.into_iter().map(|p| (first.clone(), p)));
        }
    }
    out
}

/// Parses the use tree at `chars[i..]` under `prefix` into `out`; returns where it ends.
fn tree(chars: &[char], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let skip_ws = |mut i: usize| {
        while chars.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        i
    };
    i = skip_ws(i);
    if chars.get(i) == Some(&'{') {
        i += 1;
        loop {
            i = skip_ws(i);
            match chars.get(i) {
                Some('}') => return i + 1,
                Some(',') => i += 1,
                None => return i,
                _ => {
                    let before = i;
                    i = tree(chars, i, prefix.clone(), out);
                    if i == before {
                        i += 1;
                    }
                }
            }
        }
    }
    if chars.get(i) == Some(&'*') {
        out.push(prefix);
        return i + 1;
    }
    let start = i;
    while chars.get(i).is_some_and(|&c| is_ident(c)) {
        i += 1;
    }
    let seg: String = chars[start..i].iter().collect();
    if seg.is_empty() {
        out.push(prefix);
        return i;
    }
    let mut path = prefix;
    if seg != "self" {
        path.push(seg);
    }
    if chars.get(i) == Some(&':') && chars.get(i + 1) == Some(&':') {
        return tree(chars, i + 2, path, out);
    }
    out.push(path);
    // `d as e`: the alias names nothing of the crate.
    let j = skip_ws(i);
    if chars
        .get(j..j + 3)
        .is_some_and(|w| w[0] == 'a' && w[1] == 's' && w[2].is_whitespace())
    {
        i = skip_ws(j + 3);
        while chars.get(i).is_some_and(|&c| is_ident(c)) {
            i += 1;
        }
    }
    i
}

/// No file of a crate uses another that uses it back, directly or around a longer cycle:
/// a reader can read a crate bottom-up.
#[test]
fn no_module_cycle_in_any_crate() {
    let root = repo_root();
    let mut found = Vec::new();
    for krate in ["comm", "kernels", "model", "parallel", "trainer"] {
        let graph = FileGraph::of_crate(&root.join("crates").join(krate).join("src"));
        assert!(
            graph.edges.len() > 3,
            "few imports found in crates/{krate}/src: the scan is broken"
        );
        for cycle in graph.cycles() {
            let edges: Vec<String> = graph
                .edges
                .iter()
                .filter(|(a, b)| cycle.contains(&graph.files[a]) && cycle.contains(&graph.files[b]))
                .map(|(a, b)| format!("{a} -> {b}"))
                .collect();
            found.push(format!("{krate}: {cycle:?} ({})", edges.join(", ")));
        }
    }
    assert!(found.is_empty(), "module cycles:\n  {found:?}");
}

/// The rules of who holds what (`parallel/src/placement.rs`) are written once, and the
/// analysis — the cost model, the memory model, `mtrain plan`, the per-rank counts — reads the
/// holdings table (`parallel/src/holdings.rs`) instead of applying them again: no second
/// definition of a rule, no second parse of an expert's name, no rule applied in an analysis
/// file.
#[test]
fn the_holdings_rule_is_written_once() {
    let root = repo_root();
    let paths = repo_paths(&root);
    const RULES: [&str; 11] = [
        "tp_placement",
        "local_numel",
        "used_on_stage",
        "stage_of",
        "owner_of",
        "ep_rank_of_expert",
        "expert_of",
        "split_expert_name",
        "is_expert_param",
        "sp_partial",
        "block_of",
    ];
    const ANALYSIS: [&str; 6] = [
        "crates/parallel/src/analysis",
        "crates/parallel/src/plan.rs",
        "crates/trainer/src/memory",
        "crates/trainer/src/tools/plan.rs",
        "crates/trainer/src/tools/cost.rs",
        "crates/trainer/src/distributed.rs",
    ];
    let placement = "crates/parallel/src/placement.rs";
    let mut found = Vec::new();
    for file in source_files(&paths) {
        if file.ends_with("/tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(root.join(file)).expect("a source file");
        let code = code_of(&text);
        let names_a_rule = |rule: &str| {
            code.match_indices(rule).any(|(i, _)| {
                let before = code[..i].chars().next_back();
                let after = code[i + rule.len()..].chars().next();
                let ident =
                    |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
                !ident(before) && !ident(after)
            })
        };
        for rule in RULES {
            if file != placement && code.contains(&format!("fn {rule}(")) {
                found.push(format!("{file}: a second definition of {rule}"));
            }
            if ANALYSIS.iter().any(|a| file.starts_with(a)) && names_a_rule(rule) {
                found.push(format!("{file}: applies {rule} (read the holdings table)"));
            }
        }
        if file != placement && code.contains("\".moe.experts.\"") {
            found.push(format!(
                "{file}: parses an expert's name (placement::split_expert_name)"
            ));
        }
    }
    assert!(
        found.is_empty(),
        "the holdings rule again:\n  {}",
        found.join("\n  ")
    );
}

/// The argument lists of every call of `.name(` in `code` (what stands between its parentheses).
fn call_args<'a>(code: &'a str, name: &str) -> Vec<&'a str> {
    let call = format!(".{name}(");
    code.match_indices(&call)
        .map(|(i, _)| {
            let start = i + call.len();
            let mut depth = 1;
            let end = code[start..]
                .char_indices()
                .find(|&(_, c)| {
                    depth += match c {
                        '(' => 1,
                        ')' => -1,
                        _ => 0,
                    };
                    depth == 0
                })
                .map_or(code.len(), |(j, _)| start + j);
            &code[start..end]
        })
        .collect()
}

/// Commas outside any bracket: a call's argument count less one.
fn top_level_commas(args: &str) -> usize {
    let mut depth = 0i32;
    args.chars()
        .filter(|&c| {
            depth += match c {
                '(' | '[' | '{' | '<' => 1,
                ')' | ']' | '}' | '>' => -1,
                _ => 0,
            };
            c == ',' && depth == 0
        })
        .count()
}

/// Three things have one home each, and a second is refused:
/// - the plan's check: `ParallelPlan::validate` (model, world, batch: the only three-argument
///   `validate`) is called in `trainer/src/resolve.rs` alone, and the tp split rule
///   (`tp_problems`) is applied by the plan's check alone;
/// - the gradient sync's kinds: only `runtime/grad_sync.rs` chooses by the replicas' kind (the
///   builder makes them, `state.rs` reads the checkpoint state out of them), so the runtime
///   asks the sync and never matches on it;
/// - the MoE layer: `model/src/moe.rs`'s `MoeLayer` is the only MoE feed-forward (the other is
///   the dense `Mlp`); expert parallelism gives it an exchange instead of writing it again.
#[test]
fn the_plan_check_the_sync_and_the_moe_layer_live_once() {
    let root = repo_root();
    let paths = repo_paths(&root);
    let mut found = Vec::new();
    let mut plan_checks = 0;
    for file in source_files(&paths) {
        if file.ends_with("/tests.rs") {
            continue;
        }
        let code = without_strings(&code_of(
            &std::fs::read_to_string(root.join(file)).expect("a source file"),
        ));
        for args in call_args(&code, "validate") {
            if top_level_commas(args) == 2 {
                plan_checks += 1;
                if file != "crates/trainer/src/resolve.rs" {
                    found.push(format!("{file}: checks a plan again (`validate({args})`)"));
                }
            }
        }
        let tp_rule_at = [
            "crates/parallel/src/placement.rs",
            "crates/parallel/src/plan.rs",
        ];
        if code.contains("tp_problems(") && !tp_rule_at.contains(&file) {
            found.push(format!(
                "{file}: applies the tp split rule (tp_problems) again"
            ));
        }
        let sync_at = [
            "crates/parallel/src/runtime/grad_sync.rs",
            "crates/parallel/src/parallelize.rs",
            "crates/parallel/src/state.rs",
        ];
        if (code.contains("Replicas::Full") || code.contains("Replicas::Zero"))
            && !sync_at.contains(&file)
        {
            found.push(format!(
                "{file}: chooses by the replicas' kind (ask runtime/grad_sync.rs)"
            ));
        }
        for line in code.lines().filter(|l| l.contains("impl FeedForward for")) {
            let ty = line.split("for").nth(1).unwrap_or("").trim();
            let home = match ty.trim_end_matches('{').trim() {
                "Mlp" => "crates/model/src/layers.rs",
                "MoeLayer" => "crates/model/src/moe.rs",
                _ => "",
            };
            if file != home {
                found.push(format!(
                    "{file}: a second feed-forward layer ({ty}): use MoeLayer"
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a rule with two homes:\n  {}",
        found.join("\n  ")
    );
    assert_eq!(
        plan_checks, 1,
        "the scan found {plan_checks} plan checks, expected resolve.rs's one"
    );
}

/// The model's segments have one home: every `impl ... Segment for` in the crates' sources is
/// in `model/src/gpt.rs` (the embedding and the head over their vocabulary, a block through
/// `BlockSegment`). A technique gives those segments its pieces (a `BlockSegment`, a
/// vocabulary shard, sharded layers) instead of writing a segment again.
#[test]
fn the_segments_are_written_once_in_the_model() {
    let root = repo_root();
    let paths = repo_paths(&root);
    let mut found = Vec::new();
    for file in source_files(&paths) {
        if file.ends_with("/tests.rs") || file == "crates/model/src/gpt.rs" {
            continue;
        }
        let code = without_strings(&code_of(
            &std::fs::read_to_string(root.join(file)).expect("a source file"),
        ));
        for line in code.lines().filter(|l| l.contains(" Segment for ")) {
            if line.trim_start().starts_with("impl") {
                found.push(format!("{file}: {}", line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a segment written outside the model's gpt.rs (give it a BlockSegment or a \
         vocabulary instead):\n  {}",
        found.join("\n  ")
    );
}

/// The call scan: arguments up to the matching parenthesis, commas counted at the top level.
#[test]
fn the_call_scan_counts_arguments() {
    let code = "x.validate(); plan.validate(&m, f(a, b), [1, 2]); d.validate(w)";
    let args = call_args(code, "validate");
    assert_eq!(args, ["", "&m, f(a, b), [1, 2]", "w"]);
    let commas: Vec<usize> = args.iter().map(|a| top_level_commas(a)).collect();
    assert_eq!(commas, [0, 2, 0]);
}

/// The file scan on small trees: a grouped import, `super::` from a folder, a child module by
/// name, a name followed through a `pub use`, and a path in a string left out.
#[test]
fn the_file_scan_follows_uses_and_reexports() {
    let paths: Vec<(String, Vec<String>)> =
        use_paths("use crate::{a::{self, B}, c::d as e};\nlet x = super::super::f::g();");
    let flat: Vec<String> = paths
        .iter()
        .map(|(s, p)| format!("{s}::{}", p.join("::")))
        .collect();
    assert_eq!(
        flat,
        [
            "crate::a",
            "crate::a::B",
            "crate::c::d",
            "super::super::f::g"
        ]
    );
    assert_eq!(
        without_strings(r#"f("crate::x", '"') + crate::y"#),
        r#"f("", ' ') + crate::y"#
    );
    let (uses, re) =
        split_reexports("pub use x::Y;\npub(crate) use z::W;\nuse q::R;\npub fn f() {}");
    assert_eq!(re, "pub use x::Y;\npub(crate) use z::W;\n");
    assert!(uses.contains("use q::R;") && uses.contains("pub fn f"));
    let dir = std::env::temp_dir().join(format!("structure-scan-{}", std::process::id()));
    let write = |p: &str, text: &str| {
        let path = dir.join(p);
        std::fs::create_dir_all(path.parent().expect("a folder")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    };
    write("lib.rs", "mod a;\nmod b;\npub use b::Thing;\n");
    write("a.rs", "use crate::Thing;\n");
    write(
        "b/mod.rs",
        "mod inner;\npub use inner::Thing;\npub fn helper() {}\n",
    );
    write(
        "b/inner.rs",
        "pub struct Thing;\nfn f() { super::helper() }\n",
    );
    let graph = FileGraph::of_crate(&dir);
    let edges: Vec<String> = graph
        .edges
        .iter()
        .map(|(a, b)| format!("{a} -> {b}"))
        .collect();
    assert_eq!(edges, ["a -> b::inner", "b::inner -> b"]);
    assert!(graph.cycles().is_empty());
    write("b/other.rs", "pub fn g() { super::inner::Thing; }\n");
    write(
        "b/inner.rs",
        "pub struct Thing;\nfn f() { super::other::g() }\n",
    );
    let graph = FileGraph::of_crate(&dir);
    let cycles = graph.cycles();
    assert_eq!(cycles.len(), 1, "{:?}", graph.edges);
    assert!(cycles[0].contains("b/inner.rs") && cycles[0].contains("b/other.rs"));
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// The most lines the README may have: it is a door, not a manual (the rest is in `docs/`).
const README_MAX_LINES: usize = 150;

/// The techniques the README's table and the codemap's reader's path cover, as their rows and
/// sections name them.
const TECHNIQUES: [&str; 6] = ["DDP", "FSDP", "TP", "pipeline", "experts", "context parallel"];

/// The heading of ARCHITECTURE.md's section that walks each technique's files.
const READERS_PATH: &str = "## The reader's path per technique";

/// A technique's path from the README to the collectives its step issues: at most this many
/// files and lines, kernels and tests aside.
const PATH_MAX_FILES: usize = 4;
const PATH_MAX_LINES: usize = 800;

/// Techniques whose path is over the budget today, each with the reason. The check fails when
/// one of them fits again, so the entry is removed as soon as it is not needed.
const OVER_BUDGET: [(&str, &str); 0] = [];

/// Every `path (N lines)` in `text`, in order: the path as written (a word of path characters
/// right before ` (`, a closing backtick allowed) and N.
fn line_counts(text: &str) -> Vec<(String, usize)> {
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut out = Vec::new();
    for (i, _) in text.match_indices(" lines)") {
        let before = &text[..i];
        let Some(open) = before.rfind('(') else {
            continue;
        };
        let digits = &before[open + 1..];
        if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let Some(head) = before[..open].strip_suffix(' ') else {
            continue;
        };
        let head = head.trim_end_matches('`');
        let start = head
            .char_indices()
            .rev()
            .find(|&(_, c)| !is_path_char(c))
            .map_or(0, |(j, c)| j + c.len_utf8());
        let path = &head[start..];
        if path.contains('/') || path.contains('.') {
            out.push((path.to_string(), digits.parse().expect("digits")));
        }
    }
    out
}

/// The lines of a file as `wc -l` counts them: its newline characters.
fn wc_l(text: &str) -> usize {
    text.matches('\n').count()
}

/// ARCHITECTURE.md's reader's path: (technique, its section's text), one per `###` under
/// [`READERS_PATH`].
fn readers_path(codemap: &str) -> Vec<(String, String)> {
    let Some(start) = codemap.find(READERS_PATH) else {
        return Vec::new();
    };
    let section = &codemap[start + READERS_PATH.len()..];
    let section = section.find("\n## ").map_or(section, |end| &section[..end]);
    section
        .split("\n### ")
        .skip(1)
        .map(|part| {
            let (name, body) = part.split_once('\n').unwrap_or((part, ""));
            (name.trim().to_string(), body.to_string())
        })
        .collect()
}

/// Whether a path is a kernel or a test, which a technique's line budget leaves aside.
fn outside_the_budget(path: &str) -> bool {
    path.starts_with("crates/kernels/") || path.contains("/tests/") || path.ends_with("/tests.rs")
}

/// The README is a door: at most [`README_MAX_LINES`] lines, with the table that takes a reader
/// from each technique to its files (with their line counts), its paper, its test and a command.
#[test]
fn readme_is_a_door_with_the_technique_table() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let n = wc_l(&readme);
    assert!(
        n <= README_MAX_LINES,
        "README.md has {n} lines, over {README_MAX_LINES}: move the detail into a page of docs/ \
         and leave a link"
    );
    let header = readme
        .lines()
        .find(|l| l.starts_with('|') && l.contains("technique") && l.contains("files to read"))
        .expect(
            "README.md has no table whose header names `technique` and `files to read`: \
             the reader's table (technique | files to read | paper | equals one device | run it)",
        );
    for column in ["paper", "equals one device", "run it"] {
        assert!(
            header.contains(column),
            "README.md's technique table has no `{column}` column: {header}"
        );
    }
    for technique in TECHNIQUES {
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| {technique}")))
            .unwrap_or_else(|| panic!("README.md's table has no row for {technique}"));
        assert!(
            !line_counts(row).is_empty() && row.contains("tests/") && row.contains("mtrain "),
            "README.md's row for {technique} needs its files as `path (N lines)`, its test \
             file and a command: {row}"
        );
    }
}

/// Every `path (N lines)` that the README and ARCHITECTURE.md's reader's path name is a file
/// of the repository with N lines, so that a move or an edit of a file shows up here.
#[test]
fn the_line_counts_the_docs_give_are_current() {
    let root = repo_root();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).expect("a document");
    let readme = read("README.md");
    let codemap = read("ARCHITECTURE.md");
    let sections = readers_path(&codemap);
    let mut named = vec![("README.md", line_counts(&readme))];
    for (_, body) in &sections {
        named.push(("ARCHITECTURE.md", line_counts(body)));
    }
    let total: usize = named.iter().map(|(_, counts)| counts.len()).sum();
    assert!(
        total >= 2 * TECHNIQUES.len(),
        "only {total} `path (N lines)` found in README.md and ARCHITECTURE.md: the scan is broken"
    );
    let mut stale = Vec::new();
    for (doc, counts) in named {
        for (path, said) in counts {
            match std::fs::read_to_string(root.join(&path)) {
                Err(_) => stale.push(format!(
                    "{doc} names {path} ({said} lines), which is not a file of the repository: \
                     write the path it has now"
                )),
                Ok(text) if wc_l(&text) != said => stale.push(format!(
                    "{doc} says {path} ({said} lines); it has {} lines now: write ({} lines) \
                     there, and read the prose around it again",
                    wc_l(&text),
                    wc_l(&text)
                )),
                Ok(_) => {}
            }
        }
    }
    assert!(
        stale.is_empty(),
        "line counts the documents give are out of date:\n  {}",
        stale.join("\n  ")
    );
}

/// ARCHITECTURE.md walks each technique from the README to the collectives its step issues in
/// at most [`PATH_MAX_FILES`] files and [`PATH_MAX_LINES`] lines, kernels and tests aside;
/// [`OVER_BUDGET`] names the paths that do not fit yet, and an entry that fits fails too.
#[test]
fn each_techniques_path_fits_in_4_files_and_800_lines() {
    let root = repo_root();
    let codemap = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let sections = readers_path(&codemap);
    let mut problems = Vec::new();
    for technique in TECHNIQUES {
        let named = |n: &String| n.to_lowercase().starts_with(&technique.to_lowercase());
        let Some((name, body)) = sections.iter().find(|(n, _)| named(n)) else {
            problems.push(format!(
                "ARCHITECTURE.md's \"{READERS_PATH}\" has no `### {technique}` section"
            ));
            continue;
        };
        let files: Vec<(String, usize)> = line_counts(body)
            .into_iter()
            .filter(|(p, _)| !outside_the_budget(p))
            .collect();
        let lines: usize = files.iter().map(|(_, n)| n).sum();
        let fits = !files.is_empty() && files.len() <= PATH_MAX_FILES && lines <= PATH_MAX_LINES;
        let excused = OVER_BUDGET.iter().find(|(t, _)| *t == technique);
        match (fits, excused) {
            (true, Some(_)) => problems.push(format!(
                "{name}: {} files, {lines} lines now fit the budget: remove it from OVER_BUDGET",
                files.len()
            )),
            (false, None) => problems.push(format!(
                "{name}: {} files, {lines} lines, over the budget of {PATH_MAX_FILES} files and \
                 {PATH_MAX_LINES} lines (kernels and tests aside): split the files by concern, \
                 or walk the path through fewer",
                files.len()
            )),
            _ => {}
        }
    }
    assert!(
        problems.is_empty(),
        "the reader's path per technique:\n  {}",
        problems.join("\n  ")
    );
}

/// The scan of `path (N lines)`: a table cell, a list item, a path in backticks; and what is
/// not a count (a parenthesis of other words, a count with no path before it).
#[test]
fn the_line_count_scan_reads_paths_and_counts() {
    let text = "| DDP | crates/parallel/src/ddp.rs (93 lines)<br>crates/a/b.rs (7 lines) |\n\
                1. `crates/model/src/explicit.rs` (346 lines): the tape\n\
                a note (3 lines) and (many lines) and x.rs (12 lines, kept)";
    let got = line_counts(text);
    let want: Vec<(String, usize)> = [
        ("crates/parallel/src/ddp.rs", 93),
        ("crates/a/b.rs", 7),
        ("crates/model/src/explicit.rs", 346),
    ]
    .into_iter()
    .map(|(p, n)| (p.to_string(), n))
    .collect();
    assert_eq!(got, want);
    assert_eq!(wc_l("a\nb\n"), 2);
    assert_eq!(wc_l("a\nb"), 1);
    let codemap = "# x\n## The reader's path per technique\nintro\n### DDP\n1. a.rs (1 lines)\n\
                   ### TP\n2. b.rs (2 lines)\n## Next\n### Other\n";
    let sections = readers_path(codemap);
    let names: Vec<&str> = sections.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["DDP", "TP"]);
    assert!(outside_the_budget("crates/kernels/src/attention.rs"));
    assert!(outside_the_budget("crates/parallel/tests/tp.rs"));
    assert!(!outside_the_budget("crates/parallel/src/ddp.rs"));
}
