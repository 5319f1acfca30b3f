//! The placement planner: its `auto` choices from the model's sizes and the memory
//! available, the usage errors of impossible requests, what a token reads and
//! computes (counted from the checkpoint), and a prediction's arithmetic.

use std::path::Path;

use sluice_core::Error;
use sluice_core::{KvFormat, Precision};
use sluice_engine::Cpu;
use sluice_engine::backend::DeviceRates;
use sluice_engine::plan::{self, Machine, Part, Placement, Profile, Request, Routing, WeightsPlace};
use sluice_experts::{CacheBudget, ExpertLayout, Policy, Residency};
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
    // A machine where every product and each MoE layer's experts take 1 ms, attention
    // and small operations nothing, and the disk reads 1 MB/s.
    let machine = Machine { disk_bytes_per_s: Some(1e6), ..flat_machine(&profile) };
    let p = plan::predict(&profile, &at, &machine, LRU_UNIFORM, None);
    let dense: usize = profile.products.iter().filter(|p| p.part != Part::Expert).map(|p| p.per_token).sum();
    let experts_s = profile.moe_layers.len() as f64 * 1e-3;
    assert!((p.decode_memory_s - (dense as f64 * 1e-3 + experts_s)).abs() < 1e-9);
    // Uniform routing over 8 experts with 4 slots: half of the top-2 reads hit.
    assert!((p.decode_hit_rate.unwrap() - 0.5).abs() < 1e-3, "{:?}", p.decode_hit_rate);
    let expert = profile.moe_layers[0].expert_bytes as f64;
    let misses = 3.0 * 2.0 * 0.5 * expert;
    assert!((p.decode_disk_bytes_per_token - misses).abs() / misses < 1e-3);
    // Streamed, a layer's reads overlap its expert products, not the rest.
    let step_s = p.decode_memory_s - experts_s + experts_s.max(misses / 1e6);
    assert!(misses / 1e6 > experts_s, "the disk binds in this example");
    assert!((p.decode_tok_s - 1.0 / step_s).abs() < 1e-6, "{} against {}", p.decode_tok_s, 1.0 / step_s);
}

const LRU_UNIFORM: Routing<'static> = Routing { hist: None, policy: Policy::Lru };

/// A machine where every product takes 1 ms (and 1 ms per prompt row), a MoE layer's
/// experts 1 ms a decode row, attention and small operations nothing; no disk, no
/// device.
fn flat_machine(profile: &Profile) -> Machine {
    Machine {
        threads: 1,
        memory_read_bytes_per_s: 1e10,
        products: profile
            .products
            .iter()
            .filter(|p| p.part != Part::Expert)
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
        experts: Some(plan::ExpertsTime { decode_s: 1e-3, prefill_s: 1e-3 }),
        small_op_s: 0.0,
        small_ops_per_layer: plan::SMALL_OPS_PER_LAYER,
        disk_bytes_per_s: None,
        device: None,
    }
}

#[test]
fn a_device_plan_splits_its_memory_and_adds_the_copies_it_lacks() {
    let (ckpt, layout) = open("qwen3-moe");
    let profile = Profile::of(&ckpt, &layout);
    let req = Request { residency: Some(Residency::Resident), available: Some(1 << 40), ..Default::default() };
    let at = plan::place(&ckpt, &layout, &req).unwrap();
    let kv = 1000;
    let expert = profile.moe_layers[0].expert_bytes;
    // Room for the weights, the KV cache, the allowance and half of each layer's
    // experts (4 of 8, on 3 layers).
    let base = at.resident_bytes + kv + (256 << 20);
    let split = at.on_device(&profile, base + 3 * 4 * expert, kv).unwrap();
    assert_eq!((split.tier_bytes, split.tier_experts_per_layer), (3 * 4 * expert, 4));
    assert_eq!(
        at.on_device(&profile, base + (1 << 40), kv).unwrap().tier_bytes,
        at.expert_bytes,
        "at most every expert"
    );
    // Too little room for the weights: the error names the sizes, as loading would fail.
    let short = at.on_device(&profile, base - 1, kv);
    assert!(matches!(&short, Err(Error::Usage(m)) if m.contains("weights other than routed experts")), "{short:?}");

    // Copies of the tier's misses from page-locked memory at 1 MB/s, small operations
    // of 10 us, every product 1 ms.
    let rates = DeviceRates {
        name: "test".into(),
        total_bytes: 1 << 40,
        copy_bytes_per_s: 1e12,
        locked_bytes_per_s: 1e6,
        pageable_bytes_per_s: 1e5,
    };
    // A device backend's own count of small operations a layer (the CUDA backend's three).
    let machine = Machine { small_op_s: 1e-5, small_ops_per_layer: 3, device: Some(rates), ..flat_machine(&profile) };
    let p = plan::predict(&profile, &at, &machine, LRU_UNIFORM, Some(&split));
    // Uniform routing over 8 experts with 4 held: half of the top-2 reads are copied.
    assert!((p.decode_device_hit_rate.unwrap() - 0.5).abs() < 1e-3, "{:?}", p.decode_device_hit_rate);
    let copied = 3.0 * 2.0 * 0.5 * expert as f64;
    assert!((p.decode_copy_bytes_per_token - copied).abs() / copied < 1e-3);
    assert!((p.decode_copy_s - copied / 1e6).abs() < 1e-9, "page-locked copies for a resident store");
    let dense: usize = profile.products.iter().filter(|p| p.part != Part::Expert).map(|p| p.per_token).sum();
    let small = (profile.layers * 3) as f64 * 1e-5;
    assert!((p.decode_small_ops_s - small).abs() < 1e-12);
    let step = (dense + profile.moe_layers.len()) as f64 * 1e-3 + small + copied / 1e6;
    assert!((1.0 / p.decode_tok_s - step).abs() < 1e-9, "products, small ops and copies add up");
    assert_eq!((p.decode_hit_rate, p.decode_disk_s), (None, 0.0), "resident: nothing from disk");
    // Every expert in the tier: nothing copied.
    let all = at.on_device(&profile, base + at.expert_bytes, kv).unwrap();
    let p = plan::predict(&profile, &at, &machine, LRU_UNIFORM, Some(&all));
    assert_eq!((p.decode_device_hit_rate, p.decode_copy_s), (Some(1.0), 0.0));
}

#[test]
fn lfu_holds_the_most_popular_and_beats_lru_on_skewed_routing() {
    let uniform = vec![8.0 / 128.0; 128];
    assert!((plan::hit_rate(Policy::Lfu, &uniform, 32) - 0.25).abs() < 1e-9);
    assert_eq!(plan::hit_rate(Policy::Lfu, &uniform, 128), 1.0);
    let z: Vec<f64> = (1..=128).map(|i| (i as f64).powf(-0.9)).collect();
    let s: f64 = z.iter().sum();
    let skewed: Vec<f64> = z.iter().map(|x| x / s * 8.0).collect();
    let (lru, lfu) = (plan::hit_rate(Policy::Lru, &skewed, 32), plan::hit_rate(Policy::Lfu, &skewed, 32));
    let top: f64 = skewed[..32].iter().sum::<f64>() / 8.0;
    assert!((lfu - top).abs() < 1e-9 && lfu > lru && lru > 0.25, "lru {lru} lfu {lfu}");
}

/// The planner's measurement runs the backend's own kernels: on the CPU backend every
/// product shape, attention geometry and the small operation take a positive time,
/// and the CPU has no device.
#[test]
fn the_machine_is_measured_through_the_backend() {
    let (ckpt, layout) = open("qwen3-moe");
    let profile = Profile::of(&ckpt, &layout);
    let on = plan::MeasureOn {
        ckpt: &ckpt,
        profile: &profile,
        precision: plan::Precisions::of(Some(Precision::Accurate)),
        kv: KvFormat::F32,
        disk: None,
    };
    let m = Machine::measure(&Cpu::default(), &on).unwrap();
    let not_experts = profile.products.iter().filter(|p| p.part != Part::Expert).count();
    assert_eq!(m.products.len(), not_experts, "the experts are timed as a layer's, together");
    let positive = |s: f64| s > 0.0 && s < 1.0;
    assert!(m.experts.is_some_and(|e| positive(e.decode_s) && positive(e.prefill_s)), "{:?}", m.experts);
    assert!(m.products.iter().all(|t| positive(t.decode_s) && positive(t.prefill_s)), "{:?}", m.products);
    assert!(m.attention.iter().all(|t| positive(t.decode_s) && positive(t.prefill_s)), "{:?}", m.attention);
    assert!(positive(m.small_op_s) && m.device.is_none() && m.disk_bytes_per_s.is_none());
    // One sequence's f32 cache: keys and values of 2 heads of 16 on 4 layers.
    let kv = plan::kv_bytes(&Cpu::default(), &profile, KvFormat::F32, 100).unwrap();
    assert_eq!(kv, 4 * 2 * 32 * 4 * 100);
}
