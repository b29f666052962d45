//! Dequantisation of GGUF tensor data to f32: the plain types (F32, F16, BF16), the legacy
//! block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants (Q2_K–Q6_K) as ggml lays them
//! out (`ggml-common.h`) and dequantises them (`dequantize_row_*` in `ggml-quants.c`). Each
//! block's scales are f16; every product is formed in f32 in ggml's order, so values agree with
//! ggml's and gguf-py's to rounding (test `dequantised_blocks_match_gguf_py`, fixture made by
//! `scripts/make_gguf_fixtures.py`). This module only converts bytes; it must not know tensor
//! names, files or libtorch.

use half::{bf16, f16};

/// The GGUF tensor types Braid reads, with their ggml type ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)] // ggml's own names, as they appear in files and error messages.
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl GgmlType {
    /// The type of ggml type id `id`, if Braid reads it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// Values per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q2_K => (256, 84),
            GgmlType::Q3_K => (256, 110),
            GgmlType::Q4_K => (256, 144),
            GgmlType::Q5_K => (256, 176),
            GgmlType::Q6_K => (256, 210),
        }
    }

    /// The byte size of `n` values, or why they cannot be stored in this type.
    pub fn bytes_for(self, n: usize) -> Result<usize, String> {
        let (per_block, block_bytes) = self.block();
        if !n.is_multiple_of(per_block) {
            return Err(format!(
                "{n} values are not a whole number of {self:?} blocks of {per_block}"
            ));
        }
        (n / per_block)
            .checked_mul(block_bytes)
            .ok_or_else(|| format!("{n} values of {self:?} overflow the address space"))
    }
}

fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises `n` values of type `ty` from `bytes` (exactly `ty.bytes_for(n)` long).
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let need = ty.bytes_for(n)?;
    if bytes.len() != need {
        return Err(format!(
            "{n} values of {ty:?} need {need} bytes, found {}",
            bytes.len()
        ));
    }
    let mut out = vec![0f32; n];
    let (per_block, block_bytes) = ty.block();
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            let block_fn: fn(&[u8], &mut [f32]) = match ty {
                GgmlType::Q4_0 => q4_0,
                GgmlType::Q4_1 => q4_1,
                GgmlType::Q5_0 => q5_0,
                GgmlType::Q5_1 => q5_1,
                GgmlType::Q8_0 => q8_0,
                GgmlType::Q2_K => q2_k,
                GgmlType::Q3_K => q3_k,
                GgmlType::Q4_K => q4_k,
                GgmlType::Q5_K => q5_k,
                _ => q6_k,
            };
            for (y, b) in out
                .chunks_exact_mut(per_block)
                .zip(bytes.chunks_exact(block_bytes))
            {
                block_fn(b, y);
            }
        }
    }
    Ok(out)
}

/// `{ f16 d; u8 qs[16] }`: low nibbles are values 0–15, high nibbles 16–31, offset by 8.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// `{ f16 d; f16 m; u8 qs[16] }`: `q·d + m`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let m = half_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// `{ f16 d; u8 qh[4]; u8 qs[16] }`: the fifth bit of value j is bit j of `qh`, offset by 16.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = (((qs[j] & 0x0F) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// `{ f16 d; f16 m; u8 qh[4]; u8 qs[16] }`: `q·d + m` with five-bit `q`.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let m = half_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = ((qs[j] & 0x0F) | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | h1) as f32 * d + m;
    }
}

/// `{ f16 d; i8 qs[32] }`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// `{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }`: 16 groups of 16 two-bit values, each with
/// a four-bit scale (low nibble) and minimum (high nibble).
fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let d = half_at(b, 80);
    let dmin = half_at(b, 82);
    let mut out = 0;
    let mut is = 0;
    for n in 0..2 {
        let q = &b[16 + 32 * n..16 + 32 * (n + 1)];
        for shift in [0u32, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for l in 0..16 {
                    y[out] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// `{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`: three-bit values (two low bits in
/// `qs`, the high bit in `hmask`, set meaning "no −4") and sixteen six-bit scales packed in 12
/// bytes, offset by 32.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let d = half_at(b, 108);
    let mut aux = [0u32; 4];
    for (i, a) in aux.iter_mut().take(3).enumerate() {
        let s = 96 + 4 * i;
        *a = u32::from_le_bytes([b[s], b[s + 1], b[s + 2], b[s + 3]]);
    }
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
    aux[3] = ((aux[1] >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
    aux[0] = (aux[0] & KMASK2) | ((tmp & KMASK1) << 4);
    aux[1] = (aux[1] & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
    let scales: Vec<i8> = aux
        .iter()
        .flat_map(|a| a.to_le_bytes())
        .map(|x| x as i8)
        .collect();
    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &b[32 + 32 * n..32 + 32 * (n + 1)];
        for shift in [0u32, 2, 4, 6] {
            for half in 0..2 {
                let dl = d * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let k = l + 16 * half;
                    let low = ((q[k] >> shift) & 3) as i32;
                    let high = if hmask[k] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// The `j`-th six-bit scale and minimum of a Q4_K / Q5_K block's 12 scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`: eight groups of 32 four-bit values.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let dmin = half_at(b, 2);
    let scales = &b[4..16];
    let mut out = 0;
    for g in 0..4 {
        let q = &b[16 + 32 * g..16 + 32 * (g + 1)];
        let (s1, m1) = scale_min_k4(2 * g, scales);
        let (s2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
        for &x in q {
            y[out] = d1 * (x & 0x0F) as f32 - m1;
            out += 1;
        }
        for &x in q {
            y[out] = d2 * (x >> 4) as f32 - m2;
            out += 1;
        }
    }
}

/// `{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`: Q4_K with a fifth bit per value.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let dmin = half_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let mut out = 0;
    let (mut u1, mut u2) = (1u8, 2u8);
    for g in 0..4 {
        let ql = &b[48 + 32 * g..48 + 32 * (g + 1)];
        let (s1, m1) = scale_min_k4(2 * g, scales);
        let (s2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            let h = if qh[l] & u1 != 0 { 16 } else { 0 };
            y[out] = d1 * ((ql[l] & 0x0F) + h) as f32 - m1;
            out += 1;
        }
        for l in 0..32 {
            let h = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[out] = d2 * ((ql[l] >> 4) + h) as f32 - m2;
            out += 1;
        }
        u1 <<= 2;
        u2 <<= 2;
    }
}

/// `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`: six-bit values offset by 32, sixteen
/// eight-bit scales.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * (n + 1)];
        let qh = &b[128 + 32 * n..128 + 32 * (n + 1)];
        let sc = &b[192 + 8 * n..192 + 8 * (n + 1)];
        let y = &mut y[128 * n..128 * (n + 1)];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_must_be_whole_blocks_and_match() {
        assert_eq!(GgmlType::Q4_1.bytes_for(64), Ok(40));
        assert!(GgmlType::Q4_K.bytes_for(100).is_err());
        let err = dequantize(GgmlType::Q8_0, &[0; 33], 32)
            .err()
            .unwrap_or_default();
        assert!(err.contains("need 34 bytes, found 33"), "{err}");
    }

    #[test]
    fn q8_0_and_q4_1_by_hand() {
        // d = 0.5 (f16 0x3800), values -2, 0, 3, ...
        let mut b = vec![0x00, 0x38];
        b.extend((0..32).map(|i| (i as i8 - 2) as u8));
        let y = dequantize(GgmlType::Q8_0, &b, 32).unwrap_or_default();
        assert_eq!(&y[..3], &[-1.0, -0.5, 0.0]);
        // d = 1, m = -8: nibble q gives q - 8; byte 0x21 holds 1 (low) and 2 (high).
        let mut b = vec![0x00, 0x3C, 0x00, 0xC8];
        b.extend([0x21; 16]);
        let y = dequantize(GgmlType::Q4_1, &b, 32).unwrap_or_default();
        assert_eq!((y[0], y[16]), (-7.0, -6.0));
    }
}
