//! The key-value store the ranks meet through: c10d's `TCPStore`, hosted by rank 0, and
//! `PrefixStore` views of it that give each process group its own key space. Every wait is
//! bounded by a timeout the caller passes; nothing here retries or interprets values.

use std::sync::Arc;
use std::time::Duration;

use super::ffi::RawStore;
use super::{DistError, Result, World};

/// A handle on a c10d store. Cloning shares the connection; [`Store::reconnect`] opens another
/// (for a thread that must not wait behind this one's blocking `get`s). `Send` and `Sync`:
/// c10d serialises the requests of one connection.
#[derive(Debug, Clone)]
pub struct Store {
    raw: Arc<RawStore>,
    /// Where the store lives and the key prefix of this view, for error messages.
    name: Arc<str>,
}

impl Store {
    /// Connects to the TCP store at `host:port`; rank 0 hosts it (listening on every interface
    /// at `port`) and waits for the other `world_size - 1` ranks to connect. Every rank waits up
    /// to `timeout` for that.
    pub fn tcp(
        host: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Store> {
        let name = format!("TCP store {host}:{port}");
        let size = u32::try_from(world_size)
            .map_err(|_| DistError::invalid(format!("world size {world_size} is too large")))?;
        if rank >= world_size {
            return Err(DistError::invalid(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        let raw = RawStore::tcp(host, port, rank == 0, size, timeout).map_err(|message| {
            DistError::Store {
                store: name.clone(),
                op: if rank == 0 { "host" } else { "connect to" },
                key: String::new(),
                message,
            }
        })?;
        Ok(Store {
            raw: Arc::new(raw),
            name: name.into(),
        })
    }

    /// The store of `world`: `MASTER_ADDR:MASTER_PORT`, hosted by rank 0. A single process
    /// with no address hosts a private store on 127.0.0.1 at a port the OS picks.
    pub fn for_world(world: &World, timeout: Duration) -> Result<Store> {
        match &world.master {
            Some((host, port)) => Store::tcp(host, *port, world.rank, world.size, timeout),
            None if world.size == 1 => Store::tcp("127.0.0.1", 0, 0, 1, timeout),
            None => Err(DistError::invalid(format!(
                "a world of {} processes has no store address",
                world.size
            ))),
        }
    }

    /// A view of this store in which every key is prefixed with `prefix/`.
    pub fn prefixed(&self, prefix: &str) -> Result<Store> {
        let raw = self
            .raw
            .prefixed(prefix)
            .map_err(|message| self.error("prefix", prefix, message))?;
        Ok(Store {
            raw: Arc::new(raw),
            name: format!("{}/{prefix}", self.name).into(),
        })
    }

    /// A new connection to the same store and prefix.
    pub fn reconnect(&self) -> Result<Store> {
        let raw = self
            .raw
            .reconnect()
            .map_err(|message| self.error("reconnect to", "", message))?;
        Ok(Store {
            raw: Arc::new(raw),
            name: self.name.clone(),
        })
    }

    /// Sets `key` to `value`, waking those who wait for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.raw
            .set(key, value)
            .map_err(|message| self.error("set", key, message))
    }

    /// Waits up to `timeout` for `key` to be set, then returns its value.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.raw
            .get(key, timeout)
            .map_err(|message| self.error("get", key, message))
    }

    /// Adds `delta` to the integer at `key` (0 when unset) and returns the sum; `add(key, 0)`
    /// reads a counter without waiting.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.raw
            .add(key, delta)
            .map_err(|message| self.error("add to", key, message))
    }

    /// Waits up to `timeout` until every key in `keys` is set.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.raw
            .wait(keys, timeout)
            .map_err(|message| self.error("wait for", &keys.join(", "), message))
    }

    pub(crate) fn raw(&self) -> &RawStore {
        &self.raw
    }

    fn error(&self, op: &'static str, key: &str, message: String) -> DistError {
        DistError::Store {
            store: self.name.to_string(),
            op,
            key: key.to_owned(),
            message,
        }
    }
}
