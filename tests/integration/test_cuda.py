"""The GPU path on a CUDA device: the attention backends (sdpa, flex) against the explicit maps in fp32 and bf16,
forward and backward; memory-linear training of the other operations; decoding with the KV cache; the chunked sink
metric; and `scale=paper` on one device, trained a few steps in bf16-mixed and measured.

Every test is marked `cuda` and skipped without a CUDA device (CI runs on CPUs). On a GPU machine:
`python -m pytest -m cuda -q` (docs/performance.md has what it gave).

Accuracy is judged as ||got - want|| / ||want|| against the explicit maps in fp32 on the same device: fp32 paths land
far under 1e-3 (TF32-free matmuls; FlexAttention's and SDPA's kernels sum in another order); in bf16 every path,
the explicit one included, carries bf16 rounding, so a fused path may be at most twice as far from the fp32
reference as the explicit path in bf16 is (plus 1e-3): as accurate as the maps it replaces, never a different
function."""
from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import pytest
import torch

from sinklab.metrics.sink import attention_scores, brute_force_alpha
from sinklab.model import ModelConfig, Transformer
from sinklab.train.throughput import peak_memory
from tests.helpers import fake_text, run_cli, training_peak

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI runs on CPUs)")]

CUDA = torch.device("cuda")
FP32, BF16 = torch.float32, torch.bfloat16
# T = 300: not a multiple of FlexAttention's 128-token blocks, so partial blocks are exercised
MID = dict(vocab_size=256, n_layer=2, n_head=4, d_model=128, d_ff=256, block_size=300)
FP32_REL = 1e-3


@pytest.fixture(autouse=True, scope="module")
def _many_compiles():
    """Each case compiles FlexAttention for its own masks and score function: allow more recompilations than
    Dynamo's default of 8 per function, after which it would run the case eagerly (correct, but not the kernel)."""
    import torch._dynamo

    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 256
    yield
    torch._dynamo.config.recompile_limit = limit


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def cuda_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**MID, **overrides})).to(CUDA).train()


def tokens(B: int = 2, T: int = 300, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed)).to(CUDA)


def logits_and_grads(m: Transformer, idx: torch.Tensor, dtype: torch.dtype):
    """Logits and every parameter's gradient of a fixed linear function of the logits; bf16 under autocast, as
    Lightning's bf16-mixed (fp32 weights)."""
    m.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=BF16, enabled=dtype is BF16):
        logits = m(idx)
    weights = torch.linspace(-1, 1, logits.shape[-1], device=CUDA)
    (logits.float() * weights).sum().backward()
    return logits.detach().float(), {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}


def errors(got, want) -> dict[str, float]:
    assert got[1].keys() == want[1].keys()
    return {"logits": rel_err(got[0], want[0]), **{n: rel_err(got[1][n], want[1][n]) for n in want[1]}}


def assert_as_accurate(name: str, model_kw: dict, idx: torch.Tensor, dtype: torch.dtype, **path) -> None:
    """The path `path` (backend / memory switches) against the explicit maps: in fp32 within FP32_REL, in bf16
    within twice the explicit path's own bf16 error (+ 1e-3), for the logits and every gradient."""
    ref = logits_and_grads(cuda_model(**model_kw, attn_backend="explicit"), idx, FP32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = errors(logits_and_grads(cuda_model(**model_kw, **path), idx, dtype), ref)
    fallbacks = [str(w.message) for w in caught if "falls back" in str(w.message)]
    assert not fallbacks, f"{name}: {fallbacks}"  # the kernel itself ran, not a fallback
    if dtype is FP32:
        bound = {k: FP32_REL for k in got}
    else:
        own = errors(logits_and_grads(cuda_model(**model_kw, attn_backend="explicit"), idx, BF16), ref)
        bound = {k: 2 * own[k] + 1e-3 for k in got}
    bad = {k: f"{v:.2e} > {bound[k]:.2e}" for k, v in got.items() if not v <= bound[k]}
    assert not bad, f"{name} ({dtype}): {bad}"


SOFTMAX_CASES = {
    "causal": {},
    "window_prefix": dict(window=64, prefix_len=16),
    "alibi": dict(pos="alibi"),
    "relative": dict(pos="relative"),
    "sink_logit": dict(sink_logit="learned"),
    "off_by_one": dict(sink_logit="zero"),
    "kv_bias_sink_tokens": dict(attn_bias="kv", n_sink_tokens=2),
    "gqa": dict(n_kv_head=2),
    # the sparse patterns with a fused path (model.sparsity, issue 36): FlexAttention's block masks, MoBA's router
    # selecting blocks from the scores inside the mask_mod; top-k selects per key and runs on the explicit maps
    "moba": dict(sparsity="moba", moba_block=60, moba_topk=3),
    "moba_force_first": dict(sparsity="moba", moba_block=50, moba_topk=2, moba_force_first=True),
    "ashape": dict(sparsity="ashape", ashape_window=48, ashape_first=4),
    "strided": dict(sparsity="strided", strided_stride=32),
    "bigbird": dict(sparsity="bigbird", bigbird_block=30, bigbird_window=1, bigbird_global=1, bigbird_random=2),
}


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=list(SOFTMAX_CASES))
def test_fused_softmax_backends_equal_the_explicit_maps(case, backend, dtype):
    assert_as_accurate(f"{case} on {backend}", SOFTMAX_CASES[case], tokens(), dtype, attn_backend=backend)


LINEAR_OPS = {
    "sigmoid": dict(attn_op="sigmoid"),
    "sigmoid_norm": dict(attn_op="sigmoid", attn_normalize=True),
    "softpick": dict(attn_op="softpick"),
    "relu": dict(attn_op="relu"),
    "elu": dict(attn_op="elu"),
    "kernel_identity_norm": dict(attn_op="kernel", kernel_map="identity", attn_normalize=True),
    "sink_logit_explicit": dict(sink_logit="learned", attn_backend="explicit"),
}


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", LINEAR_OPS, ids=list(LINEAR_OPS))
def test_memory_linear_training_equals_the_explicit_maps(op, dtype):
    kw = dict(LINEAR_OPS[op])
    kw.pop("attn_backend", None)
    assert_as_accurate(f"{op}, attn_memory=linear", kw, tokens(), dtype, attn_memory="linear",
                       attn_backend=LINEAR_OPS[op].get("attn_backend", "sdpa"))


@pytest.mark.parametrize("op", ["sigmoid", "softpick"])
def test_memory_linear_training_grows_linearly_in_t_on_cuda(op):
    def exponent(**kw):
        peaks = [training_peak(T, "cuda", attn_op=op, **kw) for T in (1024, 4096)]
        return math.log(peaks[1] / peaks[0]) / math.log(4)
    linear, kept = exponent(attn_memory="linear"), exponent(attn_memory="keep_maps")  # auto is linear at 4096
    assert linear <= 1.2 < 1.5 <= kept, (linear, kept)


CACHE_CASES = {"rope": {}, "alibi_window": dict(pos="alibi", window=16), "sink_logit": dict(sink_logit="learned"),
               "kv_bias_sink_tokens": dict(attn_bias="kv", n_sink_tokens=2), "sigmoid": dict(attn_op="sigmoid")}


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("case", CACHE_CASES, ids=list(CACHE_CASES))
def test_decoding_with_the_kv_cache_gives_the_full_forward(case, backend, dtype):
    m = cuda_model(**CACHE_CASES[case], attn_backend=backend).eval()
    idx = tokens(B=2, T=40)
    with torch.no_grad(), torch.autocast("cuda", dtype=BF16, enabled=dtype is BF16):
        full = m(idx).float()
        cache = m.new_cache()
        steps = torch.stack([m(idx[:, t:t + 1], cache=cache)[:, -1].float() for t in range(idx.shape[1])], dim=1)
    assert cache.seen == idx.shape[1]
    err = rel_err(steps, full)
    assert err <= (1e-4 if dtype is FP32 else 2e-2), err


METRIC_CASES = {"softmax": {}, "sigmoid": dict(attn_op="sigmoid"), "k_bias": dict(attn_bias="k"),
                "sink_logit": dict(sink_logit="learned"), "alibi_sink_tokens": dict(pos="alibi", n_sink_tokens=1)}


@pytest.mark.parametrize("case", METRIC_CASES, ids=list(METRIC_CASES))
def test_the_chunked_metric_on_cuda_equals_the_brute_force_one_on_the_cpu(case):
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**{**MID, "block_size": 64}, **METRIC_CASES[case])).eval()
    probe = torch.randint(0, 256, (6, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = brute_force_alpha(m, probe, k=4)
    got = attention_scores(m.to(CUDA), probe.to(CUDA), k=4, batch_size=4, chunk=24)
    for name in ("alpha", "slot", "alpha_star", "slot_star"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=0, msg=name)


def test_the_chunked_metric_memory_grows_linearly_in_t_on_cuda():
    """One layer's maps grow as T^2 (4 heads x 8192^2 x 4 bytes = 1.07 GB a sequence at T = 8192); the chunked
    route holds the recorded queries and keys and one chunk of rows at a time: linear in T."""
    def peak(T: int) -> int:
        torch.manual_seed(0)
        m = Transformer(ModelConfig(vocab_size=256, n_layer=1, n_head=4, d_model=128, d_ff=256, block_size=T))
        m = m.to(CUDA).eval()
        probe = tokens(B=2, T=T)
        return peak_memory(lambda: attention_scores(m, probe, k=4, batch_size=2, chunk=128), CUDA)
    exponent = math.log(peak(8192) / peak(2048)) / math.log(4)
    assert exponent <= 1.2, exponent


def paper_overrides(out: Path, corpus: Path) -> list[str]:
    """scale=paper on one device, made small in what does not change the path: 2 layers, 2 sequences a micro-batch,
    a local corpus with a small BPE instead of the Pile."""
    return ["scale=paper", "trainer.devices=1", "trainer.accumulate_grad_batches=2", "data=local",
            f"data.files=[{corpus}]", "data.vocab_size=512", "data.batch_size=2", "data.val_num_blocks=4",
            "data.probe_num_seqs=8", "model.n_layer=2", "trainer.max_steps=4", "trainer.val_check_interval=8",
            "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "callbacks.sink.every_n_steps=2",
            "callbacks.checkpoint.every_n_train_steps=4", "trainer.enable_progress_bar=false",
            f"paths.output_dir={out}"]


def test_scale_paper_composes_for_one_device():
    """The preset's comment: keep data.batch_size x devices x nodes x accumulation at 512 sequences."""
    from sinklab.config import compose

    cfg = compose(["scale=paper", "trainer.devices=1", "trainer.accumulate_grad_batches=32"])
    t = cfg.trainer
    assert cfg.data.batch_size * t.devices * t.num_nodes * t.accumulate_grad_batches == 512
    assert (cfg.model.block_size, t.precision, cfg.model.attn_memory) == (2048, "bf16-mixed", "linear")


def test_scale_paper_trains_on_one_device_in_bf16_and_is_measured(tmp_path, capsys):
    from sinklab.config import compose
    from sinklab.train.entry import train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(fake_text(0, 120_000))
    out = tmp_path / "run"
    cfg = compose(paper_overrides(out, corpus))
    assert (cfg.trainer.precision, cfg.trainer.strategy) == ("bf16-mixed", "ddp")
    train(cfg)
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    sinks = [float(r["sink/sink1"]) for r in rows if r.get("sink/sink1")]
    assert losses and all(math.isfinite(v) for v in losses)
    assert sinks and all(0.0 <= v <= 100.0 for v in sinks)
    assert (out / "checkpoints" / "last.ckpt").exists()

    import json

    capsys.readouterr()
    ckpt = out / "checkpoints" / "last.ckpt"
    rc, printed, err = run_cli("sinklab", "measure", str(ckpt), "--device", "cuda", "--input", "random", "--json",
                               capsys=capsys)
    assert rc == 0, err
    report = json.loads(printed)
    rates = report["sink"].values() if isinstance(report["sink"], dict) else [report["sink"]]
    assert all(0.0 <= float(v) <= 100.0 for v in rates)
    assert 0.0 <= report["alpha_mean"]["1"] <= 1.0
