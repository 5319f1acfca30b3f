//! GGUF files (versions 2 and 3), read in place.
//!
//! Layout, all little-endian: the magic `GGUF`, a u32 version, u64 tensor and metadata
//! counts, the metadata (key string, u32 value type, value), one info record per tensor
//! (name, u32 n_dims, u64 dims innermost first, u32 ggml type, u64 offset into the data
//! section), padding to `general.alignment` (32 by default), then the tensor data.
//!
//! Every count, length and offset is checked against the bytes that are left before it is
//! used or anything is allocated for it, so a truncated or hostile file gives an
//! [`Error::Format`] that names the file (and the key or tensor), never a panic or an
//! allocation the file could not back.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use sluice_core::{DType, Error, Result};

use crate::mapped::{MappedFile, TensorView};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const GGUF_DEFAULT_ALIGNMENT: usize = 32;
/// ggml's GGML_MAX_DIMS.
pub const GGUF_MAX_DIMS: usize = 4;

/// Arrays of arrays are legal GGUF; nothing real nests deeper than one level, and a
/// bound keeps a hostile file from recursing the stack away.
const MAX_ARRAY_DEPTH: usize = 4;
/// The most array elements all metadata together may hold. Real files hold a few hundred
/// thousand (vocabularies, merges); each element costs ~32 bytes in memory whatever its
/// size on disk, so this bounds what a small hostile file can make us allocate.
const MAX_ARRAY_ELEMENTS: usize = 1 << 25;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

/// GGUF's value type ids (`gguf_type`).
pub(crate) mod vtype {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;

    pub fn name(t: u32) -> Option<&'static str> {
        Some(match t {
            U8 => "U8",
            I8 => "I8",
            U16 => "U16",
            I16 => "I16",
            U32 => "U32",
            I32 => "I32",
            F32 => "F32",
            BOOL => "BOOL",
            STRING => "STRING",
            ARRAY => "ARRAY",
            U64 => "U64",
            I64 => "I64",
            F64 => "F64",
            _ => return None,
        })
    }

    /// The fewest bytes a value of this type takes in the file.
    pub fn min_size(t: u32) -> usize {
        match t {
            U8 | I8 | BOOL => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | STRING => 8,
            // element type + count
            _ => 12,
        }
    }
}

impl GgufValue {
    /// GGUF's type id for this value.
    pub fn type_id(&self) -> u32 {
        match self {
            GgufValue::U8(_) => vtype::U8,
            GgufValue::I8(_) => vtype::I8,
            GgufValue::U16(_) => vtype::U16,
            GgufValue::I16(_) => vtype::I16,
            GgufValue::U32(_) => vtype::U32,
            GgufValue::I32(_) => vtype::I32,
            GgufValue::U64(_) => vtype::U64,
            GgufValue::I64(_) => vtype::I64,
            GgufValue::F32(_) => vtype::F32,
            GgufValue::F64(_) => vtype::F64,
            GgufValue::Bool(_) => vtype::BOOL,
            GgufValue::String(_) => vtype::STRING,
            GgufValue::Array(_) => vtype::ARRAY,
        }
    }

    /// The type as a short phrase for error messages ("U32", "an array of STRING").
    pub fn describe(&self) -> String {
        match self {
            GgufValue::Array(a) => match a.first() {
                Some(e) => format!("an array of {}", e.describe()),
                None => "an empty array".to_string(),
            },
            other => vtype::name(other.type_id()).unwrap_or("?").to_string(),
        }
    }

    /// Any integer type as i128, which holds them all.
    fn as_int(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A non-negative integer of any integer type.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_int().and_then(|v| u64::try_from(v).ok())
    }

    /// An integer of any integer type that fits an i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_int().and_then(|v| i64::try_from(v).ok())
    }

    /// Any integer or float.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_int().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml type ids (`ggml_type`, gguf-py's `GGMLQuantizationType`) and their names, for
/// the types sluice reads and for naming the ones it does not.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        4 => "Q4_2",
        5 => "Q4_3",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        31 => "Q4_0_4_4",
        32 => "Q4_0_4_8",
        33 => "Q4_0_8_8",
        34 => "TQ1_0",
        35 => "TQ2_0",
        36 => "IQ4_NL_4_4",
        37 => "IQ4_NL_4_8",
        38 => "IQ4_NL_8_8",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        _ => return None,
    })
}

/// The sluice type of a ggml type id, if sluice reads it.
pub fn dtype_from_ggml(id: u32) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        30 => DType::BF16,
        39 => DType::MXFP4,
        _ => return None,
    })
}

/// The ggml type id of a sluice type.
pub fn ggml_type_id(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q4K => 12,
        DType::Q5K => 13,
        DType::Q6K => 14,
        DType::BF16 => 30,
        DType::MXFP4 => 39,
    }
}

/// An opened GGUF file: its metadata in file order and views of its tensors.
pub struct GgufFile {
    file: Arc<MappedFile>,
    version: u32,
    alignment: usize,
    data_offset: usize,
    kv: Vec<(String, GgufValue)>,
    kv_index: HashMap<String, usize>,
    tensors: Vec<TensorView>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path())
            .field("version", &self.version)
            .field("kv", &self.kv.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = MappedFile::open(path)?;
        parse(file)
    }

    pub fn path(&self) -> &Path {
        self.file.path()
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Byte offset of the tensor data section (tensor offsets count from here).
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    pub fn mapped(&self) -> &Arc<MappedFile> {
        &self.file
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.kv_index.get(key).map(|&i| &self.kv[i].1)
    }

    /// Metadata keys in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.kv.iter().map(|(k, _)| k.as_str())
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.kv
    }

    /// Tensors in file order; shapes outermost first (GGUF's `ne` reversed).
    pub fn tensors(&self) -> &[TensorView] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorView> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    fn wrong_type(&self, key: &str, v: &GgufValue, expected: &str) -> Error {
        Error::format(self.path(), format!("metadata key '{key}' is {}, expected {expected}", v.describe()))
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong_type(key, v, "a string")),
        }
    }

    /// A non-negative integer of any integer type.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| match v.as_int() {
                Some(n) => {
                    Error::format(self.path(), format!("metadata key '{key}' is {n}, expected a non-negative integer"))
                }
                None => self.wrong_type(key, v, "an integer"),
            }),
        }
    }

    /// Any integer or float type.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong_type(key, v, "a number")),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong_type(key, v, "a bool")),
        }
    }

    fn get_array_of<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        f: impl Fn(&'s GgufValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let arr = v.as_array().ok_or_else(|| self.wrong_type(key, v, expected))?;
        arr.iter().map(|e| f(e).ok_or_else(|| self.wrong_type(key, v, expected))).collect::<Result<Vec<T>>>().map(Some)
    }

    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.get_array_of(key, "an array of strings", |e| e.as_str())
    }

    /// An array of numbers of any type, as f32.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.get_array_of(key, "an array of numbers", |e| e.as_f64().map(|x| x as f32))
    }

    /// An array of any integer element type.
    pub fn get_i64_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.get_array_of(key, "an array of integers", |e| e.as_i64())
    }
}

/// A bounds-checked cursor over the file's bytes.
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: String) -> Error {
        Error::format(self.path, msg)
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: {} needs {n} bytes at offset {} but the file ends at {}",
                what(),
                self.pos,
                self.bytes.len()
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count or length that must fit in the bytes left, `unit` bytes per item at least.
    fn count(&mut self, unit: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let n = self.u64(what)?;
        let left = self.remaining();
        if n > (left / unit.max(1)) as u64 {
            return Err(self.err(format!(
                "{} is {n}, more than the {left} bytes left in the file could hold (offset {})",
                what(),
                self.pos
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len_what = || format!("the length of {}", what());
        let n = self.count(1, &len_what)?;
        let start = self.pos;
        let b = self.take(n, what)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_string()),
            Err(e) => Err(self.err(format!("{} at offset {start} is not valid UTF-8 ({e})", what()))),
        }
    }
}

/// What a value belongs to, for messages.
fn key_what(key: &str) -> impl Fn() -> String + '_ {
    move || format!("the value of metadata key '{key}'")
}

fn read_value(c: &mut Cursor, ty: u32, key: &str, depth: usize, budget: &mut usize) -> Result<GgufValue> {
    let what = key_what(key);
    Ok(match ty {
        vtype::U8 => GgufValue::U8(c.array::<1>(&what)?[0]),
        vtype::I8 => GgufValue::I8(c.array::<1>(&what)?[0] as i8),
        vtype::U16 => GgufValue::U16(u16::from_le_bytes(c.array(&what)?)),
        vtype::I16 => GgufValue::I16(i16::from_le_bytes(c.array(&what)?)),
        vtype::U32 => GgufValue::U32(u32::from_le_bytes(c.array(&what)?)),
        vtype::I32 => GgufValue::I32(i32::from_le_bytes(c.array(&what)?)),
        vtype::U64 => GgufValue::U64(u64::from_le_bytes(c.array(&what)?)),
        vtype::I64 => GgufValue::I64(i64::from_le_bytes(c.array(&what)?)),
        vtype::F32 => GgufValue::F32(f32::from_le_bytes(c.array(&what)?)),
        vtype::F64 => GgufValue::F64(f64::from_le_bytes(c.array(&what)?)),
        vtype::BOOL => GgufValue::Bool(c.array::<1>(&what)?[0] != 0),
        vtype::STRING => GgufValue::String(c.string(&|| format!("the string value of metadata key '{key}'"))?),
        vtype::ARRAY => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(c.err(format!("metadata key '{key}' nests arrays more than {MAX_ARRAY_DEPTH} deep")));
            }
            let elem = c.u32(&|| format!("the element type of metadata key '{key}'"))?;
            if vtype::name(elem).is_none() {
                return Err(c.err(format!("metadata key '{key}' is an array of unknown value type {elem}")));
            }
            let n = c.count(vtype::min_size(elem), &|| format!("the array length of metadata key '{key}'"))?;
            if n > *budget {
                return Err(c.err(format!(
                    "metadata key '{key}' holds an array of {n} elements, more than the {MAX_ARRAY_ELEMENTS} \
                     array elements sluice reads in one file's metadata"
                )));
            }
            *budget -= n;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_value(c, elem, key, depth + 1, budget)?);
            }
            GgufValue::Array(items)
        }
        other => return Err(c.err(format!("metadata key '{key}' has unknown value type {other}"))),
    })
}

/// One tensor's record, before its data range is checked.
struct TensorInfo {
    name: String,
    /// Outermost first.
    shape: Vec<usize>,
    dtype: DType,
    offset: u64,
}

fn read_tensor_info(c: &mut Cursor, index: usize) -> Result<TensorInfo> {
    let name = c.string(&|| format!("the name of tensor #{index}"))?;
    let n_dims = c.u32(&|| format!("the dimension count of tensor '{name}'"))? as usize;
    if n_dims == 0 || n_dims > GGUF_MAX_DIMS {
        return Err(c.err(format!("tensor '{name}' has {n_dims} dimensions; GGUF tensors have 1 to {GGUF_MAX_DIMS}")));
    }
    let mut ne = [0u64; GGUF_MAX_DIMS];
    for (d, slot) in ne.iter_mut().enumerate().take(n_dims) {
        *slot = c.u64(&|| format!("dimension {d} of tensor '{name}'"))?;
    }
    let ne = &ne[..n_dims];
    if ne.contains(&0) {
        return Err(c.err(format!("tensor '{name}' has a zero-sized dimension (ne = {ne:?})")));
    }
    let numel = ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).filter(|&n| n <= i64::MAX as u64);
    let Some(numel) = numel.and_then(|n| usize::try_from(n).ok()) else {
        return Err(c.err(format!("tensor '{name}' has dimensions {ne:?} whose product overflows")));
    };
    let type_id = c.u32(&|| format!("the type of tensor '{name}'"))?;
    let dtype = match dtype_from_ggml(type_id) {
        Some(d) => d,
        None => {
            return Err(c.err(match ggml_type_name(type_id) {
                Some(t) => format!(
                    "tensor '{name}' has type {t} ({type_id}), which sluice does not read \
                     (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4)"
                ),
                None => format!("tensor '{name}' has unknown ggml type id {type_id}"),
            }));
        }
    };
    if ne[0] % dtype.block_elems() as u64 != 0 {
        return Err(c.err(format!(
            "tensor '{name}' has rows of {} elements, not a whole number of {dtype} blocks of {}",
            ne[0],
            dtype.block_elems()
        )));
    }
    if dtype.bytes_for(numel).is_none() {
        return Err(c.err(format!("tensor '{name}' is too large ({numel} elements of {dtype})")));
    }
    let offset = c.u64(&|| format!("the data offset of tensor '{name}'"))?;
    let shape = ne.iter().rev().map(|&d| d as usize).collect();
    Ok(TensorInfo { name, shape, dtype, offset })
}

fn parse(file: Arc<MappedFile>) -> Result<GgufFile> {
    let path = file.path().to_path_buf();
    let bytes = file.bytes();
    let mut c = Cursor { path: &path, bytes, pos: 0 };

    if bytes.len() < 4 {
        return Err(c.err(format!("too short to be a GGUF file ({} bytes)", bytes.len())));
    }
    if bytes[..4] != GGUF_MAGIC {
        return Err(c.err(format!("not a GGUF file: the magic is {:02x?}, expected \"GGUF\"", &bytes[..4])));
    }
    c.pos = 4;
    let version = c.u32(&|| "the GGUF version".into())?;
    match version {
        2 | 3 => {}
        1 => return Err(c.err("GGUF version 1 is not supported (sluice reads versions 2 and 3)".into())),
        v if v & 0xffff == 0 => {
            return Err(c.err(format!(
                "the version field reads {v:#010x}: this looks like a big-endian GGUF file, \
                 and sluice reads little-endian files only"
            )));
        }
        v => return Err(c.err(format!("unsupported GGUF version {v} (sluice reads versions 2 and 3)"))),
    }
    // A tensor record takes at least 32 bytes: name length, n_dims, one dim, type, offset.
    let tensor_count = c.count(32, &|| "the tensor count".into())?;
    // A metadata record takes at least 13: key length, value type, a one-byte value.
    let kv_count = c.count(13, &|| "the metadata count".into())?;

    let mut kv = Vec::with_capacity(kv_count);
    let mut kv_index = HashMap::with_capacity(kv_count);
    let mut budget = MAX_ARRAY_ELEMENTS;
    for i in 0..kv_count {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let ty = c.u32(&|| format!("the value type of metadata key '{key}'"))?;
        let value = read_value(&mut c, ty, &key, 0, &mut budget)?;
        if kv_index.insert(key.clone(), kv.len()).is_some() {
            return Err(c.err(format!("metadata key '{key}' appears twice")));
        }
        kv.push((key, value));
    }

    let alignment = match kv_index.get("general.alignment").map(|&i| &kv[i].1) {
        None => GGUF_DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => a as usize,
            _ => {
                return Err(c.err(format!(
                    "metadata key 'general.alignment' is {v:?}; it must be a power of two (32 by default)"
                )));
            }
        },
    };

    // Re-check now that the metadata is known: each record needs 32 bytes at least.
    if tensor_count > c.remaining() / 32 {
        return Err(c.err(format!(
            "the tensor count is {tensor_count}, more than the {} bytes left after the metadata could hold",
            c.remaining()
        )));
    }
    let mut infos = Vec::with_capacity(tensor_count);
    let mut tensor_index = HashMap::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let info = read_tensor_info(&mut c, i)?;
        if tensor_index.insert(info.name.clone(), i).is_some() {
            return Err(c.err(format!("tensor '{}' appears twice", info.name)));
        }
        infos.push(info);
    }

    let header_end = c.pos;
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(infos.len());
    for info in infos {
        let name = info.name;
        if info.offset % alignment as u64 != 0 {
            return Err(c.err(format!(
                "tensor '{name}' has data offset {}, which is not a multiple of the alignment {alignment}",
                info.offset
            )));
        }
        let numel: usize = info.shape.iter().product();
        // Checked in read_tensor_info.
        let len = info.dtype.bytes_for(numel).unwrap_or(usize::MAX);
        let start = usize::try_from(info.offset).ok().and_then(|o| o.checked_add(data_offset));
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(s), Some(e)) if e <= bytes.len() => {
                tensors.push(TensorView::new(name, info.dtype, info.shape, Arc::clone(&file), s, len)?);
            }
            _ => {
                return Err(c.err(format!(
                    "tensor '{name}' ({} {:?}, {len} bytes at data offset {}) runs past the end of the file \
                     ({} bytes, data section from {data_offset})",
                    info.dtype,
                    info.shape,
                    info.offset,
                    bytes.len()
                )));
            }
        }
    }

    Ok(GgufFile { file, version, alignment, data_offset, kv, kv_index, tensors, tensor_index })
}

/// True when the file at `path` starts with the GGUF magic.
pub fn has_gguf_magic(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match f.read(&mut magic[got..]) {
            Ok(0) => return Ok(false),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(path, e)),
        }
    }
    Ok(magic == GGUF_MAGIC)
}
