//! Which instruction set the kernels use, chosen once at run time.

use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction set the kernels use.
///
/// `Avx512` means AVX-512 F, BW, VL and VNNI together (Ice Lake, Zen 4 and later); a
/// CPU with AVX-512 F but no VNNI (Skylake-X) runs the `Avx2` kernels. `Avx2` needs
/// AVX2, FMA and F16C, and uses AVX-VNNI's `vpdpbusd` when the CPU has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

static ISA: AtomicU8 = AtomicU8::new(0);
/// 0 or 1: use AVX-VNNI on the AVX2 path when present; 2: never.
static AVX2_VNNI: AtomicU8 = AtomicU8::new(0);

pub(crate) fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        if avx2
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512vnni")
        {
            return Isa::Avx512;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Isa::Neon;
        }
    }
    Isa::Scalar
}

fn encode(i: Isa) -> u8 {
    match i {
        Isa::Scalar => 1,
        Isa::Avx2 => 2,
        Isa::Avx512 => 3,
        Isa::Neon => 4,
    }
}

/// The ISA in use: the best the CPU has, unless `SLUICE_ISA` (scalar, avx2, avx512,
/// neon) or [`set_isa`] chose a lower one.
pub fn isa() -> Isa {
    match ISA.load(Ordering::Relaxed) {
        1 => Isa::Scalar,
        2 => Isa::Avx2,
        3 => Isa::Avx512,
        4 => Isa::Neon,
        _ => {
            let best = detect();
            let chosen = match std::env::var("SLUICE_ISA").ok().as_deref() {
                Some("scalar") => Isa::Scalar,
                Some("avx2") if matches!(best, Isa::Avx2 | Isa::Avx512) => Isa::Avx2,
                _ => best,
            };
            ISA.store(encode(chosen), Ordering::Relaxed);
            chosen
        }
    }
}

/// Forces an ISA (for tests and comparisons). Returns false, changing nothing, if
/// this CPU lacks it.
pub fn set_isa(want: Isa) -> bool {
    let best = detect();
    let ok = match want {
        Isa::Scalar => true,
        Isa::Avx2 => matches!(best, Isa::Avx2 | Isa::Avx512),
        Isa::Avx512 => best == Isa::Avx512,
        Isa::Neon => best == Isa::Neon,
    };
    if ok {
        ISA.store(encode(want), Ordering::Relaxed);
    }
    ok
}

/// Whether the AVX2 kernels may use AVX-VNNI (`vpdpbusd` on 256-bit vectors). They
/// do when the CPU has it, unless a test turned it off with [`set_avx2_vnni`] to
/// exercise the `vpmaddubsw` path; both give bitwise the same results.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_vnni() -> bool {
    match AVX2_VNNI.load(Ordering::Relaxed) {
        2 => false,
        _ => std::is_x86_feature_detected!("avxvnni"),
    }
}

/// Lets the AVX2 kernels use AVX-VNNI when present (`true`, the default) or never
/// (`false`). For tests; the results are bitwise the same either way.
#[doc(hidden)]
pub fn set_avx2_vnni(allow: bool) {
    AVX2_VNNI.store(if allow { 1 } else { 2 }, Ordering::Relaxed);
}
