//! TensorBoard scalars without TensorFlow: an `events.out.tfevents.*` file of `Event` protocol
//! buffers in TFRecord framing, written by hand (the two messages are small).
//!
//! TFRecord: `u64 length (LE)`, `u32 masked CRC-32C of the length`, the bytes, `u32 masked
//! CRC-32C of the bytes`. `Event { double wall_time = 1; int64 step = 2; string file_version = 3;
//! Summary summary = 5; }`, `Summary { repeated Value value = 1; }`,
//! `Value { string tag = 1; float simple_value = 2; }`. The first event carries
//! `file_version: "brain.Event:2"`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// CRC-32C (Castagnoli), reflected polynomial 0x82F63B78.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0x82F6_3B78 & mask);
        }
    }
    !crc
}

fn masked(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn bytes_field(field: u32, data: &[u8], out: &mut Vec<u8>) {
    varint(u64::from(field << 3 | 2), out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// One `Event` message.
fn event(wall_time: f64, step: i64, version: bool, scalars: &[(&str, f32)]) -> Vec<u8> {
    let mut e = Vec::new();
    e.push(1 << 3 | 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    e.push(2 << 3);
    varint(step as u64, &mut e);
    if version {
        bytes_field(3, b"brain.Event:2", &mut e);
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, v) in scalars {
            let mut value = Vec::new();
            bytes_field(1, tag.as_bytes(), &mut value);
            value.push(2 << 3 | 5);
            value.extend_from_slice(&v.to_le_bytes());
            bytes_field(1, &value, &mut summary);
        }
        bytes_field(5, &summary, &mut e);
    }
    e
}

/// A TFRecord-framed record.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked(crc32c(&len)).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked(crc32c(data)).to_le_bytes());
    out
}

/// Appends scalar events to one events file.
pub struct EventWriter {
    path: PathBuf,
    file: File,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<seconds>.braid` (a new file per invocation: a resumed
    /// run adds one, and TensorBoard merges them).
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::file(dir, format!("cannot create: {e}")))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let path = dir.join(format!(
            "events.out.tfevents.{}.braid.{}",
            now as u64,
            std::process::id()
        ));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Error::file(&path, format!("cannot create: {e}")))?;
        let mut w = EventWriter { path, file };
        w.write(&event(now, 0, true, &[]))?;
        Ok(w)
    }

    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.file
            .write_all(&record(data))
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::file(&self.path, format!("cannot write: {e}")))
    }

    /// Writes the finite scalars of one step.
    pub fn scalars(&mut self, step: i64, values: &[(&str, f64)]) -> Result<()> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let finite: Vec<(&str, f32)> = values
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (*k, *v as f32))
            .collect();
        self.write(&event(now, step, false, &finite))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_values() {
        // The CRC-32C check value (RFC 3720, appendix B.4) and the empty string.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        // 32 bytes of zeros (RFC 3720 B.4).
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    /// Decodes what the writer wrote: framing, checksums, and the protobuf fields.
    #[test]
    fn events_round_trip_through_the_framing() {
        let e = event(1.5, 7, false, &[("reward", 0.25)]);
        let r = record(&e);
        let len = u64::from_le_bytes(r[..8].try_into().unwrap()) as usize;
        assert_eq!(len, e.len());
        assert_eq!(
            u32::from_le_bytes(r[8..12].try_into().unwrap()),
            masked(crc32c(&r[..8]))
        );
        assert_eq!(&r[12..12 + len], &e[..]);
        assert_eq!(
            u32::from_le_bytes(r[12 + len..].try_into().unwrap()),
            masked(crc32c(&e))
        );
        // wall_time (field 1, fixed64), step (field 2, varint 7), summary (field 5).
        assert_eq!(e[0], 0x09);
        assert_eq!(f64::from_le_bytes(e[1..9].try_into().unwrap()), 1.5);
        assert_eq!(&e[9..11], &[0x10, 7]);
        assert_eq!(e[11], 0x2a);
        // Summary { value { tag "reward" simple_value 0.25 } }
        let summary = &e[13..];
        assert_eq!(summary[0], 0x0a);
        let value = &summary[2..];
        assert_eq!(&value[..8], b"\x0a\x06reward");
        assert_eq!(value[8], 0x15);
        assert_eq!(f32::from_le_bytes(value[9..13].try_into().unwrap()), 0.25);
    }
}
