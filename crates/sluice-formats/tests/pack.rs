//! The packed layout and synthetic checkpoints: a packed folder opens to the same spec and
//! the same tensor bytes as its source, with every expert one aligned contiguous range of
//! experts.bin; `synth` writes the geometry it is asked for, and its packed form is what
//! `pack` makes of its GGUF form; bad folders are refused with an error naming the file.

use std::path::{Path, PathBuf};

use sluice_core::{DType, Error, RouterKind};
use sluice_formats::pack::{self, EXPERT_ALIGN, Manifest};
use sluice_formats::synth::{Geometry, Synth, SynthOptions};
use sluice_formats::{Checkpoint, TensorId, TensorKind};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)
}

/// A fresh scratch folder.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pack").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn synth(geometry: &str, skew: f32, seed: u64) -> Synth {
    let geometry = Geometry::named(geometry).unwrap();
    Synth::new(SynthOptions { geometry, quant: DType::Q4K, skew, seed, tuning: Default::default() }).unwrap()
}

fn quiet(_: u64) {}

/// A synthetic GGUF in a scratch folder.
fn synth_gguf(geometry: &str, tag: &str) -> PathBuf {
    let path = scratch(tag).join(format!("{geometry}.gguf"));
    synth(geometry, 0.0, 1).write_gguf(&path, &quiet).unwrap();
    path
}

fn pack_to(src: &Path, tag: &str) -> PathBuf {
    let out = scratch(tag).join("packed");
    let ckpt = Checkpoint::open(src).unwrap();
    pack::pack(&ckpt, &out, &quiet).unwrap();
    out
}

/// A packed folder holds what its source holds: the same spec, every tensor under its
/// own name with the same bytes, and the same experts, each one aligned contiguous run.
fn assert_same_model(src: &Checkpoint, packed: &Checkpoint) {
    assert!(packed.packed().is_some() && src.packed().is_none());
    assert_eq!(packed.spec, src.spec);
    let expert_bytes = |c: &Checkpoint| -> u64 {
        (0..c.spec.n_layers())
            .filter_map(|l| c.spec.layers[l].moe.as_ref().map(|m| (l, m)))
            .flat_map(|(l, m)| c.experts(l, m, c.spec.hidden_size).unwrap())
            .map(|x| x.bytes() as u64)
            .sum()
    };
    let total = |c: &Checkpoint| c.tensors().iter().map(|t| t.len_bytes() as u64).sum::<u64>();
    assert_eq!(expert_bytes(packed), expert_bytes(src));
    assert_eq!(total(packed) - expert_bytes(packed), total(src) - expert_bytes(src), "resident bytes");
    // Everything the packed folder holds outside experts.bin is the source's, unchanged.
    let experts_file = packed.packed().unwrap().experts_file.clone();
    let mut resident = 0;
    for p in packed.tensors().into_iter().filter(|p| p.path() != experts_file) {
        let t = src.tensors().into_iter().find(|t| t.name == p.name).unwrap_or_else(|| panic!("{}", p.name));
        assert_eq!((p.dtype, &p.shape), (t.dtype, &t.shape), "{}", t.name);
        assert!(p.bytes() == t.bytes(), "{}", t.name);
        assert_ne!(p.path(), t.path());
        resident += t.len_bytes() as u64;
    }
    assert_eq!(resident, total(src) - expert_bytes(src), "every resident tensor is in the packed model");
    for (l, ls) in src.spec.layers.iter().enumerate() {
        let Some(moe) = &ls.moe else { continue };
        let a = src.experts(l, moe, src.spec.hidden_size).unwrap();
        let b = packed.experts(l, moe, packed.spec.hidden_size).unwrap();
        assert_eq!(a.len(), b.len());
        for (e, (x, y)) in a.iter().zip(&b).enumerate() {
            for (p, q) in [(&x.gate, &y.gate), (&x.up, &y.up), (&x.down, &y.down)] {
                assert_eq!((p.dtype, &p.shape), (q.dtype, &q.shape), "layer {l} expert {e}");
                assert!(p.bytes() == q.bytes(), "layer {l} expert {e} {}", q.name);
                assert_eq!(q.path(), experts_file);
            }
            // gate, up, down in order, starting on a 4 KiB boundary, with at most the
            // 32-byte alignment between them.
            assert_eq!(y.gate.offset() as u64 % EXPERT_ALIGN, 0, "layer {l} expert {e}");
            assert!(y.up.offset() - (y.gate.offset() + y.gate.len_bytes()) < 32);
            assert!(y.down.offset() - (y.up.offset() + y.up.len_bytes()) < 32);
        }
    }
}

#[test]
fn packing_each_moe_fixture_keeps_the_model() {
    for name in ["qwen3-moe", "qwen3-moe-fused", "gemma4-moe"] {
        let src = Checkpoint::open(&fixture(name)).unwrap();
        let out = pack_to(&fixture(name), name);
        for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
            assert!(out.join(f).is_file(), "{name}: {f} copied");
        }
        assert!(out.join("model.safetensors").is_file() && !out.join("model.gguf").exists());
        let packed = Checkpoint::open(&out).unwrap();
        assert_same_model(&src, &packed);
        // Packing a packed folder gives the same again.
        let again = pack_to(&out, &format!("{name}-again"));
        assert_same_model(&src, &Checkpoint::open(&again).unwrap());
    }
}

#[test]
fn packing_a_gguf_keeps_the_model_and_its_metadata() {
    for g in ["tiny-moe", "tiny-gemma4"] {
        let path = synth_gguf(g, &format!("gguf-{g}"));
        let src = Checkpoint::open(&path).unwrap();
        let out = pack_to(&path, &format!("gguf-{g}-packed"));
        let packed = Checkpoint::open(&out).unwrap();
        assert_same_model(&src, &packed);
        let (a, b) = (src.gguf().unwrap(), packed.gguf().unwrap());
        assert_eq!(a.metadata(), b.metadata(), "{g}: the same metadata, in order");
        assert!(b.tensors().iter().all(|t| !t.name.contains("_exps.weight")), "{g}: no expert tensor in model.gguf");
        let m = Manifest::load(&out).unwrap();
        assert_eq!(m.experts.bytes, std::fs::metadata(out.join("experts.bin")).unwrap().len());
        assert_eq!(m.experts.bytes % EXPERT_ALIGN, 0);
    }
}

#[test]
fn synth_packed_is_pack_of_synth_gguf() {
    for g in ["tiny-moe", "tiny-gemma4"] {
        let s = synth(g, 1.5, 9);
        let dir = scratch(&format!("direct-{g}"));
        let gguf = dir.join("model.gguf");
        s.write_gguf(&gguf, &quiet).unwrap();
        let direct = dir.join("direct");
        let summary = s.write_packed(&direct, &quiet).unwrap();
        assert_eq!(summary.experts, s.opts.geometry.n_layers * s.opts.geometry.n_experts);
        let packed = pack_to(&gguf, &format!("direct-{g}-packed"));
        for f in ["model.gguf", "experts.bin"] {
            let (x, y) = (std::fs::read(direct.join(f)).unwrap(), std::fs::read(packed.join(f)).unwrap());
            assert!(x == y, "{g}: {f} differs between synth --packed and pack of the GGUF");
        }
        let (x, y) = (Manifest::load(&direct).unwrap(), Manifest::load(&packed).unwrap());
        assert_eq!(
            x.layers.iter().map(|l| &l.experts).collect::<Vec<_>>(),
            y.layers.iter().map(|l| &l.experts).collect::<Vec<_>>()
        );
        assert_eq!(Checkpoint::open(&direct).unwrap().spec, Checkpoint::open(&gguf).unwrap().spec);
        // The same seed gives the same bytes.
        let again = dir.join("again.gguf");
        s.write_gguf(&again, &quiet).unwrap();
        assert!(std::fs::read(&again).unwrap() == std::fs::read(&gguf).unwrap());
    }
}

#[test]
fn every_weight_type_writes_and_packs() {
    // Every type but F32, whose experts would only make the test slow.
    for quant in DType::ALL.into_iter().filter(|&d| d != DType::F32) {
        for g in ["tiny-moe", "tiny-gemma4"] {
            let opts = SynthOptions { quant, ..synth(g, 0.5, 2).opts };
            let s = Synth::new(opts).unwrap();
            let dir = scratch(&format!("types-{g}-{quant}"));
            let gguf = dir.join("m.gguf");
            s.write_gguf(&gguf, &quiet).unwrap();
            s.write_packed(&dir.join("packed"), &quiet).unwrap();
            let (a, b) = (Checkpoint::open(&gguf).unwrap(), Checkpoint::open(&dir.join("packed")).unwrap());
            assert_eq!(a.spec, b.spec, "{g} {quant}");
            assert_eq!(a.spec.weight_dtype, Some(quant), "{g} {quant}");
            assert!(std::fs::metadata(&gguf).unwrap().len() > s.total_bytes());
        }
    }
}

#[test]
fn synth_writes_the_geometry() {
    let s = synth("tiny-moe", 0.0, 0);
    let g = s.opts.geometry.clone();
    let path = scratch("geometry").join("tiny.gguf");
    s.write_gguf(&path, &quiet).unwrap();
    let c = Checkpoint::open(&path).unwrap();
    let spec = &c.spec;
    assert_eq!(spec.arch, "qwen3moe");
    assert_eq!((spec.n_layers(), spec.hidden_size, spec.vocab_size), (g.n_layers, g.hidden, g.vocab));
    assert!(!spec.tie_word_embeddings);
    assert_eq!(spec.weight_dtype, Some(DType::Q4K));
    for l in &spec.layers {
        let a = &l.attention;
        assert_eq!((a.n_heads, a.n_kv_heads, a.head_dim, a.window, a.qk_norm), (4, 2, 64, None, true));
        let m = l.moe.as_ref().unwrap();
        assert_eq!((m.n_experts, m.top_k, m.intermediate), (16, 4, 128));
        assert_eq!(m.router, RouterKind::Softmax { normalize_top_k: true });
    }
    // The down experts' rows (128) are not whole Q4_K super-blocks: Q5_0, as llama.cpp does.
    let gg = c.gguf().unwrap();
    assert_eq!(gg.tensor("blk.0.ffn_down_exps.weight").unwrap().dtype, DType::Q5_0);
    assert_eq!(gg.tensor("blk.0.ffn_gate_exps.weight").unwrap().dtype, DType::Q4K);
    assert_eq!(gg.tensor("output.weight").unwrap().dtype, DType::Q6K);
    assert_eq!(gg.tensor("blk.0.ffn_gate_inp.weight").unwrap().dtype, DType::F32);
    assert_eq!(gg.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap().len(), g.vocab);
    assert!(gg.get_str("tokenizer.chat_template").unwrap().unwrap().contains("<|im_start|>"));
    let expert_bytes: u64 = (0..spec.n_layers())
        .flat_map(|l| c.experts(l, spec.layers[l].moe.as_ref().unwrap(), g.hidden).unwrap())
        .map(|x| x.bytes() as u64)
        .sum();
    assert_eq!(expert_bytes, s.expert_bytes());
    assert_eq!(c.tensors().iter().map(|t| t.len_bytes() as u64).sum::<u64>(), s.total_bytes());

    // --layers keeps the first layers, byte for byte.
    let cut = Synth::new(SynthOptions { geometry: g.clone().with_layers(2).unwrap(), ..s.opts.clone() }).unwrap();
    let cut_path = scratch("geometry-cut").join("tiny2.gguf");
    cut.write_gguf(&cut_path, &quiet).unwrap();
    let c2 = Checkpoint::open(&cut_path).unwrap();
    assert_eq!(c2.spec.n_layers(), 2);
    let id = TensorId::layer(1, TensorKind::ExpsDown);
    assert!(c2.get(id).unwrap().bytes() == c.get(id).unwrap().bytes());
    assert!(g.with_layers(0).is_err());
}

#[test]
fn synth_writes_gemma4s_geometry() {
    let s = synth("tiny-gemma4", 0.0, 0);
    let path = scratch("gemma4").join("g.gguf");
    s.write_gguf(&path, &quiet).unwrap();
    let spec = Checkpoint::open(&path).unwrap().spec;
    assert_eq!(spec.arch, "gemma4");
    assert!(spec.tie_word_embeddings);
    assert_eq!(spec.final_logit_softcap, Some(30.0));
    let shape: Vec<_> = spec
        .layers
        .iter()
        .map(|l| (l.attention.window, l.attention.n_kv_heads, l.attention.head_dim, l.attention.k_eq_v, l.mlp))
        .collect();
    let sliding = (Some(16), 2, 64, false, Some(192));
    assert_eq!(shape, vec![sliding, sliding, sliding, sliding, sliding, (None, 1, 128, true, Some(192))]);
    let rotated = spec.layers[5].attention.rope.inv_freq.iter().filter(|&&f| f != 0.0).count();
    assert_eq!(rotated, 16, "a quarter of the full layer's 64 pairs rotate");
    assert!(spec.layers.iter().all(|l| l.moe.as_ref().map(|m| (m.n_experts, m.top_k, m.intermediate, m.router))
        == Some((16, 4, 128, RouterKind::Gemma4))));

    // Cut to 4 layers, the last is full attention.
    let cut = Synth::new(SynthOptions { geometry: s.opts.geometry.clone().with_layers(4).unwrap(), ..s.opts.clone() });
    let path = scratch("gemma4-cut").join("g4.gguf");
    cut.unwrap().write_gguf(&path, &quiet).unwrap();
    let spec = Checkpoint::open(&path).unwrap().spec;
    let full: Vec<bool> = spec.layers.iter().map(|l| l.attention.window.is_none()).collect();
    assert_eq!(full, vec![false, false, false, true]);
}

#[test]
fn real_geometries_have_the_expected_sizes() {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let size = |name: &str, layers: Option<usize>| {
        let mut g = Geometry::named(name).unwrap();
        if let Some(n) = layers {
            g = g.with_layers(n).unwrap();
        }
        let s =
            Synth::new(SynthOptions { geometry: g, quant: DType::Q4K, skew: 0.9, seed: 0, tuning: Default::default() })
                .unwrap();
        (gib(s.total_bytes()), gib(s.expert_bytes()))
    };
    let (t, e) = size("qwen3-30b-a3b", None);
    assert!((15.5..16.5).contains(&t) && e / t > 0.94, "{t} {e}");
    let (t, _) = size("qwen3-235b-a22b", Some(24));
    assert!((31.0..33.0).contains(&t), "{t}");
    let (t, e) = size("gemma4-26b-a4b", None);
    assert!((13.0..16.0).contains(&t) && e / t > 0.8, "{t} {e}");
}

fn format_error(e: Error) -> (PathBuf, String) {
    match e {
        Error::Format { path, msg } => (path, msg),
        other => panic!("expected a format error, got {other}"),
    }
}

#[test]
fn a_dense_model_has_nothing_to_pack() {
    let ckpt = Checkpoint::open(&fixture("qwen3")).unwrap();
    let out = scratch("dense").join("packed");
    let e = pack::pack(&ckpt, &out, &quiet).unwrap_err().to_string();
    assert!(e.contains("no routed experts") && e.contains("qwen3"), "{e}");
    assert!(!out.exists(), "nothing is left behind");
}

#[test]
fn packing_into_a_folder_with_files_is_refused() {
    let ckpt = Checkpoint::open(&fixture("qwen3-moe")).unwrap();
    let out = scratch("occupied");
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let e = pack::pack(&ckpt, &out, &quiet).unwrap_err().to_string();
    assert!(e.contains("not empty"), "{e}");
    assert!(out.join("keep.txt").exists());
}

/// A packed copy of a fixture that a test may damage.
fn damaged(tag: &str, damage: impl FnOnce(&Path)) -> PathBuf {
    let out = pack_to(&synth_gguf("tiny-moe", &format!("bad-{tag}-src")), &format!("bad-{tag}"));
    damage(&out);
    out
}

fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("sluice-pack.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}

type Damage<'a> = Box<dyn FnOnce(&Path) + 'a>;

#[test]
fn damaged_packs_are_refused_naming_the_file() {
    let truncate = |p: &Path, n: u64| std::fs::OpenOptions::new().write(true).open(p).unwrap().set_len(n).unwrap();
    // (what, the damage, the file the error names, what it says)
    let cases: Vec<(&str, Damage, &str, &str)> = vec![
        (
            "manifest-truncated",
            Box::new(|d: &Path| {
                let p = d.join("sluice-pack.json");
                truncate(&p, std::fs::metadata(&p).unwrap().len() / 2)
            }),
            "sluice-pack.json",
            "not a valid pack manifest",
        ),
        (
            "manifest-garbage",
            Box::new(|d: &Path| std::fs::write(d.join("sluice-pack.json"), "{]").unwrap()),
            "sluice-pack.json",
            "not a valid",
        ),
        (
            "experts-truncated",
            Box::new(|d: &Path| {
                let p = d.join("experts.bin");
                truncate(&p, std::fs::metadata(&p).unwrap().len() - 4096)
            }),
            "experts.bin",
            "truncated",
        ),
        (
            "experts-missing",
            Box::new(|d: &Path| std::fs::remove_file(d.join("experts.bin")).unwrap()),
            "experts.bin",
            "",
        ),
        (
            "wrong-version",
            Box::new(|d: &Path| edit_manifest(d, |v| v["version"] = 7.into())),
            "sluice-pack.json",
            "version 7",
        ),
        (
            "wrong-shape",
            Box::new(|d: &Path| {
                edit_manifest(d, |v| v["layers"][1]["experts"][3]["up"]["shape"] = serde_json::json!([64, 256]))
            }),
            "sluice-pack.json",
            "layer 1 expert 3 up",
        ),
        (
            "wrong-type",
            Box::new(|d: &Path| edit_manifest(d, |v| v["layers"][0]["experts"][0]["gate"]["dtype"] = "Q9_9".into())),
            "sluice-pack.json",
            "unknown type 'Q9_9'",
        ),
        (
            "expert-count",
            Box::new(|d: &Path| {
                edit_manifest(d, |v| {
                    v["layers"][2]["experts"].as_array_mut().unwrap().pop();
                })
            }),
            "sluice-pack.json",
            "layer 2 has 15 experts",
        ),
        (
            "layer-missing",
            Box::new(|d: &Path| {
                edit_manifest(d, |v| {
                    v["layers"].as_array_mut().unwrap().pop();
                })
            }),
            "sluice-pack.json",
            "layer 3",
        ),
        (
            "offset-past-end",
            Box::new(|d: &Path| {
                edit_manifest(d, |v| {
                    let x = &mut v["layers"][3]["experts"][15];
                    let far = 1u64 << 40;
                    x["offset"] = far.into();
                    x["gate"]["offset"] = far.into();
                    x["up"]["offset"] = (far + 20000).into();
                    x["down"]["offset"] = (far + 40000).into();
                })
            }),
            "experts.bin",
            "past the end",
        ),
        (
            "overlapping",
            Box::new(|d: &Path| edit_manifest(d, |v| v["layers"][0]["experts"][1]["down"]["offset"] = 0.into())),
            "sluice-pack.json",
            "outside the expert",
        ),
    ];
    for (tag, damage, file, needle) in cases {
        let dir = damaged(tag, damage);
        let e = Checkpoint::open(&dir).err().unwrap_or_else(|| panic!("{tag}: opened"));
        let (path, msg) = match e {
            Error::Io { path, source } => (path, source.to_string()),
            e => format_error(e),
        };
        assert_eq!(path.file_name().unwrap(), file, "{tag}: {msg}");
        assert!(msg.contains(needle), "{tag}: '{msg}' should say '{needle}'");
    }
}
