"""The one model interface: every registered source's Target keeps the contract every evaluation relies on, and a new
source is one module (docs/extending.md, "Add a model source")."""
from pathlib import Path

import pytest
import torch

from sinklab.analysis.measurement import measure_target
from sinklab.analysis.probe_inputs import InputSpec
from sinklab.errors import UserError
from sinklab.evals.interventions import drop_first_key
from sinklab.model import ModelConfig, Transformer
from sinklab.targets import SOURCES, SinklabTarget, Target, TargetSpec, load_target
from tests.helpers import save_ckpt, small_model, tiny_hf, token_ids


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Target]:
    """A tiny model of each of sinklab's sources, loaded through load_target."""
    root = tmp_path_factory.mktemp("targets")
    torch.manual_seed(0)
    ckpt = save_ckpt(small_model(vocab_size=128), root / "m.ckpt")
    found = {"sinklab": load_target(TargetSpec(str(ckpt)))}
    try:
        import transformers  # noqa: F401  (the hf extra)
    except ImportError:
        return found
    found["hf"] = load_target(TargetSpec(str(tiny_hf("llama", root / "llama")), "hf", dtype="float32"))
    return found


def of_source(targets: dict[str, Target], source: str) -> Target:
    if source not in targets:
        pytest.skip(f"source {source}: transformers is not installed (the hf extra)")
    return targets[source]


@pytest.mark.parametrize("source", ["sinklab", "hf"])
def test_every_source_keeps_the_target_contract(targets, source):
    """logits and last_logits agree; a dense stream fed token by token gives the full forward's logits; a mask and a
    replaced activation change the logits only while they are open; nll is the mean loss of the logits."""
    target = of_source(targets, source)
    assert type(target) is SOURCES.get(source) and target.meta.source == source
    idx = token_ids(B=2, T=12, vocab=target.meta.vocab_size)
    with torch.no_grad():
        full = target.logits(idx)  # (B, T, V)
        torch.testing.assert_close(target.last_logits(idx), full[:, -1], atol=1e-5, rtol=1e-5)
        step = target.stream(None, None)
        streamed = torch.stack([step(idx[:1, t:t + 1])[0] for t in range(idx.shape[1])])  # (T, V)
        torch.testing.assert_close(streamed, full[0], atol=1e-4, rtol=1e-4)
        with target.masked(drop_first_key(0)):
            masked = target.logits(idx)
        assert not torch.allclose(masked[:, 1:], full[:, 1:], atol=1e-4)
        torch.testing.assert_close(masked[:, 0], full[:, 0])  # query 1 sees only itself either way
        with target.set_output(0, 3, [0, 1], torch.tensor([0.0, 7.0])):
            changed = target.logits(idx)
        assert not torch.allclose(changed[:, 3:], full[:, 3:], atol=1e-4)
        torch.testing.assert_close(changed[:, :3], full[:, :3])  # causal: the positions before are untouched
        torch.testing.assert_close(target.logits(idx), full)  # nothing stays set
        batch = token_ids(B=2, T=13, vocab=target.meta.vocab_size)
        loss, count = target.nll([batch])
        expected = torch.nn.functional.cross_entropy(target.logits(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        assert count == 2 * 12 and loss == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("source", ["sinklab", "hf"])
def test_a_mask_reaches_the_recorded_maps(targets, source):
    """Under `masked`, the metrics see the masked maps: alpha_1 with the first key dropped is query 1's own 1 / T."""
    target = of_source(targets, source)
    probe = token_ids(B=3, T=16, vocab=target.meta.vocab_size)
    with torch.no_grad(), target.masked(drop_first_key(0)):
        (sink,) = target.measure(probe, ["sink"], k=1)
    alpha = sink.scores().alpha[..., 0]  # (N, L, H)
    torch.testing.assert_close(alpha, torch.full_like(alpha, 1 / 16))


def test_an_unknown_source_is_one_line():
    with pytest.raises(UserError, match=r"^target source 'litgpt' is unknown; allowed: sinklab, hf"):
        load_target(TargetSpec("x", "litgpt"))


# ------------------------------------------------------------------------------------------------ a third source
class StateDictTarget(SinklabTarget):
    """docs/extending.md's example: a sinklab model saved as a bare {"config", "state_dict"} file (no Lightning
    checkpoint, no run) is a new source in one class."""

    @classmethod
    def load(cls, spec: TargetSpec) -> "StateDictTarget":
        saved = torch.load(spec.name, map_location="cpu", weights_only=True)
        model = Transformer(ModelConfig.from_dict(saved["config"]))
        model.load_state_dict(saved["state_dict"])
        return cls.of_model(model.to(spec.device), spec.name)


@pytest.fixture
def state_dict_source():
    SOURCES.register("state_dict")(StateDictTarget)
    try:
        yield
    finally:
        SOURCES._classes.pop("state_dict")


def test_a_third_source_is_one_class_and_every_analysis_takes_it(state_dict_source, tmp_path):
    """Registered, it loads through load_target and `sinklab measure`'s measurement gives what it gives for the same
    model loaded as a sinklab checkpoint."""
    torch.manual_seed(1)
    model = small_model(vocab_size=128)
    torch.save({"config": model.cfg.to_dict(), "state_dict": model.state_dict()}, tmp_path / "weights.pt")
    save_ckpt(model, tmp_path / "m.ckpt")
    inputs = InputSpec(kind="random", num_seqs=4, seq_len=16)
    with torch.no_grad():
        ours = measure_target(load_target(TargetSpec(str(tmp_path / "weights.pt"), "state_dict")), inputs)
        theirs = measure_target(load_target(TargetSpec(str(tmp_path / "m.ckpt"))), inputs)
    assert ours["source"] == "state_dict" and theirs["source"] == "sinklab"
    for key in ("sink", "alpha", "massive", "entropy"):
        assert ours[key] == theirs[key]


def test_a_source_name_is_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        SOURCES.register("sinklab")(StateDictTarget)
    assert SOURCES.get("sinklab") is SinklabTarget


def test_kept_checkpoints_belong_to_their_run(tmp_path):
    """RUN/checkpoints/kept/*.ckpt find RUN's config, as last.ckpt does (their probe set is the run's)."""
    from sinklab.runs.run_data import run_dir_of

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}\n")
    kept = tmp_path / "checkpoints" / "kept" / "step0000010-tokens640.ckpt"
    kept.parent.mkdir(parents=True)
    assert run_dir_of(kept) == tmp_path and run_dir_of(tmp_path / "checkpoints" / "last.ckpt") == tmp_path
    assert run_dir_of(Path("/nonexistent/x/y/z.ckpt")) is None


def test_the_gguf_minimum_is_the_gguf_extras():
    """sinklab.targets.gguf.MIN_TRANSFORMERS (the one-line refusal's) is the transformers minimum that pyproject.toml's
    `gguf` extra installs, and above the `hf` extra's (the reason it exists)."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    from sinklab.targets.gguf import MIN_TRANSFORMERS

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def minimum(extra: str) -> Version:
        (req,) = [r for r in map(Requirement, extras[extra]) if r.name == "transformers"]
        (spec,) = [s for s in req.specifier if s.operator == ">="]
        return Version(spec.version)

    assert minimum("gguf") == Version(MIN_TRANSFORMERS)
    assert minimum("gguf") > minimum("hf")
