//! braid-ir: see ARCHITECTURE.md.
