//! What the end-to-end tests of `braid run` share (`mod common;` in each).

use std::path::{Path, PathBuf};

/// A test's scratch directory, removed when the test ends, whether it passes or fails
/// (`BRAID_TEST_KEEP=1` keeps it to look at): runs write model checkpoints, and a suite that
/// left them behind would fill the disk.
pub struct Tmp(PathBuf);

impl Tmp {
    /// A fresh, empty `braid-SUITE-NAME-PID` in the system's temporary directory.
    pub fn new(suite: &str, name: &str) -> Tmp {
        let d = std::env::temp_dir().join(format!("braid-{suite}-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Tmp(d)
    }
}

impl std::ops::Deref for Tmp {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Tmp {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        if std::env::var_os("BRAID_TEST_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
