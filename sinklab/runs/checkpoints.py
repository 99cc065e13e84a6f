"""Loading sinklab checkpoints safely: no code from the file is run (weights_only), and no module it names is
imported (its plugins are the user's to load); clear errors otherwise."""
from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch

from sinklab.errors import UserError
from sinklab.model import ModelConfig, Transformer
from sinklab.plugins import ENV, load_plugins

log = logging.getLogger("sinklab")

KEPT_DIR = "kept"  # <checkpoint dir>/kept/: the checkpoints of callbacks.checkpoint.keep
TOKENS_SEEN = "sinklab_tokens_seen"  # a checkpoint's key: training tokens seen up to its global_step
PLUGINS = "sinklab_plugins"  # a checkpoint's key: the plugin modules its run had loaded (sinklab.plugins)
_NOTED: set[tuple[str, ...]] = set()  # plugin modules a checkpoint names that were noted as not loaded
_KEPT_NAME = re.compile(r"^step(\d+)-tokens(\d+)\.ckpt$")


def find_checkpoint(path: Union[str, Path]) -> Path:
    """A .ckpt file, or a run dir -> its checkpoints/last.ckpt."""
    p = Path(path)
    if p.is_dir():
        last = p / "checkpoints" / "last.ckpt"
        if not last.exists():
            raise UserError(f"{p} is a directory without checkpoints/last.ckpt; pass a run dir or a .ckpt file")
        return last
    if not p.is_file():
        raise UserError(f"checkpoint {p} does not exist")
    return p


def kept_name(step: int, tokens: int) -> str:
    """The file name of a kept checkpoint: step0000400-tokens409600.ckpt."""
    return f"step{step:07d}-tokens{tokens}.ckpt"


def kept_checkpoints(run_dir: Union[str, Path]) -> list[tuple[int, int, Path]]:
    """(step, tokens seen, path) of a run dir's kept checkpoints (checkpoints/kept/), by step."""
    found = []
    for path in (Path(run_dir) / "checkpoints" / KEPT_DIR).glob("*.ckpt"):
        m = _KEPT_NAME.match(path.name)
        if m:
            found.append((int(m[1]), int(m[2]), path))
    return sorted(found)


def read_checkpoint(path: Union[str, Path], mmap: bool = False) -> dict:
    """torch.load with weights_only=True; truncated or foreign files are refused with the file's name.
    mmap=True maps the tensors instead of reading them (a cheap check of a large file)."""
    p = find_checkpoint(path)
    try:
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception:
            if not mmap:
                raise
            ckpt = torch.load(p, map_location="cpu", weights_only=True)  # e.g. the legacy (non-zip) format
    except Exception as err:
        raise UserError(f"{p} is not a readable sinklab checkpoint ({_why_unreadable(err)})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "model" not in ckpt.get("hyper_parameters", {}):
        raise UserError(f"{p} is not a sinklab checkpoint (no state_dict / model hyper-parameters)")
    return ckpt


def _why_unreadable(err: Exception) -> str:
    import pickle

    text = str(err)
    if "Weights only load failed" in text:
        return ("UnpicklingError: it holds Python objects other than tensors and plain containers, which sinklab "
                "never unpickles since that can run code from the file (torch.load weights_only=True)")
    if "central directory" in text or "zip archive" in text or isinstance(err, (EOFError, pickle.UnpicklingError)):
        return f"{type(err).__name__}: it is truncated or not a torch checkpoint (its zip archive cannot be read)"
    first = text.splitlines()[0][:200] if text else "no message"
    return f"{type(err).__name__}: {first}; it is damaged or not a torch checkpoint"


TRAINING_KEYS = ("global_step", "loops", "optimizer_states", "lr_schedulers", "callbacks")
# may differ between a checkpoint and the run that resumes it
EXECUTION_KEYS = ("compile", "fused", "attn_backend", "attn_memory")


def read_training_checkpoint(path: Union[str, Path]) -> dict:
    """A checkpoint a run can resume from: readable with weights_only, a sinklab checkpoint, with the trainer state
    (optimizer, loops, schedulers) that `Trainer.fit(ckpt_path=...)` restores. Tensors are memory-mapped."""
    ckpt = read_checkpoint(path, mmap=True)
    missing = [k for k in TRAINING_KEYS if k not in ckpt]
    if missing:
        raise UserError(f"{find_checkpoint(path)} cannot resume training: it has no {', '.join(missing)} (a "
                        f"weights-only export?); start a new run (ckpt_path=null) or pass a checkpoint written by "
                        f"sinklab-train")
    return ckpt


def model_differences(saved: dict, model: dict, also: tuple[str, ...] = ()) -> str:
    """The keys (up to 4) in which a checkpoint's model config `saved` differs from a run's `model`, shown as
    "model.k=<there> there, <here> here"; '' when none. EXECUTION_KEYS and the keys `also` are not compared."""
    model = ModelConfig.from_dict(dict(model)).to_dict()
    diff = [k for k in sorted(set(saved) | set(model))
            if k not in (*EXECUTION_KEYS, *also) and saved.get(k) != model.get(k)]
    return ", ".join(f"model.{k}={saved.get(k)!r} there, {model.get(k)!r} here" for k in diff[:4])


def check_same_model(ckpt: dict, model: dict, path: Union[str, Path]) -> None:
    """Refuse resuming a checkpoint with another architecture than the config's (one line naming the keys)."""
    shown = model_differences(model_config(ckpt, path).to_dict(), model)
    if shown:
        raise UserError(f"{path} was trained with another model ({shown}); resume with the same model config, "
                        f"or start a new run (ckpt_path=null, or a new paths.output_dir)")


VOCAB_WEIGHTS = ("tok_emb.weight", "lm_head.weight")  # the weights with a row per vocabulary id


# the data keys that choose a run's vocabulary: its tokenizer (a file, a hub id, or `bpe`, trained on the corpus's
# training split, so then also the keys that choose that text)
TOKENIZER_KEYS = ("tokenizer", "eos_token", "prepared_dir")
BPE_KEYS = ("vocab_size", "corpus", "files", "archive", "hub_path", "hub_name", "hub_split", "text_field",
            "group_field", "val_fraction", "encoding_errors")


def vocabulary_differences(saved: object, data: object) -> str:
    """The data keys choosing the vocabulary that differ between a checkpoint's data settings (Lightning's
    `datamodule_hyper_parameters`) and this run's (`data`), as 'data.KEY=A there, B here'; '' when they agree or
    either side has no tokenizer (the synthetic tasks, an older checkpoint): the weights' shapes are checked then."""
    if not isinstance(saved, dict) or not isinstance(data, dict) or "tokenizer" not in saved or \
            "tokenizer" not in data:
        return ""
    keys = TOKENIZER_KEYS + (BPE_KEYS if data["tokenizer"] == "bpe" and not data.get("prepared_dir") else ())
    return ", ".join(f"data.{k}={saved.get(k)!r} there, {data.get(k)!r} here" for k in keys
                     if not same_setting(saved.get(k), data.get(k)))


def same_setting(a: object, b: object) -> bool:
    """Two values of a data key alike: equal, or the same file named two ways (runs/x/tokenizer.json and its
    absolute path: an imported model's tokenizer, named relative to where a retrofit runs)."""
    if a == b:
        return True
    if isinstance(a, str) and isinstance(b, str) and Path(a).expanduser().exists() and Path(b).expanduser().exists():
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return False


@dataclass
class WarmStart:
    """What `init_from=` starts a run from: the checkpoint, what this run's model config adds to its architecture (a
    retrofit: sinklab.model.retrofit) and the parameters its model has that the checkpoint's lacks (sorted names)."""

    ckpt: dict
    additions: list = field(default_factory=list)
    new_params: list[str] = field(default_factory=list)


def warm_start_checkpoint(path: Union[str, Path], model: dict, data: object = None) -> WarmStart:
    """`init_from=PATH` (a .ckpt or a run dir): its checkpoint, read before any data or model is built, refused in one
    line when it is not a sinklab checkpoint, its model differs from `model` (this run's config) in anything but
    the components this config adds to it (a retrofit: `sinklab.model.retrofit.plan`), the vocabulary (which may
    grow: `copy_weights`) and the execution keys, or its vocabulary comes from another tokenizer than this run's data
    settings `data` choose (`vocabulary_differences`). A retrofit's new parameters are named from the model built on
    the meta device (no memory, no compute)."""
    from sinklab.model.retrofit import plan

    try:
        ckpt = read_checkpoint(path, mmap=True)
        saved = model_config(ckpt, path)
    except UserError as err:
        raise UserError(f"init_from={path}: {err}") from None
    cfg = ModelConfig.from_dict(dict(model))
    additions, other = plan(saved, cfg, ignore=(*EXECUTION_KEYS, "vocab_size"))
    if other:
        shown = ", ".join(f"model.{k}={getattr(saved, k)!r} there, {getattr(cfg, k)!r} here" for k in other[:4])
        raise UserError(f"init_from={path}: its model differs from this run's ({shown}); a warm start copies the "
                        "weights into the same architecture, to which it may add components (a retrofit: "
                        "docs/extending.md#retrofit-init_from-with-an-added-component); the vocabulary may grow")
    shown = vocabulary_differences(ckpt.get("datamodule_hyper_parameters"), data)
    if shown:
        raise UserError(f"init_from={path}: its vocabulary comes from another tokenizer ({shown}); a warm start "
                        "needs the same tokenizer, with ids only added here")
    new = []
    if additions:
        with torch.device("meta"):
            built = Transformer(ModelConfig.from_dict({**cfg.to_dict(), "vocab_size": saved.vocab_size}))
        copied = set(saved_weights(ckpt))
        new = sorted(name for name, _ in built.named_parameters() if name not in copied)
    return WarmStart(ckpt, additions, new)


def saved_weights(ckpt: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors by their name in the (uncompiled) model; non-tensor entries (an op's extra state,
    e.g. DSA's step) are left out."""
    return {k[len("model."):].replace("_orig_mod.", ""): v for k, v in ckpt["state_dict"].items()
            if k.startswith("model.") and isinstance(v, torch.Tensor)}


def copy_weights(model: Transformer, warm: WarmStart, path: Union[str, Path]) -> list[str]:
    """A warm start: every weight of the checkpoint's model copied into `model` (built from this run's config); the
    vocabulary weights (VOCAB_WEIGHTS) of a larger vocabulary here (a data module that adds ids, e.g. the retrieval
    markers) get the checkpoint's rows for its ids and keep their fresh initialisation for the new ones. In a retrofit
    (`warm.additions`) the model has weights of its own besides, which start as their components say
    (`sinklab.model.retrofit.init_added`). Returns the names of the weights that grew. A vocabulary smaller here, or a
    weight of the checkpoint this model lacks, is refused in one line."""
    from sinklab.model.retrofit import init_added

    saved = saved_weights(warm.ckpt)
    own = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    odd = sorted(set(saved) - set(own)) + ([] if warm.additions else sorted(set(own) - set(saved)))
    if odd:
        raise UserError(f"init_from={path}: its weights do not match this model's (e.g. {', '.join(odd[:3])})")
    grown = []
    with torch.no_grad():
        for name, value in saved.items():
            target = own[name]
            if value.shape == target.shape:
                target.copy_(value)
            elif name in VOCAB_WEIGHTS and value.shape[1:] == target.shape[1:] and value.shape[0] < target.shape[0]:
                target[:value.shape[0]].copy_(value)
                grown.append(name)
            elif name in VOCAB_WEIGHTS:
                raise UserError(f"init_from={path}: {name} has shape {tuple(value.shape)} there, "
                                f"{tuple(target.shape)} here (a vocabulary of {value.shape[0]} ids there); a warm "
                                "start needs the same tokenizer, with ids only added here")
            else:
                raise UserError(f"init_from={path}: {name} has shape {tuple(value.shape)} there, "
                                f"{tuple(target.shape)} here; a warm start copies each weight into one of its shape")
    if warm.additions:
        init_added(model, set(saved))
    return grown


def model_config(ckpt: dict, path: Union[str, Path]) -> ModelConfig:
    """A checkpoint's model config, built from the components registered by sinklab and by the plugins the user
    named (entry points, SINKLAB_PLUGINS, plugins=: `sinklab.plugins`). The plugin modules the checkpoint lists are
    never imported: a file must not choose the code that runs. When its model needs one of them that is not loaded
    (a component or knob unknown here), it is refused in one line naming the modules and how to load them; when its
    model builds without them (e.g. a plugin of metrics only), a note says so once."""
    load_plugins()
    model = dict(ckpt["hyper_parameters"]["model"])
    absent = tuple(str(m) for m in ckpt.get(PLUGINS) or () if str(m) not in sys.modules)
    if absent:
        needs = plugin_needs(model)
        names = ", ".join(absent)
        if needs:
            raise UserError(f"{path} needs plugin module(s) that are not loaded: {names} ({needs}); a checkpoint "
                            f"never chooses the code that runs, so load them yourself: {ENV}={','.join(absent)} "
                            f"sinklab ..., or install the package that declares them in the entry-point group "
                            f"sinklab.plugins")
        if absent not in _NOTED:
            _NOTED.add(absent)
            log.warning("note: %s was written with plugin module(s) %s, not loaded here (its model does not need "
                        "them; a metric they register is not measured): %s=%s loads them", path, names, ENV,
                        ",".join(absent))
    return ModelConfig.from_dict(model)


def plugin_needs(model: dict) -> str:
    """What a checkpoint's model config needs that the registered components do not provide, '' when it builds:
    the error of building it (e.g. an attn_op not registered) and its unknown keys (knobs of such components)."""
    from dataclasses import fields

    unknown = sorted(set(model) - {f.name for f in fields(ModelConfig)} - {"_target_"})
    needs = [f"model key(s) {', '.join('model.' + k for k in unknown)} unknown here"] if unknown else []
    try:
        ModelConfig.from_dict({k: v for k, v in model.items() if k not in unknown})
    except UserError as err:
        needs.insert(0, str(err).split(";")[0])
    return ", ".join(needs)


def load_model(path: Union[str, Path]) -> Transformer:
    ckpt = read_checkpoint(path)
    cfg = model_config(ckpt, path)
    model = Transformer(cfg)
    prefix = "model."
    state = {}
    for k, v in ckpt["state_dict"].items():
        if k.startswith(prefix):
            k = k[len(prefix):]
            state[k.replace("_orig_mod.", "")] = v
    model.load_state_dict(state)
    return model.eval()
