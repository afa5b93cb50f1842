//! The module dependency graph of both Rust crates, read from their sources, must have no
//! cycle. `cargo test -p kvpool-core --test module_graph -- --nocapture` prints the edges.
//!
//! A module depends on another when its code names a path into it (`use crate::a::b`,
//! `super::x`, `child::f()`, `crate::a::f()`). Nodes are the crate's top-level modules; in
//! the core, the submodules of the larger ones (`SPLIT`) are nodes of their own, so a cycle
//! through a parent and its children shows too. The crate root is left out: it declares
//! and re-exports every module, and what it defines itself (`MAX_NUM_BLOCKS`) depends on
//! nothing. Test-only code (`#[cfg(test)]` items and the files they declare) is left out.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Core modules whose submodules are nodes of their own.
const SPLIT: &[&str] = &["pool", "prefix_cache", "tier", "block_copy"];

#[test]
fn module_graph_of_the_core_is_acyclic() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src, SPLIT);
    print_and_check("kvpool-core", &graph);
    // The layering the design notes describe: the cache and the copy engine know no pool.
    for (from, to) in [
        ("prefix_cache", "pool"),
        ("prefix_cache", "tier"),
        ("prefix_cache", "allocator"),
        ("block_copy", "pool"),
        ("block_copy", "tier"),
        ("pool", "tier"),
    ] {
        let reaches = graph.iter().any(|(a, bs)| top(a) == from && bs.iter().any(|b| top(b) == to));
        assert!(!reaches, "{from} must not depend on {to}");
    }
}

#[test]
fn module_graph_of_the_binding_is_acyclic() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../py/src");
    let graph = module_graph(&src, &[]);
    print_and_check("kvpool (binding)", &graph);
}

type Graph = BTreeMap<String, BTreeSet<String>>;

fn top(node: &str) -> &str {
    node.split("::").next().unwrap_or(node)
}

fn print_and_check(crate_name: &str, graph: &Graph) {
    println!("{crate_name}: module dependencies ({} modules)", graph.len());
    for (from, tos) in graph {
        let tos: Vec<&str> = tos.iter().map(String::as_str).collect();
        println!("  {from} -> {}", if tos.is_empty() { "(none)".into() } else { tos.join(", ") });
    }
    if let Some(cycle) = find_cycle(graph) {
        panic!("{crate_name}: import cycle {}", cycle.join(" -> "));
    }
    println!("{crate_name}: no cycle");
}

/// Every module of the crate rooted at `src` (its path from the root, `""` for the root),
/// with the file that holds it.
fn module_files(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> =
                rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

/// The graph between the nodes (top-level modules, and the children of `split` ones).
fn module_graph(src: &Path, split: &[&str]) -> Graph {
    let files = module_files(src);
    let modules: BTreeSet<String> = files.keys().cloned().collect();
    let mut test_only = BTreeSet::new();
    let mut code = BTreeMap::new();
    for (module, path) in &files {
        let (text, test_children) =
            strip_test_items(&strip_comments_and_strings(&fs::read_to_string(path).unwrap()));
        for child in test_children {
            test_only.insert(join(module, &child));
        }
        code.insert(module.clone(), text);
    }
    let node_of = |module: &str| -> Option<String> {
        let parts: Vec<&str> = module.split("::").filter(|p| !p.is_empty()).collect();
        match parts.as_slice() {
            [] => None,
            [first, second, ..] if split.contains(first) => Some(format!("{first}::{second}")),
            [first, ..] => Some(first.to_string()),
        }
    };
    let mut graph = Graph::new();
    for (module, text) in &code {
        if test_only.iter().any(|t| module == t || module.starts_with(&format!("{t}::"))) {
            continue;
        }
        let Some(from) = node_of(module) else { continue };
        let targets = graph.entry(from.clone()).or_default();
        for path in paths_named(text, module, &modules) {
            if let Some(to) = node_of(&longest_module_prefix(&path, &modules)) {
                if to != from {
                    targets.insert(to);
                }
            }
        }
    }
    graph
}

fn join(module: &str, child: &str) -> String {
    if module.is_empty() {
        child.to_string()
    } else {
        format!("{module}::{child}")
    }
}

fn parent(module: &str) -> String {
    module.rsplit_once("::").map_or(String::new(), |(p, _)| p.to_string())
}

/// The longest prefix of `path` (segments from the crate root) that is a module.
fn longest_module_prefix(path: &[String], modules: &BTreeSet<String>) -> String {
    let mut best = String::new();
    for n in 1..=path.len() {
        let candidate = path[..n].join("::");
        if modules.contains(&candidate) {
            best = candidate;
        }
    }
    best
}

/// Every path in `text` (the code of `module`) that leads into the crate, made absolute.
fn paths_named(text: &str, module: &str, modules: &BTreeSet<String>) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for path in raw_paths(text) {
        let mut base: Vec<String> =
            module.split("::").filter(|p| !p.is_empty()).map(String::from).collect();
        let mut rest = path.as_slice();
        match rest.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &rest[1..];
            }
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    base = parent(&base.join("::"))
                        .split("::")
                        .filter(|p| !p.is_empty())
                        .map(String::from)
                        .collect();
                    rest = &rest[1..];
                }
            }
            Some("self") => rest = &rest[1..],
            // A bare first segment counts only when it names a child module.
            Some(first) if modules.contains(&join(module, first)) => {}
            _ => continue,
        }
        base.extend(rest.iter().cloned());
        out.push(base);
    }
    out
}

/// Paths of two or more segments (`a::b::c`), with `use` trees expanded, each split into
/// segments. A segment right after `::` never starts a path.
fn raw_paths(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if is_ident_start(bytes[i]) && (i == 0 || !is_ident(bytes[i - 1])) {
            let preceded_by_colons = text[..i].trim_end().ends_with("::");
            let (word, end) = ident_at(text, i);
            if word == "use" {
                let stop = text[end..].find(';').map_or(text.len(), |s| end + s);
                expand_use_tree(text[end..stop].trim(), &mut Vec::new(), &mut out);
                i = stop;
                continue;
            }
            if !preceded_by_colons {
                let mut segments = vec![word.to_string()];
                let mut j = end;
                while text[j..].starts_with("::") {
                    let k = j + 2;
                    if k < bytes.len() && is_ident_start(bytes[k]) {
                        let (next, e) = ident_at(text, k);
                        segments.push(next.to_string());
                        j = e;
                    } else {
                        break;
                    }
                }
                if segments.len() > 1 {
                    out.push(segments);
                }
                i = j;
                continue;
            }
            i = end;
            continue;
        }
        i += 1;
    }
    out
}

/// Expands `a::b::{c, d::e, f as g}` into paths, each prefixed by `prefix`.
fn expand_use_tree(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let depth = prefix.len();
        prefix.extend(head);
        for item in split_top_level(inner) {
            expand_use_tree(item, prefix, out);
        }
        prefix.truncate(depth);
        return;
    }
    let item = tree.split(" as ").next().unwrap_or(tree).trim();
    if item.is_empty() {
        return;
    }
    let mut path = prefix.clone();
    path.extend(item.split("::").map(|s| s.trim().to_string()).filter(|s| !s.is_empty()));
    out.push(path);
}

/// Splits `a, b::{c, d}, e` at the commas outside braces.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut items) = (0, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&s[start..]);
    items
}

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}
fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}
fn ident_at(text: &str, start: usize) -> (&str, usize) {
    let end = text[start..].bytes().position(|b| !is_ident(b)).map_or(text.len(), |n| start + n);
    (&text[start..end], end)
}

/// The code without comments, string and char literals (each replaced by a space), so that
/// a path in a doc comment or a message is not a dependency.
fn strip_comments_and_strings(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if text[i..].starts_with("//") {
            i = text[i..].find('\n').map_or(b.len(), |n| i + n);
        } else if text[i..].starts_with("/*") {
            i = text[i + 2..].find("*/").map_or(b.len(), |n| i + 2 + n + 2);
            out.push(' ');
        } else if b[i] == b'r'
            && (text[i + 1..].starts_with('"') || text[i + 1..].starts_with("#\""))
        {
            let hashes = text[i + 1..].bytes().take_while(|&c| c == b'#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + 1 + hashes + 1;
            i = text[body..].find(&close).map_or(b.len(), |n| body + n + close.len());
            out.push(' ');
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else if b[i] == b'\'' && is_char_literal(&text[i..]) {
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// `'x'` or `'\n'` rather than a lifetime `'a`.
fn is_char_literal(s: &str) -> bool {
    let mut chars = s.chars().skip(1);
    match chars.next() {
        Some('\\') => true,
        Some(_) => chars.next() == Some('\''),
        None => false,
    }
}

/// The code without `#[cfg(test)]` items, and the child modules such items declare
/// (`#[cfg(test)] mod tests;`).
fn strip_test_items(text: &str) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut children = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at + "#[cfg(test)]".len()..];
        let semi = item.find(';').unwrap_or(item.len());
        let brace = item.find('{').unwrap_or(item.len());
        if semi < brace {
            let decl = item[..semi].trim();
            if let Some(name) = decl.strip_prefix("mod ").or_else(|| decl.strip_prefix("pub mod "))
            {
                children.push(name.trim().to_string());
            }
            rest = &item[semi + 1..];
            continue;
        }
        let mut depth = 0;
        let mut end = item.len();
        for (i, c) in item[brace..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = brace + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    (out, children)
}

/// A cycle of `graph` as its nodes (the first repeated at the end), if there is one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &Graph,
        marks: &mut BTreeMap<String, Mark>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = stack.iter().position(|n| n == node).unwrap();
                let mut cycle = stack[start..].to_vec();
                cycle.push(node.to_string());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_string(), Mark::Open);
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, marks, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    graph.keys().find_map(|node| visit(node, graph, &mut marks, &mut Vec::new()))
}

#[test]
fn the_parser_sees_use_trees_and_inline_paths_and_finds_a_cycle() {
    let text = strip_comments_and_strings(
        "use crate::{a::X, b::{c::Y, Z as W}};\n// crate::commented::Out\nlet s = \"crate::in_string::S\";\nfn f() { crate::d::g(); child::h(); }",
    );
    let modules: BTreeSet<String> =
        ["a", "b", "b::c", "d", "m", "m::child"].iter().map(|s| s.to_string()).collect();
    let found: BTreeSet<String> = paths_named(&text, "m", &modules)
        .into_iter()
        .map(|p| longest_module_prefix(&p, &modules))
        .collect();
    let expected: BTreeSet<String> =
        ["a", "b", "b::c", "d", "m::child"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, expected);
    let (code, children) = strip_test_items(
        "#[cfg(test)]\nmod tests;\n#[cfg(test)]\nmod inline { use crate::x::Y; }\nuse crate::z::Q;",
    );
    assert_eq!(children, ["tests"]);
    assert!(!code.contains("crate::x") && code.contains("crate::z"));
    let mut graph = Graph::new();
    graph.entry("a".into()).or_default().insert("b".into());
    graph.entry("b".into()).or_default().insert("c".into());
    graph.entry("c".into()).or_default().insert("a".into());
    assert_eq!(find_cycle(&graph).unwrap(), ["a", "b", "c", "a"]);
    graph.get_mut("c").unwrap().clear();
    assert_eq!(find_cycle(&graph), None);
}
