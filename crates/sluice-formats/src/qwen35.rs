//! Qwen3.5's Gated DeltaNet tensors as a Hugging Face folder holds them, made into
//! the forms GGUF stores and the engine reads: the depthwise convolution
//! `conv1d.weight [C, 1, K]` viewed as `[C, K]` (the same bytes), and the decay rates
//! `A_log` as `-exp(A_log)` (f32, in memory: one float per value head).

use std::collections::HashMap;
use std::path::Path;

use sluice_core::{DType, Error, ModelSpec, Result};

use crate::mapped::{MappedFile, TensorView, check_shape};
use crate::names::{TensorId, TensorKind};

/// Adds `SsmConv` and `SsmA` (named by `name`) for every linear layer, from
/// `<prefix>layers.N.linear_attn.conv1d.weight` and `.A_log`.
pub(crate) fn derive(
    path: &Path,
    prefix: &str,
    spec: &ModelSpec,
    tensors: &mut HashMap<String, TensorView>,
    name: impl Fn(TensorId) -> String,
) -> Result<()> {
    for (l, layer) in spec.layers.iter().enumerate() {
        let Some(d) = layer.linear else { continue };
        let src = |tensors: &HashMap<String, TensorView>, what: &str| -> Result<TensorView> {
            let n = format!("{prefix}layers.{l}.linear_attn.{what}");
            tensors.get(&n).cloned().ok_or_else(|| Error::MissingTensor { path: path.to_path_buf(), name: n })
        };
        let conv = src(tensors, "conv1d.weight")?;
        check_shape(conv.path(), &conv.name, &conv.shape, &[d.conv_dim(), 1, d.conv_kernel])?;
        let shape = vec![d.conv_dim(), d.conv_kernel];
        let conv_ck = name(TensorId::layer(l, TensorKind::SsmConv));
        let view =
            TensorView::new(conv_ck.clone(), conv.dtype, shape, conv.file().clone(), conv.offset(), conv.len_bytes())?;
        tensors.insert(conv_ck, view);

        let a_log = src(tensors, "A_log")?;
        let a: Vec<f32> = a_log.to_f32_vec()?.into_iter().map(|x| -x.exp()).collect();
        if a.len() != d.v_heads {
            return Err(Error::TensorShape {
                path: a_log.path().to_path_buf(),
                name: a_log.name.clone(),
                expected: format!("{} values (linear_num_value_heads)", d.v_heads),
                got: format!("shape {:?}", a_log.shape),
            });
        }
        let bytes: Vec<u8> = a.iter().flat_map(|x| x.to_le_bytes()).collect();
        let file = MappedFile::in_memory(a_log.path(), &bytes)?;
        let a_name = name(TensorId::layer(l, TensorKind::SsmA));
        tensors.insert(a_name.clone(), TensorView::new(a_name, DType::F32, vec![d.v_heads], file, 0, bytes.len())?);
    }
    Ok(())
}
