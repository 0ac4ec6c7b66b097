//! Holds every file of this crate to the layering of `lib.rs`: no file
//! names a module of a higher layer, and no two files (nor two top-level
//! modules) import each other, directly or round a circle.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// Each top-level module's layer: a module may name its own layer's and
/// lower layers' modules only.
const LAYERS: [(&str, u8); 11] = [
    ("config", 0),
    ("sys", 1),
    ("kernel", 2),
    ("net", 2),
    ("huddle", 3),
    ("cluster", 3),
    ("agent", 3),
    ("bench", 3),
    ("status", 4),
    ("daemon", 5),
    ("cli", 5),
];

/// The XDP program's crate (its `huddle` binary; `bin/` holds the other
/// programs, each a crate of its own): helpers, what a packet is, the
/// balancer.
const EBPF_LAYERS: [(&str, u8); 4] = [("csum", 0), ("mem", 0), ("net", 1), ("lb", 2)];

fn layer(layers: &[(&str, u8)], module: &str) -> u8 {
    layers
        .iter()
        .find(|(m, _)| *m == module)
        .unwrap_or_else(|| panic!("module {module} has no layer in layers.rs"))
        .1
}

/// The crate root and the test-only helpers sit outside the layers.
fn outside(module: &[String]) -> bool {
    module
        .first()
        .is_none_or(|m| matches!(m.as_str(), "layers" | "test_rng"))
}

/// Every `.rs` file under `dir`, as (module path, file).
fn files(dir: &Path, prefix: &[String], out: &mut Vec<(Vec<String>, PathBuf)>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if p.is_dir() && name == "bin" && prefix.is_empty() {
            continue;
        } else if p.is_dir() {
            let mut pre = prefix.to_vec();
            pre.push(name);
            files(&p, &pre, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let mut m = prefix.to_vec();
            if !matches!(name.as_str(), "mod" | "lib" | "main") {
                m.push(name);
            }
            out.push((m, p));
        }
    }
}

/// The paths a source names through `crate::`, `super::`, `self::` and
/// its own submodules, resolved against `module` (comments skipped; `use`
/// groups expanded; an inline `mod tests` one level down).
fn references(src: &str, module: &[String]) -> Vec<Vec<String>> {
    match src.find("mod tests {") {
        Some(i) => {
            let mut inner = module.to_vec();
            inner.push("tests".into());
            let mut out = names(&src[..i], module);
            out.extend(names(&src[i..], &inner));
            out
        }
        None => names(src, module),
    }
}

fn names(src: &str, module: &[String]) -> Vec<Vec<String>> {
    let code: String = src
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    // A file's own submodules, named without a prefix (`child::f()`).
    for line in code.lines() {
        let l = line.trim_start().trim_start_matches("pub ").trim_start();
        if let Some(name) = l.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            let kw = format!("{name}::");
            let mut child = module.to_vec();
            child.push(name.to_string());
            let mut at = 0;
            while let Some(i) = code[at..].find(&kw) {
                let start = at + i;
                at = start + kw.len();
                let before = code[..start].chars().last();
                if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                expand(&code[at..], &child, &mut out);
            }
        }
    }
    for (kw, base) in [
        ("crate::", Vec::new()),
        ("super::", module[..module.len().saturating_sub(1)].to_vec()),
        ("self::", module.to_vec()),
    ] {
        let mut at = 0;
        while let Some(i) = code[at..].find(kw) {
            let start = at + i;
            at = start + kw.len();
            if start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_') {
                continue;
            }
            expand(&code[at..], &base, &mut out);
        }
    }
    out
}

/// Reads one path (or one `{...}` group of paths) at the start of `s`.
fn expand(s: &str, base: &[String], out: &mut Vec<Vec<String>>) {
    let s = s.trim_start();
    if let Some(group) = s.strip_prefix('{') {
        let (mut depth, mut item) = (0, String::new());
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&item, base, out);
                    item.clear();
                    continue;
                }
                _ => {}
            }
            item.push(c);
        }
        expand(&item, base, out);
        return;
    }
    let mut path = base.to_vec();
    let mut rest = s;
    loop {
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        path.push(rest[..end].to_string());
        rest = &rest[end..];
        match rest.strip_prefix("::") {
            Some(r) if r.starts_with('{') => return expand(r, &path, out),
            Some(r) => rest = r,
            None => break,
        }
    }
    // `super::*` names the parent itself; an empty item (a group's
    // trailing comma) names nothing.
    if path.len() > base.len() || rest.starts_with('*') {
        out.push(path);
    }
}

#[test]
fn no_file_imports_upward_or_round_a_circle() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    check(&here.join("src"), &LAYERS);
    check(&here.join("../huddle-ebpf/src"), &EBPF_LAYERS);
}

/// Holds the crate under `root` to `layers` and to no circles.
fn check(root: &Path, layers: &[(&str, u8)]) {
    let mut all = Vec::new();
    files(root, &[], &mut all);
    let modules: BTreeSet<Vec<String>> = all.iter().map(|(m, _)| m.clone()).collect();
    // The module file a path lands in: its longest prefix that is a file.
    let owner = |p: &[String]| -> Vec<String> {
        (0..=p.len())
            .rev()
            .map(|n| p[..n].to_vec())
            .find(|m| modules.contains(m))
            .unwrap_or_default()
    };
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for (m, file) in &all {
        let src = fs::read_to_string(file).unwrap();
        if outside(m) {
            continue;
        }
        for r in references(&src, m) {
            let to = owner(&r);
            if outside(&to) || to == *m {
                continue;
            }
            if layer(layers, &to[0]) > layer(layers, &m[0]) {
                wrong.push(format!(
                    "{} names {} (layer {} above {})",
                    file.display(),
                    r.join("::"),
                    layer(layers, &to[0]),
                    layer(layers, &m[0])
                ));
            }
            // A file naming its own parent folder's module is how a child
            // reaches its facade; the facade declaring the child is not an
            // import, so only the reverse direction counts as an edge.
            edges.entry(m.clone()).or_default().insert(to);
        }
    }
    assert!(
        wrong.is_empty(),
        "imports from a higher layer:\n{}",
        wrong.join("\n")
    );

    // Circles between files, and between top-level modules.
    let top: BTreeMap<String, BTreeSet<String>> =
        edges.iter().fold(BTreeMap::new(), |mut acc, (from, tos)| {
            for to in tos {
                if to[0] != from[0] {
                    acc.entry(from[0].clone())
                        .or_default()
                        .insert(to[0].clone());
                }
            }
            acc
        });
    let mutual: Vec<String> = edges
        .iter()
        .flat_map(|(a, tos)| tos.iter().map(move |b| (a, b)))
        .filter(|(a, b)| a < b && edges.get(*b).is_some_and(|t| t.contains(*a)))
        .map(|(a, b)| format!("{} <-> {}", a.join("::"), b.join("::")))
        .collect();
    assert!(
        mutual.is_empty(),
        "files importing each other:\n{}",
        mutual.join("\n")
    );
    if let Some(c) = circle(&edges) {
        panic!("import circle between files: {}", fmt(&c));
    }
    if let Some(c) = circle(&top) {
        panic!("import circle between modules: {}", c.join(" -> "));
    }
}

fn fmt(c: &[Vec<String>]) -> String {
    c.iter()
        .map(|m| m.join("::"))
        .collect::<Vec<_>>()
        .join(" -> ")
}

/// A circle in `g`, if it has one (depth-first, three colours).
fn circle<N: Ord + Clone>(g: &BTreeMap<N, BTreeSet<N>>) -> Option<Vec<N>> {
    fn visit<N: Ord + Clone>(
        n: &N,
        g: &BTreeMap<N, BTreeSet<N>>,
        done: &mut BTreeSet<N>,
        stack: &mut Vec<N>,
    ) -> Option<Vec<N>> {
        if let Some(i) = stack.iter().position(|s| s == n) {
            let mut c = stack[i..].to_vec();
            c.push(n.clone());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n.clone());
        for m in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, g, done, stack) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(n.clone());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|n| visit(n, g, &mut done, &mut Vec::new()))
}

#[test]
fn the_check_sees_an_upward_import_and_a_circle() {
    let m = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    let refs = references(
        "use crate::{config::{Config, Mode}, daemon::lock};\nfn f() { super::x::y(); } // crate::cli",
        &m("kernel::dataplane::load"),
    );
    assert!(refs.contains(&m("config::Config")) && refs.contains(&m("daemon::lock")));
    assert!(refs.contains(&m("kernel::dataplane::x::y")), "{refs:?}");
    assert!(!refs.iter().any(|r| r[0] == "cli"), "comments are skipped");
    let group = references("use super::{x::Y,\n};\n", &m("config::model"));
    assert_eq!(
        group,
        vec![m("config::x::Y")],
        "a trailing comma names no parent"
    );
    let glob = references("use super::*;\n", &m("config::model"));
    assert_eq!(glob, vec![m("config")]);
    let mut g: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    g.entry("a").or_default().insert("b");
    g.entry("b").or_default().insert("c");
    assert!(circle(&g).is_none());
    g.entry("c").or_default().insert("a");
    assert_eq!(circle(&g).unwrap(), vec!["a", "b", "c", "a"]);
}
