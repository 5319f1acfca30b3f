//! The placement planner: its `auto` choices from the model's sizes and the memory
//! available, the usage errors of impossible requests, what a token reads and
//! computes (counted from the checkpoint), and a prediction's arithmetic.

use std::path::Path;

use sluice_core::Error;
use sluice_engine::plan::{self, Part, Placement, Request, WeightsPlace};
use sluice_experts::{CacheBudget, ExpertLayout, Residency};
use sluice_formats::Checkpoint;

fn open(name: &str) -> (Checkpoint, ExpertLayout) {
    let ckpt = Checkpoint::open(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)).unwrap();
    let layout = ExpertLayout::from_checkpoint(&ckpt).unwrap();
    (ckpt, layout)
}

fn place(name: &str, req: Request) -> sluice_core::Result<Placement> {
    let (ckpt, layout) = open(name);
    plan::place(&ckpt, &layout, &req)
}

#[test]
fn auto_maps_what_fits_and_streams_what_does_not() {
    let (ckpt, layout) = open("qwen3-moe");
    let total: u64 = ckpt.tensors().iter().map(|t| t.len_bytes() as u64).sum();
    let roomy = plan::place(&ckpt, &layout, &Request { available: Some(total * 10), ..Default::default() }).unwrap();
    assert_eq!((roomy.residency, roomy.weights, roomy.cache_bytes), (Residency::Mapped, WeightsPlace::Memory, 0));
    assert!(roomy.note.is_none());
    assert_eq!(roomy.resident_bytes + roomy.expert_bytes, total);

    // Too little memory for the whole model: experts streamed through the smallest
    // cache the model accepts, and a note says why.
    let tight = plan::place(&ckpt, &layout, &Request { available: Some(total / 2), ..Default::default() }).unwrap();
    assert_eq!(tight.residency, Residency::Streamed);
    assert_eq!(tight.cache_bytes, layout.min_budget_bytes());
    assert_eq!(tight.slots_per_layer, layout.min_slots_per_layer());
    assert!(tight.note.as_deref().unwrap().contains("memory available"));
    // A device tier too small for every expert: resident (page-locked for its
    // copies) where the model fits in memory, saying why; room for all: mapped.
    let device = |room| Request { available: Some(total * 10), device_room: Some(room), ..Default::default() };
    let short = plan::place(&ckpt, &layout, &device(total - 1)).unwrap();
    assert_eq!(short.residency, Residency::Resident);
    assert!(short.note.as_deref().unwrap().contains("page-locked"), "{:?}", short.note);
    let ample = plan::place(&ckpt, &layout, &device(total)).unwrap();
    assert_eq!((ample.residency, ample.note), (Residency::Mapped, None));
    let tight_device = Request { available: Some(total / 2), device_room: Some(0), ..Default::default() };
    assert_eq!(plan::place(&ckpt, &layout, &tight_device).unwrap().residency, Residency::Streamed);
    // Unknown memory: nothing is assumed to fit.
    let unknown = plan::place(&ckpt, &layout, &Request::default()).unwrap();
    assert_eq!((unknown.residency, unknown.weights), (Residency::Streamed, WeightsPlace::Mapped));

    // An expert cache asked for is kept, in whole slots.
    let req = Request { expert_cache: Some(CacheBudget::SlotsPerLayer(5)), ..Default::default() };
    let asked = plan::place(&ckpt, &layout, &req).unwrap();
    assert_eq!((asked.residency, asked.slots_per_layer), (Residency::Streamed, 5));
    assert_eq!(asked.cache_bytes, layout.cache_bytes(CacheBudget::SlotsPerLayer(5)).unwrap());
    let all = Request { residency: Some(Residency::Resident), available: Some(1), ..Default::default() };
    assert_eq!(plan::place(&ckpt, &layout, &all).unwrap().cache_bytes, layout.expert_bytes_total());
}

#[test]
fn impossible_requests_are_usage_errors() {
    let cache = Some(CacheBudget::SlotsPerLayer(4));
    let r = place("qwen3", Request { expert_cache: cache, ..Default::default() });
    assert!(matches!(r, Err(Error::Usage(m)) if m.contains("no routed experts")));
    let r =
        place("qwen3-moe", Request { residency: Some(Residency::Mapped), expert_cache: cache, ..Default::default() });
    assert!(matches!(r, Err(Error::Usage(m)) if m.contains("streamed")));
    let r = place("qwen3-moe", Request { expert_cache: Some(CacheBudget::SlotsPerLayer(1)), ..Default::default() });
    assert!(matches!(r, Err(Error::Usage(m)) if m.contains("slots per layer")));
}

#[test]
fn profile_counts_what_a_token_computes() {
    // qwen3-moe: 4 layers, hidden 64, 4 heads and 2 KV heads of 16, MLP 96 on layer 1,
    // 8 experts of width 32, top 2, on layers 0, 2 and 3; vocab 512, untied head.
    let (ckpt, layout) = open("qwen3-moe");
    let p = plan::Profile::of(&ckpt, &layout);
    let count = |rows, cols, part| -> usize {
        p.products.iter().filter(|x| (x.rows, x.cols, x.part) == (rows, cols, part)).map(|x| x.per_token).sum()
    };
    assert_eq!(count(64, 64, Part::Dense), 8, "q and o of every layer");
    assert_eq!(count(32, 64, Part::Dense), 8, "k and v of every layer");
    assert_eq!(count(96, 64, Part::Dense) + count(64, 96, Part::Dense), 3, "layer 1's MLP");
    assert_eq!(count(8, 64, Part::Dense), 3, "the routers");
    assert_eq!(count(32, 64, Part::Expert), 2 * 2 * 3, "gate and up of top-2 experts on 3 layers");
    assert_eq!(count(64, 32, Part::Expert), 2 * 3, "down of top-2 experts on 3 layers");
    assert_eq!(count(512, 64, Part::Head), 1);
    assert_eq!(count(512, 64, Part::Dense), 0, "the embedding is a lookup");
    assert_eq!(p.moe_layers.iter().map(|m| m.layer).collect::<Vec<_>>(), [0, 2, 3]);
    assert_eq!(p.attention.len(), 1);
    assert_eq!(p.attention[0].layers, 4);
}

#[test]
fn prediction_adds_up_what_was_measured() {
    let (ckpt, layout) = open("qwen3-moe");
    let profile = plan::Profile::of(&ckpt, &layout);
    let req = Request { expert_cache: Some(CacheBudget::SlotsPerLayer(4)), ..Default::default() };
    let at = plan::place(&ckpt, &layout, &req).unwrap();
    // A machine where every product takes 1 ms (1 ms per prompt row too), attention
    // nothing, and the disk reads 1 MB/s.
    let machine = plan::Machine {
        threads: 1,
        memory_read_bytes_per_s: 1e10,
        products: profile
            .products
            .iter()
            .map(|p| plan::ProductTime {
                dtype: p.dtype,
                rows: p.rows,
                cols: p.cols,
                decode_s: 1e-3,
                prefill_s: 1e-3,
                prefill_rows: 1,
            })
            .collect(),
        attention: profile.attention.iter().map(|_| plan::AttnTime { decode_s: 0.0, prefill_s: 0.0 }).collect(),
        disk_bytes_per_s: Some(1e6),
    };
    let p = plan::predict(&profile, &at, &machine, None);
    let products: usize = profile.products.iter().map(|p| p.per_token).sum();
    assert!((p.decode_memory_s - products as f64 * 1e-3).abs() < 1e-9);
    // Uniform routing over 8 experts with 4 slots: half of the top-2 reads hit.
    assert!((p.decode_hit_rate.unwrap() - 0.5).abs() < 1e-3, "{:?}", p.decode_hit_rate);
    let expert = profile.moe_layers[0].expert_bytes as f64;
    let misses = 3.0 * 2.0 * 0.5 * expert;
    assert!((p.decode_disk_bytes_per_token - misses).abs() / misses < 1e-3);
    // Streamed, a layer's reads overlap its expert products, not the rest.
    let experts_s =
        profile.products.iter().filter(|p| p.part == Part::Expert).map(|p| p.per_token).sum::<usize>() as f64 * 1e-3;
    let step_s = p.decode_memory_s - experts_s + experts_s.max(misses / 1e6);
    assert!(misses / 1e6 > experts_s, "the disk binds in this example");
    assert!((p.decode_tok_s - 1.0 / step_s).abs() < 1e-6, "{} against {}", p.decode_tok_s, 1.0 / step_s);
}
