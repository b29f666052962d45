//! The Braid language server: the only crate that knows the Language Server Protocol.
//!
//! It serves one client over stdio (`braid lsp`) or over any [`lsp_server::Connection`] (tests
//! and the benchmark use an in-memory one). Analysis is `braid_sema::check` on the whole
//! document at every change; diagnostics, hover, definitions, references, completion, the
//! outline, formatting and quick fixes all read the checked program and the stdlib tables. The
//! server does no async: one thread handles messages in order. Positions are UTF-16 code units
//! on the wire and byte offsets inside ([`position`]).

mod actions;
mod analysis;
mod completion;
mod diagnostics;
pub mod hover;
mod navigate;
pub mod position;
mod server;
mod transport;

pub use server::{Exit, capabilities, serve};

/// Serves a client on stdin and stdout until it exits. Returns how the session ended, or the
/// I/O error that ended it.
pub fn run_stdio() -> std::io::Result<Exit> {
    let (conn, threads) = transport::stdio()?;
    let exit = serve(&conn);
    // Dropping the connection closes the writer's channel so that it can finish.
    drop(conn);
    threads.join()?;
    Ok(exit)
}
