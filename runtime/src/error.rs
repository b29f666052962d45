//! The runtime's error type. Every error that user input can cause names the file (or the
//! pseudo-source, such as `tiny` or `--prompt`) and says what is wrong, so the CLI can print
//! `error: <file>: <what is wrong>` without knowing where it came from. This module must not
//! print or exit: that is the CLI's job.

use std::path::{Path, PathBuf};

/// What can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file (or a named input such as `tiny` or `--prompt`) is missing, unreadable or wrong.
    #[error("{}: {what}", path.display())]
    File { path: PathBuf, what: String },
    /// A request made through the API is inconsistent (for example `n == 0`); `source` names
    /// the option or argument at fault.
    #[error("{source_name}: {what}")]
    Invalid { source_name: String, what: String },
    /// libtorch refused an operation (out of memory, a device error).
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A collective with other ranks failed; when a peer died, the message names it.
    #[error("{0}")]
    Dist(#[from] crate::dist::DistError),
}

/// The runtime's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error about a file.
    pub fn file(path: impl AsRef<Path>, what: impl Into<String>) -> Self {
        Error::File {
            path: path.as_ref().to_path_buf(),
            what: what.into(),
        }
    }

    /// An error about an argument or an option of a request.
    pub fn invalid(source_name: impl Into<String>, what: impl Into<String>) -> Self {
        Error::Invalid {
            source_name: source_name.into(),
            what: what.into(),
        }
    }
}
