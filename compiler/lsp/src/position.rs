//! Conversion between LSP positions and byte offsets.
//!
//! LSP counts a line's characters in UTF-16 code units (the default `positionEncoding`, the
//! only one every client supports); Braid's spans are byte offsets into UTF-8 text. A character
//! outside the Basic Multilingual Plane (an emoji) is two UTF-16 units and four bytes; `ü` is one
//! unit and two bytes. A position past the end of its line means the end of the line, a line
//! past the end of the file means the end of the file, and a position inside a surrogate pair
//! means the character it splits: positions from a client never fail to convert.

use braid_diagnostics::SourceFile;
use lsp_types::{Position, Range};

/// The LSP position of a byte offset (clamped to the text, and back to a character boundary).
pub fn offset_to_position(file: &SourceFile, offset: u32) -> Position {
    let text = file.text.as_str();
    let mut offset = (offset as usize).min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let line0 = (file.line_col(offset as u32).line as usize).saturating_sub(1);
    let start = file.line_start(line0).map_or(0, |s| s as usize).min(offset);
    let character = text[start..offset].encode_utf16().count();
    Position {
        line: u32::try_from(line0).unwrap_or(u32::MAX),
        character: u32::try_from(character).unwrap_or(u32::MAX),
    }
}

/// The byte offset of an LSP position.
pub fn position_to_offset(file: &SourceFile, pos: Position) -> u32 {
    let text = file.text.as_str();
    let Some(start) = file.line_start(pos.line as usize) else {
        return u32::try_from(text.len()).unwrap_or(u32::MAX);
    };
    let start = start as usize;
    let mut units = 0u32;
    let mut offset = start;
    for c in text[start..].chars() {
        if c == '\n' || units >= pos.character {
            break;
        }
        let width = c.len_utf16() as u32;
        // A position between the two halves of a surrogate pair stays before the character.
        if units + width > pos.character {
            break;
        }
        units += width;
        offset += c.len_utf8();
    }
    // `\r\n` line ends: the end of the line is before the `\r`.
    if text[start..offset].ends_with('\r') && offset > start {
        offset -= 1;
    }
    u32::try_from(offset).unwrap_or(u32::MAX)
}

/// The LSP range of a byte range of one file.
pub fn range(file: &SourceFile, start: u32, end: u32) -> Range {
    Range {
        start: offset_to_position(file, start),
        end: offset_to_position(file, end.max(start)),
    }
}

/// The range of the whole text, for edits that replace a document.
pub fn whole(file: &SourceFile) -> Range {
    range(file, 0, u32::try_from(file.text.len()).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(line: u32, character: u32) -> Position {
        Position { line, character }
    }

    #[test]
    fn utf16_columns_round_trip_over_non_ascii_text() {
        // `ü` is 2 bytes / 1 unit, `—` 3 bytes / 1 unit, the emoji 4 bytes / 2 units.
        let text = "fn a() {}\n// ü—🦀x\nlet y\n";
        let f = SourceFile::new("t.rlhf", text);
        let line1 = 10; // byte offset of the second line
        let x = text.find('x').unwrap() as u32;
        assert_eq!(x, line1 + 3 + 2 + 3 + 4);
        // UTF-16: `// ` 3 + ü 1 + — 1 + 🦀 2 = 7.
        assert_eq!(offset_to_position(&f, x), pos(1, 7));
        assert_eq!(position_to_offset(&f, pos(1, 7)), x);
        let crab = text.find('🦀').unwrap() as u32;
        assert_eq!(offset_to_position(&f, crab), pos(1, 5));
        assert_eq!(position_to_offset(&f, pos(1, 5)), crab);
        // Inside the surrogate pair: the character it splits.
        assert_eq!(position_to_offset(&f, pos(1, 6)), crab);
        // A byte offset inside a character counts from the character's start.
        assert_eq!(offset_to_position(&f, crab + 2), pos(1, 5));
        let dash = text.find('—').unwrap() as u32;
        assert_eq!(offset_to_position(&f, dash), pos(1, 4));
        assert_eq!(position_to_offset(&f, pos(1, 4)), dash);
        // Every character boundary round-trips.
        for (i, _) in text.char_indices() {
            let p = offset_to_position(&f, i as u32);
            assert_eq!(position_to_offset(&f, p), i as u32, "offset {i} via {p:?}");
        }
    }

    #[test]
    fn positions_past_the_end_clamp() {
        let f = SourceFile::new("t.rlhf", "ab\r\ncd\n");
        assert_eq!(position_to_offset(&f, pos(0, 99)), 2, "before the \\r");
        assert_eq!(position_to_offset(&f, pos(1, 99)), 6);
        assert_eq!(position_to_offset(&f, pos(9, 0)), 7);
        assert_eq!(offset_to_position(&f, 999), pos(2, 0));
        assert_eq!(whole(&f).end, pos(2, 0));
    }
}
