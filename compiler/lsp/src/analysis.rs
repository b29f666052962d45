//! Documents, the files they import, and where each source file of a check lives as a URI.
//!
//! A document is checked with `braid_sema::check` under its file-system path, so that
//! `use "./x.rlhf"` resolves like `braid check` resolves it; imports are served from the open
//! documents first (an unsaved edit wins over the disk) and from the disk otherwise. Standard
//! library modules have no file of their own: they are written once to a cache directory so
//! that "go to definition" can open them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use braid_diagnostics::{FileId, SourceFile, Span};
use braid_sema::{Checked, Loader};
use lsp_types::{Location, Uri};

use crate::position;

/// One open document and the result of checking it.
pub struct Document {
    pub uri: Uri,
    /// The name the checker knows it by: its path for `file:` URIs, else the URI itself.
    pub name: String,
    pub version: i32,
    pub text: String,
    pub checked: Checked,
    /// The program of the last version without syntax errors, while this one has some: a
    /// half-typed body is skipped by the parser's recovery, and completion still wants its
    /// locals.
    pub last_parsed: Option<Box<braid_sema::hir::Program>>,
}

impl Document {
    /// Whether the parser had to skip text (codes `E01xx`).
    pub fn has_syntax_errors(&self) -> bool {
        self.checked
            .diagnostics
            .iter()
            .any(|d| d.code.as_str().starts_with("E01"))
    }

    /// Carries the last program without syntax errors over from the version this one replaces.
    pub fn inherit(&mut self, old: Document) {
        if self.has_syntax_errors() {
            self.last_parsed = if old.has_syntax_errors() {
                old.last_parsed
            } else {
                Some(Box::new(old.checked.program))
            };
        }
    }
}

impl Document {
    /// The root file of the check (the document itself).
    pub fn file(&self) -> Option<&SourceFile> {
        self.checked.sources.get(self.checked.program.root)
    }

    pub fn root(&self) -> FileId {
        self.checked.program.root
    }
}

/// Reads imports from the open documents, then from the disk.
pub struct WorkspaceLoader<'a> {
    pub open: &'a BTreeMap<String, String>,
}

impl Loader for WorkspaceLoader<'_> {
    fn load(&self, from: &str, path: &str) -> Result<(String, String), String> {
        let name = braid_sema::join(from, path);
        if let Some(text) = self.open.get(&name) {
            return Ok((name, text.clone()));
        }
        std::fs::read_to_string(&name)
            .map(|t| (name.clone(), t))
            .map_err(|e| e.to_string())
    }
}

/// The checker's name for a document URI: the decoded path of a `file:` URI, else the URI.
pub fn name_of(uri: &Uri) -> String {
    let s = uri.as_str();
    match s.strip_prefix("file://") {
        Some(rest) => {
            // `file://host/path`: the path starts at the first slash.
            let path = rest.find('/').map_or(rest, |i| &rest[i..]);
            percent_decode(path)
        }
        None => s.to_string(),
    }
}

/// A `file:` URI for an absolute path.
pub fn uri_of_path(path: &str) -> Option<Uri> {
    let mut s = String::from("file://");
    if !path.starts_with('/') {
        s.push('/');
    }
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s.parse().ok()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = s.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The directory the standard library is written to: `$XDG_CACHE_HOME/braid/std`, else
/// `~/.cache/braid/std`, else `braid-std` in the temporary directory.
fn std_dir() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| Path::new(&h).join(".cache"))
        });
    match cache {
        Some(c) => c.join("braid").join("std"),
        None => std::env::temp_dir().join("braid-std"),
    }
}

/// Writes the embedded standard library to the cache once per process (rewriting a file only
/// when its contents differ, so a newer braid updates an older cache) and returns the folder,
/// or `None` when it cannot be written.
pub fn std_cache() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std_dir();
        std::fs::create_dir_all(&dir).ok()?;
        for m in braid_stdlib::MODULES {
            let path = dir.join(format!("{}.rlhf", m.name));
            if std::fs::read_to_string(&path).ok().as_deref() != Some(m.source) {
                std::fs::write(&path, m.source).ok()?;
            }
        }
        Some(dir)
    })
    .as_deref()
}

impl Document {
    /// The URI of a source file of this check: the document, a file it imports, or a cached
    /// standard-library module.
    pub fn uri_of(&self, file: FileId) -> Option<Uri> {
        if file == self.root() {
            return Some(self.uri.clone());
        }
        let name = &self.checked.sources.get(file)?.name;
        if let Some(module) = name.strip_prefix("std/")
            && !self.name.starts_with("std/")
        {
            let path = std_cache()?.join(module);
            return uri_of_path(&path.to_string_lossy());
        }
        uri_of_path(name)
    }

    /// The location of a span, in whichever file it lies.
    pub fn location(&self, span: Span) -> Option<Location> {
        if span.is_dummy() {
            return None;
        }
        let file = self.checked.sources.get(span.file)?;
        Some(Location {
            uri: self.uri_of(span.file)?,
            range: position::range(file, span.start, span.end),
        })
    }
}

/// A document checked without imports, for unit tests.
#[cfg(test)]
pub(crate) fn test_document(text: &str) -> Document {
    let uri: Uri = "file:///t/a.rlhf".parse().unwrap();
    let checked = braid_sema::check("/t/a.rlhf", text, &braid_sema::NoImports);
    Document {
        uri,
        name: "/t/a.rlhf".into(),
        version: 0,
        text: text.into(),
        checked,
        last_parsed: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_uris_round_trip_through_names() {
        let uri = uri_of_path("/tmp/a b/ü.rlhf").unwrap();
        assert_eq!(uri.as_str(), "file:///tmp/a%20b/%C3%BC.rlhf");
        assert_eq!(name_of(&uri), "/tmp/a b/ü.rlhf");
        let untitled: Uri = "untitled:Untitled-1".parse().unwrap();
        assert_eq!(name_of(&untitled), "untitled:Untitled-1");
    }
}
