//! Comments, found lexically. The syntax tree drops comments; the formatter puts them back
//! using their positions, so this scanner must agree with the grammar on where strings are.

/// A `//` comment: its byte range (without the line break) and text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Comment {
    pub start: usize,
    pub end: usize,
    pub text: String,
}

/// Every comment in `text`, in order. Strings (`"…"` with escapes, raw `r"…"`) are skipped so
/// that `"http://x"` is not a comment.
pub fn scan(text: &str) -> Vec<Comment> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let raw = i > 0 && bytes[i - 1] == b'r' && !(i > 1 && is_ident_byte(bytes[i - 2]));
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' && bytes[i] != b'\n' {
                    if !raw && bytes[i] == b'\\' && i + 1 < bytes.len() && bytes[i + 1] != b'\n' {
                        i += 1;
                    }
                    i += 1;
                }
                if i < bytes.len() && bytes[i] == b'"' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                let start = i;
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
                let end = text[start..i].trim_end().len() + start;
                out.push(Comment {
                    start,
                    end,
                    text: text[start..end].to_string(),
                });
            }
            _ => i += 1,
        }
    }
    out
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skips_strings_and_raw_strings() {
        let src = "let a = \"http://x\" // real\nlet b = r\"\\d+//\" // also\n";
        let c: Vec<String> = scan(src).into_iter().map(|c| c.text).collect();
        assert_eq!(c, vec!["// real", "// also"]);
    }
}
