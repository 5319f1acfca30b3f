//! Expert files built for the tests: random bytes, tensors placed in the ways real
//! checkpoints place them.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sluice_core::DType;
use sluice_experts::{ExpertLayout, ExpertLease, ExpertRef};
use sluice_formats::{ExpertMats, MappedFile, TensorView};

/// A small deterministic generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next() >> 56) as u8).collect()
    }
    /// `k` distinct ids below `n`.
    pub fn ids(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut v = Vec::new();
        while v.len() < k.min(n) {
            let x = self.below(n);
            if !v.contains(&x) {
                v.push(x);
            }
        }
        v
    }
}

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "sluice-experts-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How the tensors of the experts lie in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrangement {
    /// Each expert's gate, up and down back to back, each expert 4 KiB-aligned:
    /// one read per expert.
    Packed,
    /// Back to back at odd offsets: one read per expert, starting mid-page.
    PackedUnaligned,
    /// One array per kind (all gates, all ups, all downs) at odd offsets: three
    /// reads per expert.
    Separate,
    /// A fused gate_up array and a down array: two reads per expert.
    Fused,
}

pub const ARRANGEMENTS: [Arrangement; 4] =
    [Arrangement::Packed, Arrangement::PackedUnaligned, Arrangement::Separate, Arrangement::Fused];

/// Geometry of one MoE layer's experts.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub n_experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub inter: usize,
    pub dtype: DType,
}

pub const SMALL: Geometry = Geometry { n_experts: 8, top_k: 2, hidden: 64, inter: 64, dtype: DType::Q8_0 };

/// A file of experts, its bytes, and the layers of a model made of it.
pub struct Model {
    pub dir: TempDir,
    pub path: PathBuf,
    pub data: Vec<u8>,
    /// Per layer (`None`: no experts): experts and top-k.
    pub layers: Vec<Option<(Vec<ExpertMats>, usize)>>,
}

impl Model {
    /// `moe[l]` says whether layer `l` has experts.
    pub fn build(name: &str, arr: Arrangement, g: Geometry, moe: &[bool], seed: u64) -> Model {
        let dir = TempDir::new(name);
        let path = dir.path().join("experts.bin");
        let row = g.dtype.bytes_for(g.hidden).unwrap();
        let row_down = g.dtype.bytes_for(g.inter).unwrap();
        let t_gate = g.inter * row;
        let t_down = g.hidden * row_down;
        // (gate, up, down) offsets per layer per expert.
        let mut offs: Vec<Vec<[usize; 3]>> = Vec::new();
        let mut end: usize = 100; // a header of sorts
        for &has in moe {
            let mut v = Vec::new();
            if has {
                match arr {
                    Arrangement::Packed | Arrangement::PackedUnaligned => {
                        for _ in 0..g.n_experts {
                            if arr == Arrangement::Packed {
                                end = end.div_ceil(4096) * 4096;
                            } else {
                                end += 3;
                            }
                            v.push([end, end + t_gate, end + 2 * t_gate]);
                            end += 2 * t_gate + t_down;
                        }
                    }
                    Arrangement::Separate => {
                        let (gs, us) = (end + 7, end + 7 + g.n_experts * t_gate + 11);
                        let ds = us + g.n_experts * t_gate + 5;
                        for x in 0..g.n_experts {
                            v.push([gs + x * t_gate, us + x * t_gate, ds + x * t_down]);
                        }
                        end = ds + g.n_experts * t_down;
                    }
                    Arrangement::Fused => {
                        let gu = end + 1000;
                        let ds = gu + g.n_experts * 2 * t_gate + 300;
                        for x in 0..g.n_experts {
                            let base = gu + x * 2 * t_gate;
                            v.push([base, base + t_gate, ds + x * t_down]);
                        }
                        end = ds + g.n_experts * t_down;
                    }
                }
            }
            end += 555;
            offs.push(v);
        }
        let mut rng = Rng::new(seed);
        let data = rng.bytes(end);
        std::fs::write(&path, &data).unwrap();
        let file = MappedFile::open(&path).unwrap();
        let view = |name: String, shape: Vec<usize>, off: usize, len: usize| {
            TensorView::new(name, g.dtype, shape, file.clone(), off, len).unwrap()
        };
        let layers = offs
            .iter()
            .enumerate()
            .map(|(l, v)| {
                (!v.is_empty()).then(|| {
                    let experts = v
                        .iter()
                        .enumerate()
                        .map(|(x, o)| ExpertMats {
                            gate: view(format!("l{l}.e{x}.gate"), vec![g.inter, g.hidden], o[0], t_gate),
                            up: view(format!("l{l}.e{x}.up"), vec![g.inter, g.hidden], o[1], t_gate),
                            down: view(format!("l{l}.e{x}.down"), vec![g.hidden, g.inter], o[2], t_down),
                        })
                        .collect();
                    (experts, g.top_k)
                })
            })
            .collect();
        Model { dir, path, data, layers }
    }

    pub fn layout(&self) -> ExpertLayout {
        ExpertLayout::new(self.layers.clone()).unwrap()
    }

    pub fn expert(&self, layer: usize, x: usize) -> &ExpertMats {
        &self.layers[layer].as_ref().unwrap().0[x]
    }

    /// The file's bytes of one tensor.
    pub fn bytes(&self, t: &TensorView) -> &[u8] {
        &self.data[t.offset()..t.offset() + t.len_bytes()]
    }

    /// Checks that a lease serves the file's bytes and shapes for each id.
    pub fn check(&self, lease: &ExpertLease<'_>, layer: usize, ids: &[usize]) {
        for &x in ids {
            self.check_one(lease.get(x), layer, x);
        }
    }

    /// Checks one expert's matrices against the file.
    pub fn check_one(&self, r: ExpertRef<'_>, layer: usize, x: usize) {
        {
            let e = self.expert(layer, x);
            for (m, t, what) in [(r.gate, &e.gate, "gate"), (r.up, &e.up, "up"), (r.down, &e.down, "down")] {
                let want = t.mat();
                assert_eq!(
                    (m.dtype, m.rows, m.cols),
                    (want.dtype, want.rows, want.cols),
                    "layer {layer} expert {x} {what}"
                );
                assert!(m.data == self.bytes(t), "layer {layer} expert {x} {what}: bytes differ from the file");
            }
        }
    }
}

/// Runs `f` on a thread and fails if it does not end within `secs`: a hang is a
/// failure, not a stuck test run.
pub fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => h.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Ok(_) => unreachable!(),
            Err(p) => std::panic::resume_unwind(p),
        },
        Err(_) => panic!("did not finish within {secs} s (a hang)"),
    }
}
