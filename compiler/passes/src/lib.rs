//! braid-passes: see ARCHITECTURE.md.
