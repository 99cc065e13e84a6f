"""Where a `--hf-model` comes from: a local directory, or a Hugging Face hub id at a revision, through huggingface_hub.

`resolve_model(name_or_dir, revision)` gives the local directory transformers loads from (`sinklab.targets.transformers_lm.load_hf_model`):
- a directory that exists is used as it is (written by `save_pretrained`; `--revision` does not apply to it);
- anything else must be a hub id (`EleutherAI/pythia-160m`, `gpt2`): `huggingface_hub.snapshot_download` fetches
  the config, the weights (safetensors when the revision has them, else the PyTorch .bin files) and the tokenizer
  files of `revision` (a branch, a tag or a commit; default `main`) into huggingface_hub's cache and returns the
  snapshot folder. With `HF_HUB_OFFLINE=1` nothing is fetched: the cache is read (a branch or tag through
  `refs/<name>`, a commit through `snapshots/<commit>`), and a model that is not there is one line naming the id,
  the revision and the command that fetches it (`hf download ID --revision R`, the CLI of huggingface_hub 2.x).

The cache is huggingface_hub's (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub); nothing here keeps its own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from sinklab.errors import UserError

DTYPES = ("auto", "float32", "bfloat16", "float16")
# the files a causal LM needs: config, weights, tokenizer (sentencepiece / tiktoken / BPE vocabularies)
CONFIG_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken"]
WEIGHTS = {"safetensors": ["*.safetensors"], "bin": ["*.bin"]}


def fetch_hint(repo_id: str, revision: Optional[str]) -> str:
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def resolve_model(name_or_dir: Union[str, Path], revision: Optional[str] = None) -> Path:
    """The local directory of `name_or_dir` (a model dir, or a hub id at `revision`); see the module docstring."""
    p = Path(name_or_dir).expanduser()
    if p.is_dir():
        if revision is not None:
            raise UserError(f"--revision {revision}: --hf-model {name_or_dir} is a local directory; --revision picks "
                            "a branch, tag or commit of a hub id (e.g. EleutherAI/pythia-160m --revision step1000)")
        if not (p / "config.json").is_file():
            raise UserError(f"--hf-model {name_or_dir}: the directory has no config.json (pass a dir written by "
                            "save_pretrained, or a hub id)")
        return p
    return snapshot(str(name_or_dir), revision)


def snapshot(repo_id: str, revision: Optional[str]) -> Path:
    """huggingface_hub's snapshot folder of `repo_id` at `revision`: downloaded when online, read from the cache
    offline (HF_HUB_OFFLINE=1); every failure is one line."""
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:
        raise UserError("--hf-model with a hub id needs huggingface_hub, an optional extra: "
                        "pip install 'sinklab[hf]'") from None
    where = f"--hf-model {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        huggingface_hub.utils.validate_repo_id(repo_id)
    except errors.HFValidationError:
        raise UserError(f"--hf-model {repo_id}: no such directory, and not a hub id (ORG/NAME or NAME: letters, "
                        "digits, '-', '_', '.')") from None
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        patterns = CONFIG_FILES + (sum(WEIGHTS.values(), []) if offline else weight_patterns(repo_id, revision))
        path = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                                 cache_dir=constants.HF_HUB_CACHE)
    except errors.LocalEntryNotFoundError:
        state = "HF_HUB_OFFLINE=1" if offline else "the hub cannot be reached"
        raise UserError(f"{where}: not in the Hugging Face cache {constants.HF_HUB_CACHE} and {state}; fetch it "
                        f"with: {fetch_hint(repo_id, revision)}") from None
    except errors.GatedRepoError:
        raise UserError(f"{where}: a gated model; accept its licence on https://huggingface.co/{repo_id} and log in "
                        "(hf auth login), then run again") from None
    except errors.RevisionNotFoundError:
        raise UserError(f"--revision {revision}: no such branch, tag or commit of {repo_id} on the hub") from None
    except errors.RepositoryNotFoundError:
        raise UserError(f"--hf-model {repo_id}: no such directory, and no such model on the hub (or a private "
                        "one: log in with hf auth login)") from None
    except (errors.HfHubHTTPError, OSError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{where}: the download failed ({type(err).__name__}: {first}); fetch it with: "
                        f"{fetch_hint(repo_id, revision)}") from None
    if not (Path(path) / "config.json").is_file():
        raise UserError(f"{where}: its snapshot {path} has no config.json (not a transformers model?)")
    return Path(path)


def weight_patterns(repo_id: str, revision: Optional[str]) -> list[str]:
    """Online: the safetensors weights when the revision has them, else the .bin files (older revisions, e.g.
    Pythia's intermediate checkpoints), never both."""
    from huggingface_hub import HfApi

    files = [s.rfilename for s in HfApi().model_info(repo_id, revision=revision).siblings or []]
    return WEIGHTS["safetensors"] if any(f.endswith(".safetensors") for f in files) else WEIGHTS["bin"]


def pick_dtype(name: Union[str, "torch.dtype"], device) -> "torch.dtype":  # noqa: F821
    """--dtype NAME -> a torch dtype; `auto` is bfloat16 on CUDA and float32 elsewhere."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"--dtype {name}: allowed: {', '.join(DTYPES)}")
    return getattr(torch, name)
