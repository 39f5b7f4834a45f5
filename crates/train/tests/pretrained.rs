//! Models in and out: a checkpoint saved at dp=2 x tp=2 with ZeRO-1 reads back as whole
//! parameters bitwise equal to the trained ones; exported to Hugging Face's GPT-2 layout, an
//! independent numpy GPT-2 (scripts/gpt2_numpy_forward.py, float64) computes kiln's logits
//! within 1e-5, and Python's `tokenizers` reads the exported tokenizer.json to the same ids;
//! importing the export gives the parameters back bitwise; greedy generation
//! from the checkpoint and from the export is the same; runs started from the export at tp=1
//! and tp=4 (`model.init_from`) hold the exported weights bitwise and train on.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use candle_core::{Device, Tensor};
use common::{test_dir, tiny_config};
use kiln_model::{generate, hf, Gpt, GptOptions, Sampling};
use kiln_state::TensorData;
use kiln_testkit::Python;
use kiln_train::{run_threads_with, Pretrained, RunConfig, Trainer};
use std::ffi::OsStr;
use std::path::Path;

type Params = Vec<(String, Vec<f32>)>;

fn values(params: &[(String, TensorData)]) -> Params {
    params
        .iter()
        .map(|(n, t)| (n.clone(), t.to_vec::<f32>().unwrap()))
        .collect()
}

/// Bitwise equality of two parameter lists, whatever their order.
fn assert_bitwise(what: &str, a: &Params, b: &Params) {
    assert_eq!(a.len(), b.len(), "{what}: parameter count");
    let (mut a, mut b) = (a.clone(), b.clone());
    a.sort_by(|x, y| x.0.cmp(&y.0));
    b.sort_by(|x, y| x.0.cmp(&y.0));
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb, "{what}: order");
        let same =
            va.len() == vb.len() && va.iter().zip(vb).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{what}: parameter {na} differs");
    }
}

fn config(root: &Path, dp: usize, tp: usize, zero: u8, steps: u64) -> RunConfig {
    let mut c = tiny_config("pretrained", root, "shakespeare_200k", 200_000);
    c.parallel.dp = dp;
    c.parallel.tp = tp;
    c.parallel.zero = kiln_state::ZeroStage::from_number(zero).unwrap();
    c.train.micro_batch = 4 / dp;
    c.train.accumulation = 1;
    c.train.steps = steps;
    c.optim.schedule.lr = 1e-2;
    c.optim.schedule.warmup_steps = 2;
    c.checkpoint.every_steps = steps;
    c.checkpoint.keep_last = 0;
    c.checkpoint.async_save = false;
    c.metrics.jsonl = false;
    c.metrics.tensorboard = false;
    c.metrics.png = false;
    c
}

/// Runs `cfg`; returns rank 0's losses, its whole parameters right after building and at the
/// end.
fn run(cfg: &RunConfig) -> (Vec<(u64, f32)>, Params, Params) {
    let mut out = run_threads_with(cfg, |ctx| {
        let mut t = Trainer::builder(ctx.config.clone()).build(ctx.comm)?;
        let first = t.dense_parameters()?;
        while t.step() < ctx.config.train.steps {
            t.train_step()?;
        }
        let last = t.dense_parameters()?;
        Ok((t.finish()?.losses, first, last))
    })
    .unwrap();
    out.swap_remove(0)
}

/// A model's parameters as whole tensors.
fn params_of(model: &Gpt) -> Vec<(String, TensorData)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| {
            let data: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
            (n, TensorData::from_slice(v.dims(), &data).unwrap())
        })
        .collect()
}

/// The logits of one sequence, flat.
fn logits_of(model: &Gpt, ids: &[u32]) -> Vec<f32> {
    let tokens = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&tokens)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The largest absolute difference.
fn worst_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

fn model_of(p: &Pretrained) -> Gpt {
    let model = Gpt::new(&p.config, &GptOptions::seeded(99)).unwrap();
    p.load_into(&model).unwrap();
    model
}

/// The numpy reference's logits for `ids`, or None (with the reason printed) where python3
/// lacks numpy outside CI.
fn numpy_logits(dir: &Path, ids: &[u32]) -> Option<Vec<f32>> {
    let python = Python::require("the numpy GPT-2 reference", &["numpy"])?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpt2_numpy_forward.py");
    let out = dir.join("numpy_logits.f32");
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    python.run(
        "scripts/gpt2_numpy_forward.py",
        [
            script.as_os_str(),
            dir.as_os_str(),
            OsStr::new(&ids.join(",")),
            out.as_os_str(),
        ],
    );
    let bytes = std::fs::read(&out).unwrap();
    Some(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

/// Python's `tokenizers` encoding of `text` with `dir/tokenizer.json`, or None (with the
/// reason printed) where python3 lacks `tokenizers` outside CI.
fn python_tokenizer_ids(dir: &Path, text: &str) -> Option<Vec<u32>> {
    let python = Python::require("the Python tokenizers check", &["tokenizers"])?;
    let script = "import sys\nfrom tokenizers import Tokenizer\n\
                  t = Tokenizer.from_file(sys.argv[1])\n\
                  print(','.join(map(str, t.encode(sys.argv[2]).ids)))";
    let out = python.run(
        "tokenizers' Tokenizer.encode",
        [
            OsStr::new("-c"),
            OsStr::new(script),
            dir.join("tokenizer.json").as_os_str(),
            OsStr::new(text),
        ],
    );
    Some(out.trim().split(',').map(|s| s.parse().unwrap()).collect())
}

#[test]
fn export_import_and_start_from_it_at_another_tp() {
    let root = test_dir("pretrained");
    // train at dp=2 x tp=2, ZeRO-1, and checkpoint the last step
    let cfg = config(&root, 2, 2, 1, 12);
    let (losses, _, trained) = run(&cfg);
    let ckpt = cfg.checkpoint_dir();

    // the checkpoint as whole parameters: bitwise the trained ones
    let from_ckpt = Pretrained::load(&ckpt.join("latest")).unwrap();
    assert_eq!(from_ckpt.config, cfg.gpt_config().unwrap());
    assert_bitwise("checkpoint", &values(&from_ckpt.params), &trained);
    let tokenizer = from_ckpt
        .tokenizer
        .clone()
        .expect("the run's tokenizer beside its checkpoints");
    assert!(
        from_ckpt.source.to_string().contains("step 12"),
        "{}",
        from_ckpt.source
    );

    // export, and import it back: bitwise
    let export = root.join("hf");
    let eot = kiln_data::Tokenizer::from_file(&tokenizer).unwrap().eot();
    let files = hf::save_hf_dir(
        &export,
        &from_ckpt.config,
        &from_ckpt.params,
        Some(&tokenizer),
        Some(eot),
    )
    .unwrap();
    assert_eq!(files.len(), 3);
    let imported = Pretrained::load(&export).unwrap();
    assert_eq!(imported.config.vocab_size, from_ckpt.config.vocab_size);
    assert_bitwise("import of the export", &values(&imported.params), &trained);
    assert!(imported.tokenizer.is_some());

    // an independent GPT-2 in numpy computes kiln's logits from the exported files
    let tok = kiln_data::Tokenizer::from_file(&tokenizer).unwrap();
    let ids = tok
        .encode("ROMEO:\nBut soft, what light through yonder window")
        .unwrap();
    // Python's `tokenizers` reads the exported tokenizer.json and encodes the same ids
    if let Some(py_ids) = python_tokenizer_ids(
        &export,
        "ROMEO:\nBut soft, what light through yonder window",
    ) {
        assert_eq!(py_ids, ids);
    }
    let model = model_of(&imported);
    let logits = logits_of(&model, &ids);
    if let Some(reference) = numpy_logits(&export, &ids) {
        let worst = worst_diff(&logits, &reference);
        let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        println!(
            "numpy GPT-2 vs kiln: {} logits, largest |difference| {worst:.3e} (largest |logit| {scale:.2})",
            logits.len()
        );
        assert!(worst <= 1e-5, "logits differ by {worst:e}");
    }

    // greedy generation from the checkpoint and from its export: the same tokens
    let a = generate(&model_of(&from_ckpt), &ids, 20, Sampling::Greedy, 0).unwrap();
    let b = generate(&model, &ids, 20, Sampling::Greedy, 0).unwrap();
    assert_eq!(a, b);

    // start runs from the export at tp=1 and at tp=4: the exported weights, then training
    let trained_loss = losses.last().unwrap().1;
    let mut first_losses = Vec::new();
    for tp in [1, 4] {
        let dir = root.join(format!("import-tp{tp}"));
        let mut c = config(&dir, 1, tp, 0, 4);
        c.model.init_from = Some(export.clone());
        // the corpus in the export's token ids (the same tokenizer: the same batches)
        c.data.tokenizer = Some(export.join("tokenizer.json"));
        let (l, start, _) = run(&c);
        assert_bitwise(&format!("start at tp={tp}"), &start, &trained);
        assert_eq!(l.len(), 4);
        assert!(l.iter().all(|(_, v)| v.is_finite()), "tp={tp}: {l:?}");
        println!("tp={tp}: losses {l:?} (the exported run ended at {trained_loss})");
        first_losses.push(l[0].1);
    }
    // the imported model starts where the export left off, far below a fresh model's ln(512)
    assert!(
        first_losses[0] < losses[0].1 - 0.5,
        "{first_losses:?} vs {losses:?}"
    );
    let rel = (first_losses[0] - first_losses[1]).abs() / first_losses[0];
    assert!(rel < 1e-5, "tp=1 and tp=4 first losses {first_losses:?}");

    // an architecture that does not match is refused, naming both
    let mut wrong = config(&root.join("wrong"), 1, 1, 0, 4);
    wrong.model.init_from = Some(export.clone());
    wrong.model.d_model = Some(64);
    let err = run_threads_with(&wrong, |ctx| {
        Trainer::builder(ctx.config.clone())
            .build(ctx.comm)
            .map(|_| ())
    })
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(err.contains("d_model 128 (the run: 64)"), "{err}");
}

#[test]
fn a_damaged_export_names_the_file_and_tensor() {
    let root = test_dir("pretrained-damaged");
    let cfg = kiln_model::GptConfig::new(32, 8, 16, 1, 2);
    let model = Gpt::new(&cfg, &GptOptions::seeded(1)).unwrap();
    let params = params_of(&model);
    let dir = root.join("hf");
    hf::save_hf_dir(&dir, &cfg, &params, None, None).unwrap();
    assert_bitwise(
        "round trip",
        &values(&Pretrained::load(&dir).unwrap().params),
        &values(&params),
    );
    // a tensor renamed: the file and the missing tensor are named
    let mut renamed = hf::read_safetensors(&dir.join(hf::HF_WEIGHTS_FILE)).unwrap();
    for (n, _) in renamed.iter_mut() {
        if n == "transformer.h.0.mlp.c_fc.weight" {
            *n = "transformer.h.0.mlp.fc1.weight".into();
        }
    }
    hf::write_safetensors(&dir.join(hf::HF_WEIGHTS_FILE), &renamed).unwrap();
    let err = Pretrained::load(&dir).err().unwrap().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("fc1.weight"),
        "{err}"
    );
    // truncated weights
    let bytes = std::fs::read(dir.join(hf::HF_WEIGHTS_FILE)).unwrap();
    std::fs::write(dir.join(hf::HF_WEIGHTS_FILE), &bytes[..bytes.len() / 2]).unwrap();
    let err = Pretrained::load(&dir).err().unwrap().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("not a safetensors file"),
        "{err}"
    );
    // a config kiln cannot compute
    hf::save_hf_dir(&dir, &cfg, &params, None, None).unwrap();
    let text = std::fs::read_to_string(dir.join(hf::HF_CONFIG_FILE)).unwrap();
    std::fs::write(
        dir.join(hf::HF_CONFIG_FILE),
        text.replace("\"gelu_new\"", "\"relu\""),
    )
    .unwrap();
    let err = Pretrained::load(&dir).err().unwrap().to_string();
    assert!(
        err.contains("config.json") && err.contains("activation_function"),
        "{err}"
    );
    // a folder that is nothing
    let err = Pretrained::load(&root.join("nothing"))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("nothing"), "{err}");
}

/// The main job's architecture (`small_cpu`: vocabulary 8192, 4 layers of width 256) at its
/// whole context of 128 tokens: the numpy GPT-2 computes kiln's logits within 1e-5.
#[test]
fn numpy_gpt2_matches_small_cpu_at_full_context() {
    let root = test_dir("pretrained-small-cpu");
    let cfg = kiln_model::GptConfig::small_cpu();
    let model = Gpt::new(&cfg, &GptOptions::seeded(5)).unwrap();
    let params = params_of(&model);
    let dir = root.join("hf");
    hf::save_hf_dir(&dir, &cfg, &params, None, None).unwrap();
    let ids: Vec<u32> = (0..cfg.n_ctx as u32)
        .map(|i| (i * 977 + 13) % 8192)
        .collect();
    let logits = logits_of(&model, &ids);
    if let Some(reference) = numpy_logits(&dir, &ids) {
        let worst = worst_diff(&logits, &reference);
        println!("numpy GPT-2 vs kiln, small_cpu at 128 tokens: largest |difference| {worst:.3e}");
        assert!(worst <= 1e-5, "logits differ by {worst:e}");
    }
}

/// The real other side, where it is installed (it is not in CI: PyTorch is gigabytes):
/// `transformers.GPT2LMHeadModel.from_pretrained` loads kiln's export with no missing or
/// unexpected key and computes kiln's logits; a GPT-2 that `transformers` initialised and
/// wrote with `save_pretrained` imports into kiln with `transformers`' logits. The Python is
/// `$KILN_HF_PYTHON` (default `python3`); without `torch` and `transformers` the test says so
/// and passes.
#[test]
fn transformers_reads_the_export_and_writes_an_importable_gpt2() {
    let cfg = kiln_model::GptConfig::new(96, 32, 32, 2, 4);
    transformers_round_trip("gpt2", &cfg);
}

/// The same with `LlamaForCausalLM`: grouped-query attention (4 query heads sharing 2
/// key/value heads), an untied head and Llama 3.1's rotary scaling, both ways.
#[test]
fn transformers_reads_the_export_and_writes_an_importable_llama() {
    let mut cfg = kiln_model::GptConfig::llama(96, 32, 32, 2, 4, 2, 88, 10_000.0);
    cfg.rope_scaling = Some(kiln_model::ops::Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16,
    });
    transformers_round_trip("llama", &cfg);
}

fn transformers_round_trip(arch: &str, cfg: &kiln_model::GptConfig) {
    let name = format!("transformers_reads_the_export_and_writes_an_importable_{arch}");
    let program = std::env::var("KILN_HF_PYTHON").unwrap_or_else(|_| "python3".into());
    // not installed by CI (PyTorch is gigabytes): missing, the test skips there too
    let Some(python) = Python::optional(
        &program,
        &format!("{name} (set KILN_HF_PYTHON to a Python that has them)"),
        &["numpy", "torch", "transformers"],
    ) else {
        return;
    };
    let root = test_dir(&format!("pretrained-transformers-{arch}"));
    // `write` initialises the architecture of kiln's `cfg` in transformers (its own init) and
    // saves it; `read` loads kiln's export
    const SCRIPT: &str = r#"
import sys, json, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
arch, mode, d, ids, out = sys.argv[1], sys.argv[2], sys.argv[3], [int(s) for s in sys.argv[4].split(",")], sys.argv[5]
cls = GPT2LMHeadModel if arch == "gpt2" else LlamaForCausalLM
if mode == "write":
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    else:
        cfg = LlamaConfig(vocab_size=96, max_position_embeddings=32, hidden_size=32,
                          intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                          tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    m = cls(cfg)
    m.save_pretrained(d)
    info = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
else:
    m, info = cls.from_pretrained(d, output_loading_info=True)
m.eval()
with torch.no_grad():
    logits = m(torch.tensor([ids])).logits[0].float().numpy().astype("<f4")
logits.tofile(out)
print(json.dumps({k: sorted(map(str, info[k])) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}))
"#;
    let run = |mode: &str, dir: &Path, ids: &[u32]| -> Vec<f32> {
        let file = root.join(format!("{mode}.f32"));
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        let stdout = python.run(
            &format!("transformers {arch} ({mode})"),
            [
                OsStr::new("-c"),
                OsStr::new(SCRIPT),
                OsStr::new(arch),
                OsStr::new(mode),
                dir.as_os_str(),
                OsStr::new(&list.join(",")),
                file.as_os_str(),
            ],
        );
        let clean = r#"{"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}"#;
        assert!(
            stdout.contains(clean),
            "transformers' loading info: {stdout}"
        );
        std::fs::read(&file)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    // kiln -> transformers
    let model = Gpt::new(cfg, &GptOptions::seeded(3)).unwrap();
    let export = root.join("from-kiln");
    hf::save_hf_dir(&export, cfg, &params_of(&model), None, None).unwrap();
    let ids: Vec<u32> = (0..32).map(|i| (i * 37 + 5) % 96).collect();
    let worst = worst_diff(&run("read", &export, &ids), &logits_of(&model, &ids));
    println!("{arch}: transformers on kiln's export vs kiln: largest |difference| {worst:.3e}");
    assert!(worst <= 1e-5, "{worst:e}");
    // transformers -> kiln
    let written = root.join("from-transformers");
    let reference = run("write", &written, &ids);
    let imported = Pretrained::load(&written).unwrap();
    assert_eq!(imported.config.kv_heads(), cfg.kv_heads());
    assert_eq!(imported.config.rope_scaling, cfg.rope_scaling);
    let worst = worst_diff(&reference, &logits_of(&model_of(&imported), &ids));
    println!(
        "{arch}: kiln on transformers' save_pretrained vs transformers: largest |difference| \
         {worst:.3e}"
    );
    assert!(worst <= 1e-5, "{worst:e}");
}
