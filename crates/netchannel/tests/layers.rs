//! The tree is the architecture (docs/ARCHITECTURE.md): each layer uses only the layers below
//! it, and the pure layers (the codec, the scheduler, the protocol core) own no threads, locks,
//! memory pools or system calls. Read from the sources, so that a `use` that breaks a rule fails
//! CI instead of drifting from the docs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Lowest first: a layer may use itself and those before it.
const LAYERS: [&str; 8] = ["copy", "sys", "wire", "scheduler", "proto", "driver", "engine", "vns"];
/// Layers that must stay sans-IO.
const PURE: [&str; 4] = ["copy", "wire", "scheduler", "proto"];
/// What a pure layer must not mention: threads, locks, atomics, pools, sockets, fds, syscalls
/// (addresses are values: `SocketAddr` is allowed, sockets are not).
const NOT_PURE: [&str; 12] = [
    "parking_lot",
    "Mutex",
    "RwLock",
    "Atomic",
    "std::thread",
    "TcpStream",
    "TcpListener",
    "UdpSocket",
    "std::os",
    "BufPool",
    "libc",
    "rustix",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The file's source without comments (line comments and doc comments).
fn code(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module path of a file under src/ (`proto/session/mod.rs` -> proto::session).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> =
        rel.iter().map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string()).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The top-level modules a file refers to: `crate::x` and `super::...` paths resolved.
fn referenced_layers(module: &[String], code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = code.as_bytes();
    let ident = |s: &str| -> String {
        s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
    };
    for (i, _) in code.match_indices("crate::") {
        let before = if i == 0 { b' ' } else { bytes[i - 1] };
        if before.is_ascii_alphanumeric() || before == b'_' || before == b'$' {
            continue;
        }
        out.insert(ident(&code[i + 7..]));
    }
    for (i, _) in code.match_indices("super::") {
        let before = if i == 0 { b' ' } else { bytes[i - 1] };
        if before == b':' {
            continue; // counted from the first `super`
        }
        let mut rest = &code[i..];
        let mut up = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            up += 1;
            rest = r;
        }
        // A `mod.rs` is its directory's module: `super` from a.rs in dir d is d.
        let base = module.len().saturating_sub(up);
        let top = if base == 0 { ident(rest) } else { module[0].clone() };
        out.insert(top);
    }
    out
}

#[test]
fn each_layer_uses_only_the_layers_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut broken = Vec::new();
    let mut checked = 0;
    for f in &files {
        let module = module_of(&src, f);
        let Some(layer) = module.first() else { continue };
        let Some(rank) = LAYERS.iter().position(|l| l == layer) else { continue };
        checked += 1;
        for used in referenced_layers(&module, &code(f)) {
            if let Some(r) = LAYERS.iter().position(|l| *l == used) {
                if r > rank {
                    broken.push(format!("{} ({layer}) uses {used}", f.display()));
                }
            }
        }
    }
    assert!(checked > 30, "the layers' files were not found ({checked})");
    assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
}

#[test]
fn pure_layers_own_no_threads_locks_pools_or_system_calls() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut broken = Vec::new();
    for layer in PURE {
        let mut files = Vec::new();
        let single = src.join(format!("{layer}.rs"));
        if single.is_file() {
            files.push(single); // a layer of one file
        } else {
            rust_files(&src.join(layer), &mut files);
        }
        assert!(!files.is_empty(), "no files in {layer}");
        for f in files {
            let c = code(&f);
            for word in NOT_PURE {
                if c.contains(word) {
                    broken.push(format!("{} mentions {word}", f.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "I/O or runtime state in a pure layer:\n{}", broken.join("\n"));
}

#[test]
fn unsafe_code_is_only_in_sys() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = Vec::new();
    for f in files {
        if module_of(&src, &f).first().is_some_and(|m| m == "sys") {
            continue;
        }
        if code(&f).split(|c: char| !c.is_alphanumeric() && c != '_').any(|w| w == "unsafe") {
            found.push(f.display().to_string());
        }
    }
    assert!(found.is_empty(), "unsafe outside sys/: {found:?}");
}

#[test]
fn the_checker_sees_a_violation() {
    // proto reaching up into the engine must be caught.
    let module = vec!["proto".to_string(), "session".to_string(), "input".to_string()];
    let used = referenced_layers(&module, "use crate::engine::session::SessionRt;");
    assert!(used.contains("engine"));
    let used = referenced_layers(&module, "use super::super::framing::Parsed;");
    assert_eq!(used, BTreeSet::from(["proto".to_string()]));
    let top = vec!["proto".to_string()];
    let used = referenced_layers(&top, "use super::engine::X;");
    assert!(used.contains("engine"), "super from a top-level module is the crate");
}
