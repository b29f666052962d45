//! Source files, byte spans and line/column conversion.

use serde::Serialize;

/// Index of a file in a [`SourceMap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Default)]
pub struct FileId(pub u32);

/// A byte range in one source file. Every syntax-tree node, HIR expression and task keeps one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Default)]
pub struct Span {
    pub file: FileId,
    pub start: u32,
    pub end: u32,
}

impl Span {
    /// A span for things that have no place in any file (synthesised values).
    pub const DUMMY: Span = Span {
        file: FileId(u32::MAX),
        start: 0,
        end: 0,
    };

    pub fn new(file: FileId, start: usize, end: usize) -> Span {
        let clamp = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        Span {
            file,
            start: clamp(start),
            end: clamp(end),
        }
    }

    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        if self.file != other.file {
            return self;
        }
        Span {
            file: self.file,
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }

    pub fn len(self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    pub fn is_dummy(self) -> bool {
        self.file == Span::DUMMY.file
    }

    pub fn contains(self, offset: u32) -> bool {
        self.start <= offset && offset <= self.end
    }
}

/// A 1-based line and a 1-based column counted in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LineCol {
    pub line: u32,
    pub col: u32,
}

#[derive(Debug, Clone)]
pub struct SourceFile {
    /// The name shown to users: a path as given on the command line, or `std/grpo.rlhf`.
    pub name: String,
    pub text: String,
    line_starts: Vec<u32>,
}

impl SourceFile {
    pub fn new(name: impl Into<String>, text: impl Into<String>) -> Self {
        let text = text.into();
        let mut line_starts = vec![0];
        for (i, b) in text.bytes().enumerate() {
            if b == b'\n' {
                line_starts.push(u32::try_from(i + 1).unwrap_or(u32::MAX));
            }
        }
        SourceFile {
            name: name.into(),
            text,
            line_starts,
        }
    }

    /// Line and character column of a byte offset (clamped to the text).
    pub fn line_col(&self, offset: u32) -> LineCol {
        let offset = offset.min(u32::try_from(self.text.len()).unwrap_or(u32::MAX));
        let line = self
            .line_starts
            .partition_point(|&s| s <= offset)
            .saturating_sub(1);
        let start = self.line_starts[line] as usize;
        let end = (offset as usize).min(self.text.len());
        let col = self
            .text
            .get(start..end)
            .map_or(end - start, |s| s.chars().count());
        LineCol {
            line: line as u32 + 1,
            col: col as u32 + 1,
        }
    }

    /// Byte offset of the start of a 0-based line, if it exists.
    pub fn line_start(&self, line0: usize) -> Option<u32> {
        self.line_starts.get(line0).copied()
    }

    pub fn line_count(&self) -> usize {
        self.line_starts.len()
    }
}

/// All the files of one compilation: the user's, the files they import, and stdlib modules.
#[derive(Debug, Clone, Default)]
pub struct SourceMap {
    files: Vec<SourceFile>,
}

impl SourceMap {
    pub fn new() -> Self {
        SourceMap::default()
    }

    pub fn add(&mut self, name: impl Into<String>, text: impl Into<String>) -> FileId {
        let id = FileId(u32::try_from(self.files.len()).unwrap_or(u32::MAX));
        self.files.push(SourceFile::new(name, text));
        id
    }

    pub fn get(&self, id: FileId) -> Option<&SourceFile> {
        self.files.get(id.0 as usize)
    }

    pub fn files(&self) -> impl Iterator<Item = (FileId, &SourceFile)> {
        self.files
            .iter()
            .enumerate()
            .map(|(i, f)| (FileId(i as u32), f))
    }

    /// The text a span covers, or "" for a dummy or stale span.
    pub fn snippet(&self, span: Span) -> &str {
        self.get(span.file)
            .and_then(|f| f.text.get(span.start as usize..span.end as usize))
            .unwrap_or("")
    }

    /// `name:line:col` of a span's start, for notes that point into other files.
    pub fn location(&self, span: Span) -> String {
        match self.get(span.file) {
            Some(f) => {
                let lc = f.line_col(span.start);
                format!("{}:{}:{}", f.name, lc.line, lc.col)
            }
            None => "<builtin>".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_characters_not_bytes() {
        let f = SourceFile::new("a", "ab\nüx\n");
        assert_eq!(f.line_col(0), LineCol { line: 1, col: 1 });
        assert_eq!(f.line_col(3), LineCol { line: 2, col: 1 });
        // 'x' sits after a two-byte character: byte 5, character column 2.
        assert_eq!(f.line_col(5), LineCol { line: 2, col: 2 });
        assert_eq!(f.line_col(100), LineCol { line: 3, col: 1 });
    }
}
