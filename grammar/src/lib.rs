//! The `.rlhf` grammar (`grammar/rlhf.pest`), its parser and syntax tree.
//!
//! [`parse`] never fails: it returns the tree it could build and the diagnostics it found,
//! recovering at item boundaries so that one file reports several errors. This crate knows
//! nothing of names, types or meaning (that is `braid-sema`), and it does no file I/O.

pub mod ast;
pub mod comments;
pub mod format;
mod parse;

pub use parse::{KEYWORDS, parse, readable_rule};
