//! The Llama layout in and out of Hugging Face's `LlamaForCausalLM` folder: written (sharded
//! with an index above the shard size, `config.json`, `generation_config.json`) and read back
//! with every parameter bitwise; an independent numpy Llama (`scripts/llama_numpy_forward.py`)
//! computes kiln's logits from the folder alone within 1e-5, and the same script pairing the
//! rotary elements the original interleaved way does not (the check sees a layout mix-up);
//! loaded into a tensor-parallel model at tp = 2 the shards hold the weights bitwise; a folder
//! that disagrees with its config is refused naming the tensor or field.
//!
//! The numpy part needs python3 with numpy (CI installs it; its absence fails under
//! `CI=true`, and elsewhere the part is skipped with a message).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{Device, Tensor};
use kiln_model::hf::{self, llama};
use kiln_model::{Gpt, GptConfig, GptOptions};
use kiln_state::TensorData;
use kiln_testkit::run_ranks;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every parameter of `model`, whole, f32.
fn params_of(model: &Gpt) -> Vec<(String, TensorData)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| {
            let t = v.as_tensor();
            let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            (n, TensorData::from_slice(t.dims(), &values).unwrap())
        })
        .collect()
}

/// The numpy forward's logits for `ids` from the folder `dir`.
fn numpy_logits(
    python: &kiln_testkit::Python,
    dir: &Path,
    ids: &[u32],
    extra: &[&str],
) -> Vec<f32> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/llama_numpy_forward.py");
    let out = dir.join("numpy_logits.f32");
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let mut args = vec![
        script.into_os_string(),
        dir.as_os_str().to_owned(),
        list.join(",").into(),
        out.as_os_str().to_owned(),
    ];
    args.extend(extra.iter().map(Into::into));
    python.run("scripts/llama_numpy_forward.py", args);
    std::fs::read(&out)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

#[test]
fn export_import_and_an_independent_numpy_llama_agree() {
    let mut cfg = GptConfig::llama_tiny();
    // Llama 3.1's scaling, so the tables' frequencies are checked too
    cfg.rope_scaling = Some(kiln_model::ops::Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16,
    });
    let model = Gpt::new(&cfg, &GptOptions::seeded(21)).unwrap();
    let params = params_of(&model);
    let dir = scratch("hf-llama-export");
    // shards of at most 400 kB: the 0.5M-parameter model in f32 takes 6
    let files = llama::save_llama_dir(&dir, &cfg, &params, None, Some(1), 400_000).unwrap();
    let shards = files
        .iter()
        .filter(|f| f.to_string_lossy().contains("-of-"))
        .count();
    assert!(shards > 1, "{files:?}");
    for f in [
        llama::HF_INDEX_FILE,
        hf::HF_CONFIG_FILE,
        llama::HF_GENERATION_FILE,
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(llama::HF_INDEX_FILE)).unwrap())
            .unwrap();
    let total: u64 = params.iter().map(|(_, t)| t.bytes().len() as u64).sum();
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(
        index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
            .as_str()
            .map(|s| s.ends_with(".safetensors")),
        Some(true)
    );

    // read back: the same config and every parameter bitwise
    let back = hf::load_hf_dir(&dir).unwrap();
    assert_eq!(back.config, cfg);
    assert_eq!(back.params.len(), params.len());
    for ((n, a), (m, b)) in back.params.iter().zip(&params) {
        assert_eq!(n, m);
        assert_eq!(a.bytes(), b.bytes(), "{n}");
    }

    // the numpy Llama from the folder alone
    let ids: Vec<u32> = (0..29)
        .map(|i| (i * 37 + 5) % cfg.vocab_size as u32)
        .collect();
    let x = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).unwrap();
    let logits: Vec<f32> = model
        .forward(&x)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    if let Some(python) = kiln_testkit::Python::require("the numpy Llama reference", &["numpy"]) {
        let reference = numpy_logits(&python, &dir, &ids, &[]);
        let w = worst(&logits, &reference);
        println!(
            "numpy Llama on the export vs kiln: {} logits, largest |difference| {w:.3e}",
            logits.len()
        );
        assert!(w <= 1e-5, "logits differ by {w:e}");
        // the other rotary pairing gives other logits: the comparison sees a layout mix-up
        let interleaved = numpy_logits(&python, &dir, &ids, &["--interleaved"]);
        let off = worst(&logits, &interleaved);
        println!("with the interleaved pairing instead: largest |difference| {off:.3e}");
        assert!(
            off > 1e-2,
            "the interleaved pairing should not agree: {off:e}"
        );
    }
}

#[test]
fn a_tied_multi_head_llama_round_trips_and_loads_at_tp2() {
    let mut cfg = GptConfig::llama_tiny();
    // as many key/value heads as query heads: kiln's fused c_attn
    cfg.n_kv_heads = Some(cfg.n_heads);
    cfg.tied_embeddings = true;
    let model = Gpt::new(&cfg, &GptOptions::seeded(4)).unwrap();
    let params = params_of(&model);
    let dir = scratch("hf-llama-tied-mha");
    let files = hf::save_hf_dir(&dir, &cfg, &params, None, None).unwrap();
    assert!(files.iter().any(|f| f.ends_with(hf::HF_WEIGHTS_FILE)));
    let tensors = hf::read_safetensors(&dir.join(hf::HF_WEIGHTS_FILE)).unwrap();
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    // the fused c_attn split into q, k and v; no lm_head when tied
    assert!(names.contains(&"model.layers.0.self_attn.k_proj.weight"));
    assert!(!names.contains(&"lm_head.weight"));
    let back = hf::load_hf_dir(&dir).unwrap();
    assert_eq!(back.config, cfg);
    for ((n, a), (_, b)) in back.params.iter().zip(&params) {
        assert_eq!(a.bytes(), b.bytes(), "{n}");
    }
    // into each rank's tensor-parallel shard, bitwise
    let full = params_of(&Gpt::new(&GptConfig::llama_tiny(), &GptOptions::seeded(4)).unwrap());
    let grouped = GptConfig::llama_tiny();
    let dir2 = scratch("hf-llama-gqa");
    hf::save_hf_dir(&dir2, &grouped, &full, None, None).unwrap();
    let loaded = hf::load_hf_dir(&dir2).unwrap();
    run_ranks(2, |comm| {
        let tp: kiln_parallel::tp::TpComm = Arc::new(comm);
        let rank = tp.rank();
        let m = Gpt::tensor_parallel(&grouped, &GptOptions::seeded(99), tp)?;
        m.load_full_parameters(&loaded.params)?;
        let splits: std::collections::HashMap<_, _> = m.param_splits().into_iter().collect();
        for ((name, v), (fname, t)) in m.named_parameters().iter().zip(&full) {
            assert_eq!(name, fname);
            let whole = Tensor::from_vec(t.to_vec::<f32>()?, t.shape(), &Device::Cpu)?;
            let want = splits[name].shard(&whole, 2, rank)?;
            let got: Vec<f32> = v.as_tensor().flatten_all()?.to_vec1()?;
            assert_eq!(got, want.flatten_all()?.to_vec1::<f32>()?, "{name}");
        }
        Ok(())
    });
}

#[test]
fn folders_that_disagree_with_their_config_are_named() {
    let cfg = GptConfig::llama_tiny();
    let model = Gpt::new(&cfg, &GptOptions::seeded(2)).unwrap();
    let params = params_of(&model);
    let tensors = llama::to_llama(&cfg, &params).unwrap();
    let err = |t: &[(String, TensorData)]| llama::from_llama(&cfg, t).unwrap_err().to_string();

    let mut missing = tensors.clone();
    missing.retain(|(n, _)| n != "model.layers.1.self_attn.v_proj.weight");
    let e = err(&missing);
    assert!(
        e.contains("model.layers.1.self_attn.v_proj.weight") && e.contains("missing"),
        "{e}"
    );

    let mut extra = tensors.clone();
    extra.push((
        "model.layers.2.mlp.up_proj.weight".into(),
        TensorData::from_vec1(&[0f32]),
    ));
    let e = err(&extra);
    assert!(e.contains("model.layers.2.mlp.up_proj.weight"), "{e}");

    let mut wrong = tensors.clone();
    let at = wrong
        .iter()
        .position(|(n, _)| n == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    wrong[at].1 = TensorData::from_slice(&[128, 128], &vec![0f32; 128 * 128]).unwrap();
    let e = err(&wrong);
    assert!(e.contains("k_proj") && e.contains("[64, 128]"), "{e}");

    // config.json fields kiln does not compute, by name
    let mut hc = llama::LlamaConfig::from_gpt(&cfg, None).unwrap();
    hc.rope_scaling = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    let e = hc.to_gpt().unwrap_err().to_string();
    assert!(e.contains("rope_scaling") && e.contains("yarn"), "{e}");
    let mut hc = llama::LlamaConfig::from_gpt(&cfg, None).unwrap();
    hc.hidden_act = "gelu".into();
    assert!(hc.to_gpt().unwrap_err().to_string().contains("hidden_act"));
    let mut hc = llama::LlamaConfig::from_gpt(&cfg, None).unwrap();
    hc.num_key_value_heads = Some(3);
    assert!(hc
        .to_gpt()
        .unwrap_err()
        .to_string()
        .contains("n_kv_heads (3)"));

    // a GPT model is not written as Llama
    let e = llama::to_llama(&GptConfig::tiny(), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("LlamaForCausalLM") && e.contains("GPT-3 architecture"),
        "{e}"
    );
}

/// `transformers` 5 writes the rotary base and scaling together as `rope_parameters`, with no
/// top-level `rope_theta` or `rope_scaling` (the `config.json` below is what its
/// `save_pretrained` wrote for a Llama 3.1-style model); kiln reads both layouts to the same
/// architecture, and refuses an unsupported type there too.
#[test]
fn transformers_5_rope_parameters_are_read() {
    let v5 = |rope: serde_json::Value| {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
            "hidden_size": 32, "intermediate_size": 88, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "tie_word_embeddings": false, "transformers_version": "5.25.0",
            "rope_parameters": rope,
        })
    };
    let read = |j: serde_json::Value| -> kiln_model::Result<GptConfig> {
        serde_json::from_value::<llama::LlamaConfig>(j)
            .unwrap()
            .to_gpt()
    };
    let scaled = read(v5(serde_json::json!({
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    })))
    .unwrap();
    assert_eq!(scaled.rope_theta, 500_000.0);
    let s = scaled.rope_scaling.expect("llama3 scaling");
    assert_eq!(
        (s.factor, s.original_max_position_embeddings),
        (8.0, 16),
        "{s:?}"
    );
    // the same model in the older layout reads to the same configuration
    let mut old = llama::LlamaConfig::from_gpt(&scaled, None).unwrap();
    old.extra.clear();
    assert_eq!(old.to_gpt().unwrap(), scaled);
    let plain = read(v5(
        serde_json::json!({"rope_type": "default", "rope_theta": 10000.0}),
    ))
    .unwrap();
    assert_eq!((plain.rope_theta, plain.rope_scaling), (10_000.0, None));
    let e = read(v5(
        serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("yarn"), "{e}");
}
