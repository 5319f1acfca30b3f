//! GGUF files written by `GgufWriter` read back exactly through `GgufFile`.

use std::io::Write;
use std::path::PathBuf;

use sluice_core::{DType, Error};
use sluice_formats::gguf::{GGUF_DEFAULT_ALIGNMENT, dtype_from_ggml, ggml_type_id, ggml_type_name};
use sluice_formats::{GgufFile, GgufValue, GgufWriter};

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf-roundtrip");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn metadata_of_every_type_round_trips_in_order() {
    let path = tmp("metadata.gguf");
    let values = vec![
        ("a.u8", GgufValue::U8(200)),
        ("a.i8", GgufValue::I8(-7)),
        ("a.u16", GgufValue::U16(65_000)),
        ("a.i16", GgufValue::I16(-30_000)),
        ("a.u32", GgufValue::U32(4_000_000_000)),
        ("a.i32", GgufValue::I32(-2_000_000_000)),
        ("a.u64", GgufValue::U64(u64::MAX)),
        ("a.i64", GgufValue::I64(i64::MIN)),
        ("a.f32", GgufValue::F32(1e-6)),
        ("a.f64", GgufValue::F64(std::f64::consts::PI)),
        ("a.bool", GgufValue::Bool(true)),
        ("a.string", GgufValue::String("héllo ▁world".into())),
        ("a.empty_string", GgufValue::String(String::new())),
        ("a.strings", GgufValue::Array(vec![GgufValue::String("x".into()), GgufValue::String("".into())])),
        ("a.i32s", GgufValue::Array(vec![GgufValue::I32(-1), GgufValue::I32(3)])),
        ("a.bools", GgufValue::Array(vec![GgufValue::Bool(true), GgufValue::Bool(false)])),
        ("a.empty", GgufValue::Array(vec![])),
        (
            "a.nested",
            GgufValue::Array(vec![
                GgufValue::Array(vec![GgufValue::U32(1), GgufValue::U32(2)]),
                GgufValue::Array(vec![GgufValue::U32(3)]),
            ]),
        ),
    ];
    let mut w = GgufWriter::new();
    for (k, v) in &values {
        w.add(k, v.clone());
    }
    w.write(&path).unwrap();

    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), GGUF_DEFAULT_ALIGNMENT);
    assert_eq!(g.keys().collect::<Vec<_>>(), values.iter().map(|(k, _)| *k).collect::<Vec<_>>());
    for (k, v) in &values {
        assert_eq!(g.get(k), Some(v), "{k}");
    }
    assert!(g.tensors().is_empty());
    assert_eq!(g.get("missing"), None);
}

#[test]
fn typed_helpers_convert_and_name_the_key_on_a_wrong_type() {
    let path = tmp("typed.gguf");
    let mut w = GgufWriter::new();
    w.add_str("s", "text")
        .add("u8", GgufValue::U8(5))
        .add("i64", GgufValue::I64(-5))
        .add_f32("f", 0.5)
        .add_bool("b", false)
        .add_str_array("sa", &["a", "b"])
        .add_f32_array("fa", &[1.5, -2.0])
        .add("ia", GgufValue::Array(vec![GgufValue::U16(7), GgufValue::U16(9)]))
        .add_i32_array("ia32", &[-3, 4]);
    w.write(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();

    assert_eq!(g.get_str("s").unwrap(), Some("text"));
    assert_eq!(g.get_u64("u8").unwrap(), Some(5));
    assert_eq!(g.get_f64("u8").unwrap(), Some(5.0));
    assert_eq!(g.get_f64("f").unwrap(), Some(0.5));
    assert_eq!(g.get_bool("b").unwrap(), Some(false));
    assert_eq!(g.get_str_array("sa").unwrap(), Some(vec!["a", "b"]));
    assert_eq!(g.get_f32_array("fa").unwrap(), Some(vec![1.5, -2.0]));
    assert_eq!(g.get_i64_array("ia").unwrap(), Some(vec![7, 9]));
    assert_eq!(g.get_i64_array("ia32").unwrap(), Some(vec![-3, 4]));
    assert_eq!(g.get_u64("absent").unwrap(), None);
    assert_eq!(g.get_str_array("absent").unwrap(), None);

    let wrong: Vec<(&str, Error)> = vec![
        ("s", g.get_u64("s").unwrap_err()),
        ("i64", g.get_u64("i64").unwrap_err()),
        ("u8", g.get_str("u8").unwrap_err()),
        ("s", g.get_f64("s").unwrap_err()),
        ("u8", g.get_bool("u8").unwrap_err()),
        ("sa", g.get_i64_array("sa").unwrap_err()),
        ("fa", g.get_str_array("fa").unwrap_err()),
        ("s", g.get_f32_array("s").unwrap_err()),
        ("fa", g.get_i64_array("fa").unwrap_err()),
    ];
    for (key, e) in wrong {
        match &e {
            Error::Format { path: p, msg } => {
                assert_eq!(p, &path);
                assert!(msg.contains(&format!("'{key}'")), "{msg}");
            }
            other => panic!("expected a Format error, got {other:?}"),
        }
        assert!(e.to_string().contains("typed.gguf"), "{e}");
    }
}

#[test]
fn tensors_round_trip_with_shapes_types_and_aligned_offsets() {
    let path = tmp("tensors.gguf");
    // (name, dtype, shape outermost first)
    let specs: Vec<(&str, DType, Vec<usize>)> = vec![
        ("f32.vec", DType::F32, vec![7]),
        ("f16.mat", DType::F16, vec![3, 5]),
        ("bf16.3d", DType::BF16, vec![2, 3, 4]),
        ("q8_0", DType::Q8_0, vec![3, 64]),
        ("q4_0", DType::Q4_0, vec![2, 32]),
        ("q4_1", DType::Q4_1, vec![2, 32]),
        ("q5_0", DType::Q5_0, vec![1, 32]),
        ("q5_1", DType::Q5_1, vec![1, 96]),
        ("q4_k", DType::Q4K, vec![2, 256]),
        ("q5_k", DType::Q5K, vec![1, 512]),
        ("q6_k.4d", DType::Q6K, vec![2, 1, 2, 256]),
        ("mxfp4.experts", DType::MXFP4, vec![4, 3, 64]),
    ];
    let datas: Vec<Vec<u8>> = specs
        .iter()
        .enumerate()
        .map(|(i, (_, d, s))| pattern(d.bytes_for(s.iter().product()).unwrap(), i as u8))
        .collect();
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", "test");
    for ((name, dtype, shape), data) in specs.iter().zip(&datas) {
        w.add_tensor(name, *dtype, shape, data.as_slice());
    }
    w.write(&path).unwrap();

    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.tensors().len(), specs.len());
    for (t, ((name, dtype, shape), data)) in g.tensors().iter().zip(specs.iter().zip(&datas)) {
        assert_eq!(&t.name, name);
        assert_eq!(t.dtype, *dtype);
        assert_eq!(&t.shape, shape);
        assert_eq!(t.bytes(), data.as_slice(), "{name}");
        assert_eq!((t.offset() - g.data_offset()) % g.alignment(), 0, "{name}");
        assert_eq!(t.offset() % g.alignment(), 0);
        assert_eq!(g.tensor(name).unwrap().offset(), t.offset());
    }
    assert!(g.tensor("nope").is_none());
    // The view helpers work on GGUF tensors: expert 2 of the 3-D MXFP4 tensor.
    let e = g.tensor("mxfp4.experts").unwrap().index0(2);
    assert_eq!(e.shape, vec![3, 64]);
    let step = 3 * 2 * 17;
    assert_eq!(e.bytes(), &datas[11][2 * step..3 * step]);
    assert_eq!(g.tensor("f32.vec").unwrap().to_f32_vec().unwrap().len(), 7);
}

#[test]
fn streamed_tensors_from_readers_and_callbacks_at_a_large_alignment() {
    let path = tmp("streamed.gguf");
    let a = pattern(4 * 10, 1);
    let b = pattern(2 * 100, 2);
    let c = pattern(34 * 8, 3);
    let mut w = GgufWriter::new();
    w.set_alignment(4096);
    w.add_tensor_reader("from_reader", DType::F32, &[10], std::io::Cursor::new(a.clone()));
    let bc = b.clone();
    w.add_tensor_fn("from_fn", DType::F16, &[4, 25], move |out: &mut dyn Write| {
        // In pieces, as a generator would.
        for chunk in bc.chunks(33) {
            out.write_all(chunk)?;
        }
        Ok(())
    });
    w.add_tensor("bytes", DType::Q8_0, &[8, 32], c.clone());
    w.write(&path).unwrap();
    assert!(!tmp("streamed.gguf.partial").exists());

    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.alignment(), 4096);
    assert_eq!(g.get_u64("general.alignment").unwrap(), Some(4096));
    assert_eq!(g.data_offset() % 4096, 0);
    assert_eq!(g.tensor("from_reader").unwrap().bytes(), a.as_slice());
    assert_eq!(g.tensor("from_fn").unwrap().bytes(), b.as_slice());
    assert_eq!(g.tensor("bytes").unwrap().bytes(), c.as_slice());
    for t in g.tensors() {
        assert_eq!(t.offset() % 4096, 0, "{}", t.name);
    }
    assert_eq!(std::fs::metadata(&path).unwrap().len() % 4096, 0);
}

#[test]
fn the_writer_refuses_bad_declarations_and_leaves_no_file() {
    type Build = Box<dyn Fn(&mut GgufWriter<'static>)>;
    let cases: Vec<(&str, Build, &str)> = vec![
        (
            "dup_tensor",
            Box::new(|w| {
                w.add_tensor("t", DType::F32, &[1], vec![0; 4]).add_tensor("t", DType::F32, &[1], vec![0; 4]);
            }),
            "'t' is added twice",
        ),
        (
            "short_bytes",
            Box::new(|w| {
                w.add_tensor("t", DType::F32, &[2], vec![0; 4]);
            }),
            "expected 8",
        ),
        (
            "bad_row",
            Box::new(|w| {
                w.add_tensor("t", DType::Q8_0, &[1, 31], vec![0; 34]);
            }),
            "whole number",
        ),
        (
            "five_dims",
            Box::new(|w| {
                w.add_tensor("t", DType::F32, &[1, 1, 1, 1, 1], vec![0; 4]);
            }),
            "shape",
        ),
        (
            "zero_dim",
            Box::new(|w| {
                w.add_tensor("t", DType::F32, &[0, 4], vec![]);
            }),
            "shape",
        ),
        (
            "mixed_array",
            Box::new(|w| {
                w.add("k", GgufValue::Array(vec![GgufValue::U32(1), GgufValue::String("x".into())]));
            }),
            "'k'",
        ),
        (
            "fn_short",
            Box::new(|w| {
                w.add_tensor_fn("t", DType::F32, &[4], |out: &mut dyn Write| out.write_all(&[0; 12]));
            }),
            "12 bytes were written, expected 16",
        ),
        (
            "reader_short",
            Box::new(|w| {
                w.add_tensor_reader("t", DType::F32, &[4], std::io::Cursor::new(vec![0u8; 10]));
            }),
            "gave 10 bytes",
        ),
    ];
    for (name, build, needle) in cases {
        let path = tmp(&format!("bad_{name}.gguf"));
        let mut w = GgufWriter::new();
        build(&mut w);
        let e = w.write(&path).unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{name}: {e:?}");
        assert!(e.to_string().contains(needle), "{name}: {e}");
        assert!(e.to_string().contains(&format!("bad_{name}.gguf")), "{name}: {e}");
        assert!(!path.exists(), "{name}");
        assert!(!tmp(&format!("bad_{name}.gguf.partial")).exists(), "{name}");
    }
}

#[test]
fn ggml_type_ids_match_gguf_py() {
    // gguf-py's GGMLQuantizationType.
    let table = [
        (0, DType::F32),
        (1, DType::F16),
        (2, DType::Q4_0),
        (3, DType::Q4_1),
        (6, DType::Q5_0),
        (7, DType::Q5_1),
        (8, DType::Q8_0),
        (12, DType::Q4K),
        (13, DType::Q5K),
        (14, DType::Q6K),
        (30, DType::BF16),
        (39, DType::MXFP4),
    ];
    for (id, d) in table {
        assert_eq!(dtype_from_ggml(id), Some(d));
        assert_eq!(ggml_type_id(d), id);
        assert_eq!(ggml_type_name(id), Some(d.name()));
    }
    for id in [9, 10, 11, 15, 16, 23, 24, 28, 29, 34, 35, 40, 41] {
        assert_eq!(dtype_from_ggml(id), None, "{id}");
        assert!(ggml_type_name(id).is_some());
    }
    assert_eq!(ggml_type_name(16), Some("IQ2_XXS"));
    assert_eq!(ggml_type_name(1000), None);
}

/// Ranges of a mapped file copied into memory hold the same bytes under the same
/// path, and the copy refuses a file that changed size after it was opened.
#[test]
fn ranges_copied_into_memory_are_the_file() {
    let path = tmp("copy.gguf");
    let (a, b) = (pattern(DType::Q8_0.bytes_for(40 * 1024).unwrap(), 3), pattern(DType::F32.bytes_for(33).unwrap(), 5));
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", "test");
    w.add_tensor("a", DType::Q8_0, &[40, 1024], a.as_slice());
    w.add_tensor("b", DType::F32, &[33], b.as_slice());
    w.write(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    let (ta, tb) = (g.tensor("a").unwrap(), g.tensor("b").unwrap());
    let file = ta.file().clone();
    let ranges = [(tb.offset(), tb.len_bytes()), (ta.offset(), ta.len_bytes())];
    let mut seen = Vec::new();
    let (copy, offs) = file.copy_ranges(&ranges, &mut |n| seen.push(n)).unwrap();
    assert_eq!(copy.path(), path.as_path());
    assert_eq!(&copy.bytes()[offs[0]..offs[0] + b.len()], b.as_slice());
    assert_eq!(&copy.bytes()[offs[1]..offs[1] + a.len()], a.as_slice());
    assert!(offs.iter().all(|o| o % 64 == 0));
    assert_eq!(seen.last().copied(), Some((a.len() + b.len()) as u64));
    std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"more").unwrap();
    match file.copy_ranges(&ranges, &mut |_| {}) {
        Err(Error::Format { path: p, msg }) => assert!(p == path && msg.contains("changed size"), "{msg}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a grown file was copied"),
    }
}
