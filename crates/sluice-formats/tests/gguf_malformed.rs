//! Malformed GGUF files give a `Format` error that names the file (and the key or tensor
//! at fault), never a panic or an allocation the file cannot back.

use std::path::{Path, PathBuf};

use sluice_core::{DType, Error};
use sluice_formats::{Checkpoint, GgufFile, GgufValue, GgufWriter};

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf-malformed");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Raw GGUF bytes, field by field, so that any field can be wrong.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn kv_u32(&mut self, k: &str, v: u32) -> &mut Self {
        self.str(k).u32(4).u32(v)
    }
    fn kv_str(&mut self, k: &str, v: &str) -> &mut Self {
        self.str(k).u32(8).str(v)
    }
    /// A tensor record: dims innermost first, as GGUF stores them.
    fn tensor(&mut self, name: &str, ne: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(ne.len() as u32);
        ne.iter().for_each(|&d| {
            self.u64(d);
        });
        self.u32(ty).u64(offset)
    }
    fn pad(&mut self, align: usize) -> &mut Self {
        let n = self.0.len().next_multiple_of(align) - self.0.len();
        self.bytes(&vec![0; n])
    }
    fn zeros(&mut self, n: usize) -> &mut Self {
        self.bytes(&vec![0; n])
    }
    fn write(&self, name: &str) -> PathBuf {
        let p = tmp(name);
        std::fs::write(&p, &self.0).unwrap();
        p
    }
}

/// Opening `path` fails with a Format error about `path` whose message holds `needle`.
#[track_caller]
fn expect_format(path: &Path, needle: &str) -> String {
    let e = match GgufFile::open(path) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e,
    };
    match &e {
        Error::Format { path: p, msg } => {
            assert_eq!(p, path);
            assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
            let shown = e.to_string();
            assert!(shown.contains(&path.display().to_string()), "{shown}");
            msg.clone()
        }
        other => panic!("{}: expected a Format error, got {other:?}", path.display()),
    }
}

/// A valid file: one tensor of 4 f32 at offset 0, aligned to 32.
fn one_tensor(name: &str, ne: &[u64], ty: u32, offset: u64, data_len: usize) -> Raw {
    let mut r = Raw::header(3, 1, 1);
    r.kv_str("general.architecture", "x").tensor(name, ne, ty, offset).pad(32).zeros(data_len);
    r
}

#[test]
fn a_well_formed_raw_file_opens() {
    let p = one_tensor("w", &[4], 0, 0, 16).write("ok.gguf");
    let g = GgufFile::open(&p).unwrap();
    assert_eq!(g.tensor("w").unwrap().shape, vec![4]);
    // Version 2 shares the layout.
    let mut r = Raw::header(2, 0, 1);
    r.kv_u32("k", 1);
    let g = GgufFile::open(&r.write("v2.gguf")).unwrap();
    assert_eq!(g.version(), 2);
}

#[test]
fn bad_magic_short_files_and_versions() {
    expect_format(&Raw(vec![]).write("empty.gguf"), "too short");
    expect_format(&Raw(b"GGU".to_vec()).write("three.gguf"), "too short");
    let mut bad = Raw::header(3, 0, 0);
    bad.0[3] = b'X';
    expect_format(&bad.write("magic.gguf"), "not a GGUF file");
    expect_format(&Raw(b"GGUF".to_vec()).write("noversion.gguf"), "truncated");
    expect_format(&Raw::header(1, 0, 0).write("v1.gguf"), "version 1 is not supported");
    expect_format(&Raw::header(4, 0, 0).write("v4.gguf"), "unsupported GGUF version 4");
    expect_format(&Raw::header(0, 0, 0).write("v0.gguf"), "version");
    // A big-endian writer stores 3 as 00 00 00 03.
    let mut be = Raw(b"GGUF".to_vec());
    be.bytes(&3u32.to_be_bytes()).bytes(&1u64.to_be_bytes()).bytes(&0u64.to_be_bytes());
    expect_format(&be.write("bigendian.gguf"), "big-endian");
}

#[test]
fn every_truncation_of_a_real_layout_is_an_error() {
    // A file with metadata of several kinds and three tensors, written by the writer.
    let full = tmp("trunc_full.gguf");
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", "llama")
        .add_u32("llama.block_count", 1)
        .add_str_array("tokenizer.ggml.tokens", &["a", "bb", "ccc"])
        .add_f32_array("tokenizer.ggml.scores", &[0.0, -1.0, -2.0])
        .add("nested", GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::I8(1)])]))
        .add_tensor("a", DType::F32, &[3], vec![1u8; 12])
        .add_tensor("b", DType::Q8_0, &[2, 32], vec![2u8; 68])
        .add_tensor("c", DType::F16, &[5], vec![3u8; 10]);
    w.write(&full).unwrap();
    let bytes = std::fs::read(&full).unwrap();
    let g = GgufFile::open(&full).unwrap();
    let data_end = g.tensors().iter().map(|t| t.offset() + t.len_bytes()).max().unwrap();
    drop(g);
    let p = tmp("trunc_cut.gguf");
    let mut messages = std::collections::BTreeSet::new();
    for len in 0..bytes.len() {
        std::fs::write(&p, &bytes[..len]).unwrap();
        if len >= data_end {
            // Only the padding after the last tensor is gone: still a whole file.
            GgufFile::open(&p).unwrap();
            continue;
        }
        let msg = match GgufFile::open(&p) {
            Ok(_) => panic!("a file cut to {len} of {} bytes opened", bytes.len()),
            Err(Error::Format { path, msg }) => {
                assert_eq!(path, p);
                msg
            }
            Err(other) => panic!("cut to {len}: {other:?}"),
        };
        messages.insert(msg.split(" at offset").next().unwrap().split(" needs").next().unwrap().to_string());
    }
    // The errors say what was being read: the sections, keys and tensors by name.
    let all = messages.iter().cloned().collect::<Vec<_>>().join("\n");
    for needle in ["too short", "tensor count", "'tokenizer.ggml.tokens'", "'nested'", "tensor 'b'", "tensor 'c'"] {
        assert!(all.contains(needle), "no truncation message mentions {needle}:\n{all}");
    }
}

#[test]
fn absurd_counts_and_lengths_allocate_nothing() {
    let mut r = Raw::header(3, u64::MAX, 0);
    expect_format(&r.write("tensor_count.gguf"), "tensor count");
    r = Raw::header(3, 0, 1 << 60);
    expect_format(&r.write("kv_count.gguf"), "metadata count");
    // The counts fit the file, but the tensors do not fit what the metadata left.
    r = Raw::header(3, 2, 1);
    r.kv_str("general.architecture", "x").zeros(40);
    expect_format(&r.write("tensor_count_after_kv.gguf"), "tensor");

    r = Raw::header(3, 0, 1);
    r.u64(u64::MAX - 3).bytes(b"key").zeros(16);
    expect_format(&r.write("key_len.gguf"), "metadata key #0");

    r = Raw::header(3, 0, 1);
    r.str("general.name").u32(8).u64(1 << 50).bytes(b"abc");
    expect_format(&r.write("string_len.gguf"), "'general.name'");

    r = Raw::header(3, 0, 1);
    r.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(1 << 40).str("a");
    expect_format(&r.write("array_len.gguf"), "'tokenizer.ggml.tokens'");

    // 10^9 one-byte elements would fit a huge file, but not this one.
    r = Raw::header(3, 0, 1);
    r.str("bytes").u32(9).u32(0).u64(1_000_000_000).zeros(100);
    expect_format(&r.write("array_u8_len.gguf"), "'bytes'");

    r = Raw::header(3, 1, 0);
    r.u64(1 << 62).bytes(b"name");
    r.zeros(64);
    expect_format(&r.write("tensor_name_len.gguf"), "tensor #0");
}

#[test]
fn bad_metadata_values() {
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(13).u32(0);
    expect_format(&r.write("value_type.gguf"), "'k' has unknown value type 13");

    r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(77).u64(1).u32(0);
    expect_format(&r.write("array_type.gguf"), "'k' is an array of unknown value type 77");

    // Arrays nested deeper than anything real.
    r = Raw::header(3, 0, 1);
    r.str("deep");
    r.u32(9);
    for _ in 0..10 {
        r.u32(9).u64(1);
    }
    r.u32(4).u64(1).u32(0);
    expect_format(&r.write("deep.gguf"), "'deep' nests arrays");

    r = Raw::header(3, 0, 2);
    r.kv_u32("dup", 1).kv_u32("dup", 2);
    expect_format(&r.write("dup_key.gguf"), "'dup' appears twice");

    r = Raw::header(3, 0, 1);
    r.u64(2).bytes(&[0xff, 0xfe]).u32(4).u32(0);
    expect_format(&r.write("key_utf8.gguf"), "not valid UTF-8");

    r = Raw::header(3, 0, 1);
    r.str("general.name").u32(8).u64(3).bytes(&[b'a', 0xc3, 0x28]);
    expect_format(&r.write("value_utf8.gguf"), "'general.name' at offset");

    r = Raw::header(3, 0, 1);
    r.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(2).str("ok").u64(1).bytes(&[0x80]);
    expect_format(&r.write("array_utf8.gguf"), "'tokenizer.ggml.tokens'");

    for (name, align) in [("align0", 0u32), ("align3", 3), ("align_huge", 1 << 31)] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", align);
        expect_format(&r.write(&format!("{name}.gguf")), "general.alignment");
    }
    r = Raw::header(3, 0, 1);
    r.kv_str("general.alignment", "32");
    expect_format(&r.write("align_str.gguf"), "general.alignment");
}

#[test]
fn bad_tensor_records() {
    let cases: Vec<(&str, Raw, &str)> = vec![
        ("ndims5", one_tensor("blk.0.w", &[1, 1, 1, 1, 4], 0, 0, 16), "'blk.0.w' has 5 dimensions"),
        ("ndims0", one_tensor("blk.0.w", &[], 0, 0, 16), "'blk.0.w' has 0 dimensions"),
        ("zero_dim", one_tensor("blk.0.w", &[4, 0], 0, 0, 16), "'blk.0.w' has a zero-sized dimension"),
        ("overflow", one_tensor("blk.0.w", &[1 << 32, 1 << 32, 1 << 8], 0, 0, 16), "'blk.0.w' has dimensions"),
        ("overflow_i64", one_tensor("blk.0.w", &[u64::MAX], 0, 0, 16), "'blk.0.w' has dimensions"),
        ("unknown_type", one_tensor("blk.0.w", &[4], 99, 0, 16), "'blk.0.w' has unknown ggml type id 99"),
        (
            "iq2_xxs",
            one_tensor("blk.0.ffn_down.weight", &[256], 16, 0, 66),
            "tensor 'blk.0.ffn_down.weight' has type IQ2_XXS (16), which sluice does not read",
        ),
        ("q2_k", one_tensor("blk.0.w", &[256], 10, 0, 84), "type Q2_K (10)"),
        ("i32", one_tensor("blk.0.w", &[4], 26, 0, 16), "type I32 (26)"),
        ("partial_block", one_tensor("blk.0.w", &[33, 2], 8, 0, 200), "'blk.0.w' has rows of 33 elements"),
        ("misaligned", one_tensor("blk.0.w", &[4], 0, 4, 32), "'blk.0.w' has data offset 4"),
        ("past_end", one_tensor("blk.0.w", &[8], 0, 0, 16), "'blk.0.w'"),
        ("far_past_end", one_tensor("blk.0.w", &[4], 0, 1 << 40, 16), "runs past the end"),
        ("offset_overflow", one_tensor("blk.0.w", &[4], 0, u64::MAX - 31, 16), "runs past the end"),
        ("no_data", one_tensor("blk.0.w", &[4], 0, 0, 0), "runs past the end"),
    ];
    for (name, raw, needle) in cases {
        expect_format(&raw.write(&format!("{name}.gguf")), needle);
    }

    let mut r = Raw::header(3, 2, 0);
    r.tensor("same", &[4], 0, 0).tensor("same", &[4], 0, 32).pad(32).zeros(64);
    expect_format(&r.write("dup_tensor.gguf"), "'same' appears twice");

    let mut r = Raw::header(3, 1, 0);
    r.u64(3).bytes(&[b'w', 0xff, b'x']).u32(1).u64(4).u32(0).u64(0).pad(32).zeros(16);
    expect_format(&r.write("name_utf8.gguf"), "the name of tensor #0");
}

#[test]
fn checkpoint_open_checks_the_magic_and_the_metadata_types() {
    // A .gguf name with other bytes inside.
    let p = tmp("not_really.gguf");
    std::fs::write(&p, b"{\"hello\": 1}").unwrap();
    let e = Checkpoint::open(&p).err().unwrap();
    assert!(matches!(&e, Error::Format { path, .. } if path == &p), "{e:?}");
    assert!(e.to_string().contains("magic"), "{e}");

    // GGUF bytes under another name are still read as GGUF.
    let p = tmp("model.bin");
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", "llama").add_str("llama.block_count", "two");
    w.write(&p).unwrap();
    let e = Checkpoint::open(&p).err().unwrap();
    match &e {
        Error::Format { path, msg } => {
            assert_eq!(path, &p);
            assert!(msg.contains("'llama.block_count'") && msg.contains("STRING"), "{msg}");
        }
        other => panic!("{other:?}"),
    }

    // An architecture sluice does not know.
    let p = tmp("mamba.gguf");
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", "mamba");
    w.write(&p).unwrap();
    match Checkpoint::open(&p).err().unwrap() {
        Error::UnknownArchitecture { path, model_type, .. } => {
            assert_eq!(path, p);
            assert_eq!(model_type, "mamba");
        }
        other => panic!("{other:?}"),
    }

    // Neither a folder nor GGUF.
    let p = tmp("notes.txt");
    std::fs::write(&p, b"hi").unwrap();
    assert!(matches!(Checkpoint::open(&p), Err(Error::Format { .. })));
}
