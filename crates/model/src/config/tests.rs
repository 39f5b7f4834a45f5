//! Unit tests of `GptConfig`: presets, validation and serialisation.

use super::*;

type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

#[test]
fn gpt3_175b_param_count_matches_the_paper() -> TestResult {
    let c = GptConfig::gpt3_175b();
    c.validate()?;
    // 96 * (12 * 12288^2 + 13 * 12288) + (50257 + 2048) * 12288 + 2 * 12288, by hand
    let blocks: u64 = 96 * (12 * 12288 * 12288 + 13 * 12288);
    assert_eq!(blocks, 173_961_510_912);
    assert_eq!(c.param_count(), 174_604_259_328);
    let n = c.param_count() as f64;
    assert!((174.5e9..=175.3e9).contains(&n), "{n}");
    assert_eq!(c.non_embedding_param_count(), 173_961_535_488);
    Ok(())
}

#[test]
fn gpt3_family_counts_land_near_their_names() -> TestResult {
    // (preset, nominal size from the GPT-3 paper, allowed relative deviation)
    for (c, nominal) in [
        (GptConfig::gpt3_small(), 125e6),
        (GptConfig::gpt3_medium(), 350e6),
        (GptConfig::gpt3_large(), 760e6),
        (GptConfig::gpt3_xl(), 1.3e9),
        (GptConfig::gpt3_2_7b(), 2.7e9),
        (GptConfig::gpt3_6_7b(), 6.7e9),
    ] {
        c.validate()?;
        let n = c.param_count() as f64;
        assert!((n / nominal - 1.0).abs() < 0.03, "{c:?}: {n} vs {nominal}");
    }
    // exact, by hand: 12 * (12 * 768^2 + 13 * 768) + (50257 + 2048) * 768 + 2 * 768
    assert_eq!(GptConfig::gpt3_small().param_count(), 125_226_240);
    Ok(())
}

#[test]
fn flops_per_token_follow_palm() -> TestResult {
    let c = GptConfig::gpt3_175b();
    let expected = 6.0 * 173_961_535_488.0 + 12.0 * 96.0 * 96.0 * 128.0 * 2048.0;
    assert_eq!(c.flops_per_token(), expected);
    assert!((c.flops_per_token() / 1.0727e12 - 1.0).abs() < 1e-3);
    assert_eq!(c.lm_head_flops_per_token(), 6.0 * 50257.0 * 12288.0);
    Ok(())
}

#[test]
fn presets_by_name_and_validation() -> TestResult {
    for name in PRESET_NAMES {
        let c = GptConfig::by_name(name)?;
        c.validate()?;
    }
    assert_eq!(GptConfig::by_name("GPT3-175B")?, GptConfig::gpt3_175b());
    assert_eq!(GptConfig::by_name("small-cpu")?, GptConfig::small_cpu());
    assert_eq!(GptConfig::by_name("gpt3-2.7b")?, GptConfig::gpt3_2_7b());
    let err = GptConfig::by_name("gpt5")
        .err()
        .ok_or("expected an error")?;
    assert!(matches!(err, ModelError::UnknownPreset { .. }));
    assert!(err.to_string().contains("gpt3_175b"), "{err}");

    let mut c = GptConfig::tiny();
    c.n_heads = 3;
    let err = c.validate().err().ok_or("expected an error")?;
    assert!(
        matches!(
            err,
            ModelError::HeadsDoNotDivide {
                n_heads: 3,
                d_model: 128
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "invalid config: n_heads (3) must divide d_model (128)"
    );
    let mut c = GptConfig::tiny();
    c.n_layers = 0;
    assert!(matches!(
        c.validate(),
        Err(ModelError::ZeroDimension { field: "n_layers" })
    ));
    let mut c = GptConfig::tiny();
    c.layer_norm_eps = 0.0;
    assert!(matches!(
        c.validate(),
        Err(ModelError::InvalidValue {
            field: "layer_norm_eps",
            ..
        })
    ));
    Ok(())
}

#[test]
fn llama3_counts_match_the_published_ones() -> TestResult {
    // Hugging Face's num_parameters() of meta-llama/Meta-Llama-3-8B and -70B, and the
    // 405B's published count
    for (c, n) in [
        (GptConfig::llama3_8b(), 8_030_261_248u64),
        (GptConfig::llama3_70b(), 70_553_706_496),
        (GptConfig::llama3_405b(), 405_853_388_800),
    ] {
        c.validate()?;
        assert_eq!(c.param_count(), n, "{c:?}");
        assert_eq!(c.head_dim(), 128);
        assert_eq!(c.kv_heads(), 8);
    }
    // by hand, 8B: embeddings and head 2 * 128256 * 4096; per block q and o 2 * 4096^2,
    // k and v 2 * 4096 * 1024, the MLP 3 * 4096 * 14336, two RMSNorms; the final one
    let c = GptConfig::llama3_8b();
    let block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096;
    assert_eq!(c.block_param_count(), block);
    assert_eq!(c.embedding_param_count(), 2 * 128_256 * 4096);
    assert_eq!(c.non_embedding_param_count(), 32 * block + 4096);
    let tiny = GptConfig::llama_tiny();
    tiny.validate()?;
    assert!(tiny.grouped_query() && !GptConfig::tiny().grouped_query());
    Ok(())
}

#[test]
fn architecture_settings_that_do_not_fit_are_named() -> TestResult {
    let mut c = GptConfig::llama_tiny();
    c.n_kv_heads = Some(3);
    let e = c.validate().err().ok_or("expected an error")?.to_string();
    assert!(e.contains("n_kv_heads (3) must divide n_heads (4)"), "{e}");
    c.n_kv_heads = Some(0);
    assert!(matches!(
        c.validate(),
        Err(ModelError::ZeroDimension {
            field: "n_kv_heads"
        })
    ));
    // d_model 120 over 8 heads: 15-wide heads cannot rotate in pairs
    let mut c = GptConfig::llama_tiny();
    (c.d_model, c.n_heads, c.n_kv_heads) = (120, 8, Some(2));
    let e = c.validate().err().ok_or("expected an error")?.to_string();
    assert!(e.contains("head dimension") && e.contains("= 15"), "{e}");
    let mut c = GptConfig::llama_tiny();
    c.rope_theta = 0.5;
    assert!(matches!(
        c.validate(),
        Err(ModelError::InvalidValue {
            field: "rope_theta",
            ..
        })
    ));
    let mut c = GptConfig::tiny();
    c.rope_scaling = Some(Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    });
    let e = c.validate().err().ok_or("expected an error")?.to_string();
    assert!(e.contains("rope_scaling") && e.contains("learned"), "{e}");
    let mut c = GptConfig::llama_tiny();
    c.ffn_hidden_size = Some(0);
    assert!(c.validate().is_err());
    Ok(())
}

#[test]
fn gpt_json_is_unchanged_and_llama_json_round_trips() -> TestResult {
    // the GPT presets serialise exactly as before the architecture fields existed, so
    // their checkpoints' architecture hash is unchanged
    assert_eq!(
        serde_json::to_string(&GptConfig::tiny())?,
        r#"{"vocab_size":512,"n_ctx":64,"d_model":128,"n_layers":2,"n_heads":4,"layer_norm_eps":0.00001,"scaled_residual_init":true,"embedding_std":0.02}"#
    );
    let c = GptConfig::llama3_8b();
    let s = serde_json::to_string(&c)?;
    assert!(
        s.contains(r#""norm":"rms_norm""#) && s.contains(r#""mlp":"swiglu""#),
        "{s}"
    );
    assert_eq!(serde_json::from_str::<GptConfig>(&s)?, c);
    Ok(())
}

#[test]
fn config_round_trips_through_json_with_defaults() -> TestResult {
    let c = GptConfig::small_cpu();
    let s = serde_json::to_string(&c)?;
    assert_eq!(serde_json::from_str::<GptConfig>(&s)?, c);
    let minimal = r#"{"vocab_size":512,"n_ctx":64,"d_model":128,"n_layers":2,"n_heads":4}"#;
    assert_eq!(
        serde_json::from_str::<GptConfig>(minimal)?,
        GptConfig::tiny()
    );
    Ok(())
}

#[test]
fn the_memory_shape_counts_what_the_model_holds() -> TestResult {
    // kiln-memory's count of the whole model is the config's, for every preset
    for name in PRESET_NAMES {
        let c = GptConfig::by_name(name)?;
        assert_eq!(c.shape().params(), c.param_count(), "{name}");
    }
    // and its count per tensor-parallel rank is what each rank of the model holds: the query
    // heads split, the key/value heads split where the degree divides them (llama_tiny's 2 at
    // tp = 2) and replicated where it is a multiple of them (tp = 4), the norms replicated, the
    // embedding and an untied head vocab-parallel
    for (c, tps) in [
        (GptConfig::tiny(), &[1usize, 2, 4][..]),
        (GptConfig::llama_tiny(), &[1, 2, 4]),
        (GptConfig::llama_cpu(), &[1, 2, 4]),
    ] {
        let shape = c.shape();
        for &tp in tps {
            let held = kiln_testkit::run_ranks(tp, |comm| {
                let comm: kiln_parallel::tp::TpComm = std::sync::Arc::new(comm);
                let m = crate::Gpt::tensor_parallel(&c, &crate::GptOptions::seeded(3), comm)?;
                Ok(m.num_parameters() as u64)
            });
            let want = shape.params_per_tp_rank(tp as u64);
            assert!(
                held.iter().all(|&n| n == want),
                "{c:?} tp {tp}: {held:?} vs {want}"
            );
            let replicated = crate::kv_replicated(c.n_heads, c.kv_heads(), tp)?;
            assert_eq!(shape.kv_replicated(tp as u64), replicated, "tp {tp}");
        }
    }
    // llama_cpu at tp = 4: its k and v projections (4 layers x 2 x 256 x 64) whole on every rank
    assert_eq!(
        GptConfig::llama_cpu().shape().params_per_tp_rank(4),
        1_853_696
    );
    Ok(())
}
