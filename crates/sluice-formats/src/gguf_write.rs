//! Writing GGUF version 3 files.
//!
//! The header (metadata and tensor records) is built in memory; tensor data is streamed
//! to the file one tensor at a time from bytes, a reader or a callback, so a file of tens
//! of GB never sits in memory. Every tensor's byte count is checked against its type and
//! shape, and the file is written under a temporary name and renamed into place at the
//! end, so a failed write leaves no half-written `.gguf` behind.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use sluice_core::{DType, Error, Result};

use crate::gguf::{GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_MAX_DIMS, GgufValue, ggml_type_id, vtype};

/// Writes one tensor's bytes into the file.
pub type FillFn<'a> = Box<dyn FnOnce(&mut dyn Write) -> io::Result<()> + 'a>;

/// Where a tensor's bytes come from.
pub enum TensorData<'a> {
    Bytes(Cow<'a, [u8]>),
    /// Exactly the tensor's byte count is read from it.
    Reader(Box<dyn Read + 'a>),
    /// Called once with the file; it must write exactly the tensor's byte count.
    Fill(FillFn<'a>),
}

struct PendingTensor<'a> {
    name: String,
    dtype: DType,
    /// Outermost first, as everywhere in sluice; written reversed (GGUF's `ne`).
    shape: Vec<usize>,
    data: TensorData<'a>,
}

/// Builds a GGUF v3 file: metadata in the order added, tensors in the order added.
pub struct GgufWriter<'a> {
    alignment: usize,
    kv: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor<'a>>,
}

impl Default for GgufWriter<'_> {
    fn default() -> Self {
        Self::new()
    }
}

/// Bytes a tensor of this type and shape (outermost first) takes, if its rows are whole
/// blocks and the size fits.
pub fn tensor_bytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    let inner = *shape.last()?;
    if inner % dtype.block_elems() != 0 {
        return None;
    }
    let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    dtype.bytes_for(numel)
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        GgufWriter { alignment: GGUF_DEFAULT_ALIGNMENT, kv: Vec::new(), tensors: Vec::new() }
    }

    /// Aligns tensor data to `alignment` bytes (a power of two) instead of 32, and
    /// records it as `general.alignment`. 4096 suits O_DIRECT reads.
    pub fn set_alignment(&mut self, alignment: usize) -> &mut Self {
        self.alignment = alignment;
        if alignment != GGUF_DEFAULT_ALIGNMENT {
            self.add("general.alignment", GgufValue::U32(alignment as u32));
        }
        self
    }

    /// Adds a metadata value, or replaces the value of a key added before.
    pub fn add(&mut self, key: &str, value: GgufValue) -> &mut Self {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.kv.push((key.to_string(), value)),
        }
        self
    }

    /// Drops a metadata key added before.
    pub fn remove(&mut self, key: &str) -> &mut Self {
        self.kv.retain(|(k, _)| k != key);
        self
    }

    pub fn add_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.add(key, GgufValue::String(v.to_string()))
    }
    pub fn add_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.add(key, GgufValue::U32(v))
    }
    pub fn add_u64(&mut self, key: &str, v: u64) -> &mut Self {
        self.add(key, GgufValue::U64(v))
    }
    pub fn add_i32(&mut self, key: &str, v: i32) -> &mut Self {
        self.add(key, GgufValue::I32(v))
    }
    pub fn add_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.add(key, GgufValue::F32(v))
    }
    pub fn add_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.add(key, GgufValue::Bool(v))
    }
    pub fn add_str_array<S: AsRef<str>>(&mut self, key: &str, v: &[S]) -> &mut Self {
        self.add(key, GgufValue::Array(v.iter().map(|s| GgufValue::String(s.as_ref().to_string())).collect()))
    }
    pub fn add_u32_array(&mut self, key: &str, v: &[u32]) -> &mut Self {
        self.add(key, GgufValue::Array(v.iter().map(|&x| GgufValue::U32(x)).collect()))
    }
    pub fn add_i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
        self.add(key, GgufValue::Array(v.iter().map(|&x| GgufValue::I32(x)).collect()))
    }
    pub fn add_f32_array(&mut self, key: &str, v: &[f32]) -> &mut Self {
        self.add(key, GgufValue::Array(v.iter().map(|&x| GgufValue::F32(x)).collect()))
    }
    pub fn add_bool_array(&mut self, key: &str, v: &[bool]) -> &mut Self {
        self.add(key, GgufValue::Array(v.iter().map(|&x| GgufValue::Bool(x)).collect()))
    }

    /// Adds a tensor whose bytes are at hand.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: impl Into<Cow<'a, [u8]>>,
    ) -> &mut Self {
        self.add_tensor_data(name, dtype, shape, TensorData::Bytes(bytes.into()))
    }

    /// Adds an f32 tensor from values.
    pub fn add_f32_tensor(&mut self, name: &str, shape: &[usize], values: &[f32]) -> &mut Self {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, DType::F32, shape, bytes)
    }

    /// Adds a tensor read from `reader` when the file is written.
    pub fn add_tensor_reader(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        reader: impl Read + 'a,
    ) -> &mut Self {
        self.add_tensor_data(name, dtype, shape, TensorData::Reader(Box::new(reader)))
    }

    /// Adds a tensor that `fill` writes when the file is written.
    pub fn add_tensor_fn(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        fill: impl FnOnce(&mut dyn Write) -> io::Result<()> + 'a,
    ) -> &mut Self {
        self.add_tensor_data(name, dtype, shape, TensorData::Fill(Box::new(fill)))
    }

    pub fn add_tensor_data(&mut self, name: &str, dtype: DType, shape: &[usize], data: TensorData<'a>) -> &mut Self {
        self.tensors.push(PendingTensor { name: name.to_string(), dtype, shape: shape.to_vec(), data });
        self
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Writes the file. Fails, naming the file and the tensor or key, on a duplicate
    /// name, a shape GGUF cannot hold, an array of mixed types, or tensor data of the
    /// wrong length.
    pub fn write(self, path: &Path) -> Result<()> {
        let tmp = temp_path(path);
        let result = self.write_to_path(path, &tmp);
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    fn write_to_path(self, path: &Path, tmp: &Path) -> Result<()> {
        let fmt = |msg: String| Error::format(path, msg);
        if !self.alignment.is_power_of_two() || self.alignment > u32::MAX as usize {
            return Err(fmt(format!("alignment {} is not a power of two", self.alignment)));
        }
        let mut keys = HashSet::new();
        for (k, v) in &self.kv {
            if !keys.insert(k.as_str()) {
                return Err(fmt(format!("metadata key '{k}' is added twice")));
            }
            check_value(v).map_err(|m| fmt(format!("metadata key '{k}': {m}")))?;
        }

        // Tensor records and data offsets.
        let mut names = HashSet::new();
        let mut sizes = Vec::with_capacity(self.tensors.len());
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut next = 0usize;
        for t in &self.tensors {
            if !names.insert(t.name.as_str()) {
                return Err(fmt(format!("tensor '{}' is added twice", t.name)));
            }
            if t.shape.is_empty() || t.shape.len() > GGUF_MAX_DIMS || t.shape.contains(&0) {
                return Err(fmt(format!(
                    "tensor '{}' has shape {:?}; GGUF holds 1 to {GGUF_MAX_DIMS} non-zero dimensions",
                    t.name, t.shape
                )));
            }
            let size = tensor_bytes(t.dtype, &t.shape).ok_or_else(|| {
                fmt(format!(
                    "tensor '{}' of shape {:?} is not a whole number of {} blocks per row",
                    t.name, t.shape, t.dtype
                ))
            })?;
            if let TensorData::Bytes(b) = &t.data
                && b.len() != size
            {
                return Err(fmt(format!("tensor '{}' has {} bytes, expected {size}", t.name, b.len())));
            }
            offsets.push(next);
            sizes.push(size);
            next = (next + size).div_ceil(self.alignment) * self.alignment;
        }

        let mut header = Vec::new();
        header.extend_from_slice(&GGUF_MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut header, k);
            header.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut header, v);
        }
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut header, &t.name);
            header.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                header.extend_from_slice(&(d as u64).to_le_bytes());
            }
            header.extend_from_slice(&ggml_type_id(t.dtype).to_le_bytes());
            header.extend_from_slice(&(off as u64).to_le_bytes());
        }
        let pad = header.len().next_multiple_of(self.alignment) - header.len();
        header.resize(header.len() + pad, 0);

        let io = |e: io::Error| Error::io(tmp, e);
        let file = File::create(tmp).map_err(io)?;
        let mut out = Counting { inner: BufWriter::with_capacity(1 << 22, file), written: 0 };
        out.write_all(&header).map_err(io)?;
        let data_start = out.written;
        for ((t, &off), &size) in self.tensors.into_iter().zip(&offsets).zip(&sizes) {
            // Padding up to this tensor's offset.
            let at = out.written - data_start;
            write_zeros(&mut out, (off as u64) - at).map_err(io)?;
            let before = out.written;
            match t.data {
                TensorData::Bytes(b) => out.write_all(&b).map_err(io)?,
                TensorData::Reader(r) => {
                    let copied = io::copy(&mut r.take(size as u64), &mut out).map_err(io)?;
                    if copied != size as u64 {
                        return Err(fmt(format!(
                            "tensor '{}': its reader gave {copied} bytes, expected {size}",
                            t.name
                        )));
                    }
                }
                TensorData::Fill(f) => f(&mut out).map_err(io)?,
            }
            let wrote = out.written - before;
            if wrote != size as u64 {
                return Err(fmt(format!("tensor '{}': {wrote} bytes were written, expected {size}", t.name)));
            }
        }
        // Pad the end too, so the data section is a whole number of aligned blocks.
        let at = out.written - data_start;
        write_zeros(&mut out, at.next_multiple_of(self.alignment as u64) - at).map_err(io)?;
        let file = out.inner.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(tmp, path).map_err(|e| Error::io(path, e))
    }
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".partial");
    path.with_file_name(name)
}

/// Counts the bytes that pass through.
struct Counting<W: Write> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `n` zero bytes (alignment padding).
pub(crate) fn write_zeros(out: &mut impl Write, mut n: u64) -> io::Result<()> {
    let zeros = [0u8; 4096];
    while n > 0 {
        let k = n.min(zeros.len() as u64) as usize;
        out.write_all(&zeros[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Arrays must hold one element type.
fn check_value(v: &GgufValue) -> std::result::Result<(), String> {
    if let GgufValue::Array(items) = v {
        if let Some(first) = items.first() {
            let t = first.type_id();
            if let Some(bad) = items.iter().find(|e| e.type_id() != t) {
                return Err(format!("an array mixes {} and {}", first.describe(), bad.describe()));
            }
        }
        items.iter().try_for_each(check_value)?;
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.push(*x as u8),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(*x as u8),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(items) => {
            // An empty array's element type is not recoverable. Strings: the one empty
            // array sluice writes is `tokenizer.ggml.merges` (synth's vocabulary has
            // none), and llama.cpp refuses merges of any other type even when empty.
            let elem = items.first().map_or(vtype::STRING, |e| e.type_id());
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|e| put_value(out, e));
        }
    }
}
