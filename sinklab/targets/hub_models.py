"""Where a `--hf-model` comes from: a local directory, or a Hugging Face hub id at a revision, through huggingface_hub.

`resolve_model(name_or_dir, revision)` gives the local directory transformers loads from (`sinklab.targets.transformers_lm.load_hf_model`):
- a GGUF file (or a directory holding one .gguf and no config.json) is converted once into a transformers directory
  in the sinklab cache (`sinklab.targets.gguf`);
- a directory that exists is used as it is (written by `save_pretrained`); with `revision`, it must be a git
  repository holding that branch, tag or commit (`sinklab export-hf RUN OUT --revisions` writes one: a branch
  `step<N>` per kept checkpoint, as Pythia names its hub revisions), whose files at that revision are written once
  per process (`git archive`) into a temporary directory, removed when the process exits (`local_revision`);
- anything else must be a hub id (`EleutherAI/pythia-160m`, `gpt2`): `huggingface_hub.snapshot_download` fetches
  the config, the weights (safetensors when the revision has them, else the PyTorch .bin files) and the tokenizer
  files of `revision` (a branch, a tag or a commit; default `main`) into huggingface_hub's cache and returns the
  snapshot folder. With `HF_HUB_OFFLINE=1` nothing is fetched: the cache is read (a branch or tag through
  `refs/<name>`, a commit through `snapshots/<commit>`), and a model that is not there is one line naming the id,
  the revision and the command that fetches it (`hf download ID --revision R`, the CLI of huggingface_hub 2.x).

The cache is huggingface_hub's (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub); nothing here keeps its own.

`recorded_progress(name_or_dir, revision)` reads the training step and tokens seen that an export records in
trainer_state.json (`global_step`, `num_input_tokens_seen`: the names of transformers' Trainer), for `sinklab
trajectory`, whose revision names (`step120`) give the step only.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Union

from sinklab import __version__
from sinklab.errors import UserError

DTYPES = ("auto", "float32", "bfloat16", "float16")
# the files a causal LM needs: config, weights, tokenizer (sentencepiece / tiktoken / BPE vocabularies)
CONFIG_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken"]
WEIGHTS = {"safetensors": ["*.safetensors"], "bin": ["*.bin"]}
PROGRESS_FILE = "trainer_state.json"  # an export's training step and tokens seen, under the Trainer's names
# git's environment variables that would point its commands at another repository, index or work tree
GIT_REDIRECTS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR")


def fetch_hint(repo_id: str, revision: Optional[str]) -> str:
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def resolve_model(name_or_dir: Union[str, Path], revision: Optional[str] = None) -> Path:
    """The local directory of `name_or_dir` (a model dir, or a hub id at `revision`); see the module docstring."""
    from .gguf import converted, gguf_file

    p = Path(name_or_dir).expanduser()
    gguf = gguf_file(p, str(name_or_dir))
    if gguf is not None:
        return converted(gguf, str(name_or_dir), revision)
    if p.is_dir():
        if revision is not None:
            p = local_revision(p, revision, str(name_or_dir))
        if not (p / "config.json").is_file():
            raise UserError(f"--hf-model {name_or_dir}: the directory has no config.json (pass a dir written by "
                            "save_pretrained, or a hub id)")
        return p
    return snapshot(str(name_or_dir), revision)


# ------------------------------------------------------------------------------------ local git repositories
def git(repo: Path, *args: str, flag: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """`git -C repo ARGS` (output captured as bytes), with git's redirecting environment variables removed;
    git missing from PATH is one line naming `flag`, the option that needs it; with `check`, a failure is one line
    with git's first line of error."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    proc = subprocess.run(git_command(repo, *args, flag=flag), stderr=subprocess.PIPE, env=git_env(), **kwargs)
    if check and proc.returncode != 0:
        first = (proc.stderr.decode(errors="replace").strip().splitlines() or [""])[0][:200]
        command = next((a for a in args if not a.startswith("-") and "=" not in a), "")  # past the -c settings
        raise UserError(f"{flag}: git {command} failed in {repo} ({first})")
    return proc


def git_command(repo: Path, *args: str, flag: str) -> list[str]:
    """The argv of `git -C repo ARGS`; one line naming `flag` where git is not on PATH."""
    exe = shutil.which("git")
    if exe is None:
        raise UserError(f"{flag}: needs git on PATH (a repository of revisions is a git repository); install git")
    return [exe, "-C", str(repo), *args]


def git_env() -> dict[str, str]:
    """This process's environment less git's variables that would point git at another repository."""
    return {k: v for k, v in os.environ.items() if k not in GIT_REDIRECTS}


def is_git_repo(p: Path) -> bool:
    """Whether `p` is the top of a git work tree (not a directory somewhere inside one)."""
    return (p / ".git").exists()


def branches(repo: Path, flag: str) -> list[str]:
    """The branches of `repo`, `main` first, then by the numbers in their names (step16 before step120)."""
    out = git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads", flag=flag).stdout.decode()
    return sorted(out.split(), key=lambda b: (b != "main", [(0, int(t), "") if t.isdigit() else (1, 0, t)
                                                            for t in re.split(r"(\d+)", b)]))


def revision_commit(repo: Path, revision: str, name: str) -> str:
    """The commit of `revision` (a branch, tag or commit) in the local repository `repo`; one line naming the
    branches where it has none, or where `repo` is not a git repository."""
    flag = f"--revision {revision}"
    if not is_git_repo(repo):
        raise UserError(f"{flag}: --hf-model {name} is a local directory, not a git repository; --revision picks a "
                        "branch, tag or commit of a hub id (e.g. EleutherAI/pythia-160m --revision step1000) or of a "
                        "local repository of revisions (sinklab export-hf RUN DIR --revisions)")
    proc = git(repo, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}", flag=flag, check=False)
    if proc.returncode != 0:
        raise UserError(f"{flag}: no such branch, tag or commit of --hf-model {name}; its branches: "
                        f"{', '.join(branches(repo, flag)) or 'none'}")
    return proc.stdout.decode().strip()


_CHECKOUTS: dict[tuple[str, str], Path] = {}  # (repository, commit) -> its files, written in this process
_CHECKOUT_ROOT: list[Path] = []  # the temporary directory holding them, removed when the process exits


def local_revision(repo: Path, revision: str, name: str) -> Path:
    """The files of `revision` of the local git repository `repo`, written by `git archive` once per process into a
    temporary directory (removed at exit): what transformers loads, as huggingface_hub's snapshot of a hub
    revision. The directory is named after the repository and the commit, so that two revisions' remote code are
    two modules for transformers."""
    import atexit
    import tarfile
    import tempfile

    commit = revision_commit(repo, revision, name)
    key = (str(repo.resolve()), commit)
    if key in _CHECKOUTS:
        return _CHECKOUTS[key]
    if not _CHECKOUT_ROOT:
        _CHECKOUT_ROOT.append(Path(tempfile.mkdtemp(prefix="sinklab-revisions-")))
        atexit.register(shutil.rmtree, _CHECKOUT_ROOT[0], True)
    dest = _CHECKOUT_ROOT[0] / f"{repo.resolve().name}-{commit[:12]}"
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    argv = git_command(repo, "archive", "--format=tar", commit, flag=f"--revision {revision}")
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=git_env()) as proc:
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:  # streamed: weights are not held in memory
                tar.extractall(partial, filter="data")
        except (tarfile.TarError, OSError) as err:
            proc.kill()
            raise UserError(f"--revision {revision}: reading it from --hf-model {name} failed ({err})") from None
    if proc.returncode != 0:
        raise UserError(f"--revision {revision}: git archive of --hf-model {name} failed (exit {proc.returncode})")
    partial.rename(dest)
    _CHECKOUTS[key] = dest
    return dest


def recorded_progress(name_or_dir: Union[str, Path], revision: Optional[str] = None) -> tuple[Optional[int],
                                                                                             Optional[int]]:
    """(training step, tokens seen) recorded in a local model dir's trainer_state.json, at `revision` of a local git
    repository (read with `git show`, which checks the revision first: one line for an unknown one); (None, None)
    where nothing is recorded, and for a hub id (nothing is downloaded to learn it). Tokens seen of 0 after step 0
    is the Trainer's "not counted"."""
    p = Path(name_or_dir).expanduser()
    if not p.is_dir():
        return None, None
    if revision is None:
        text = (p / PROGRESS_FILE).read_bytes() if (p / PROGRESS_FILE).is_file() else None
    else:
        commit = revision_commit(p, revision, str(name_or_dir))
        proc = git(p, "show", f"{commit}:{PROGRESS_FILE}", flag=f"--revision {revision}", check=False)
        text = proc.stdout if proc.returncode == 0 else None
    try:
        state = json.loads(text) if text else {}
    except ValueError:
        return None, None
    if not isinstance(state, dict):
        return None, None
    step, tokens = state.get("global_step"), state.get("num_input_tokens_seen")
    step = step if isinstance(step, int) and step >= 0 else None
    tokens = tokens if isinstance(tokens, int) and (tokens > 0 or step == 0) else None
    return step, tokens


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
                                                 cache_dir=constants.HF_HUB_CACHE, local_files_only=offline)
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


# the files an export's auto_map names (sinklab/export/: configuration and modeling of `SinklabForCausalLM`), and
# the auto_map itself: exactly these two classes
REMOTE_CODE = ("configuration_sinklab.py", "modeling_sinklab.py")
AUTO_MAP = {"AutoConfig": "configuration_sinklab.SinklabConfig",
            "AutoModelForCausalLM": "modeling_sinklab.SinklabForCausalLM"}
# files besides config.json where transformers also follows an `auto_map` (tokenizer, processors)
OTHER_AUTO_MAPS = ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                   "feature_extractor_config.json", "image_processor_config.json", "video_preprocessor_config.json")


def trusted(path: Path, where: str) -> bool:
    """Whether transformers may run the remote code of the model dir `path`: only an export of this sinklab, whose
    configuration_sinklab.py and modeling_sinklab.py are byte for byte the installed sinklab's own (so the code that
    runs is code already installed here), whose config.json's `auto_map` is exactly sinklab's two classes, with no
    other Python file in the dir and no `auto_map` in its tokenizer or processor files (transformers would import
    what those name). An export that fails any of these is refused in one line saying what differs and what to do;
    any other model is not trusted (transformers refuses remote code it was not allowed)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or config.get("model_type") != "sinklab" or "auto_map" not in config:
        return False
    fix = ("export the run again with this sinklab (sinklab export-hf), or load it yourself with "
           "trust_remote_code=True if you trust its author")
    if config["auto_map"] != AUTO_MAP:
        raise UserError(f"{where}: config.json's auto_map {json.dumps(config['auto_map'])} is not sinklab's "
                        f"{json.dumps(AUTO_MAP)}; {fix}")
    others = sorted(str(p.relative_to(path)) for p in path.rglob("*.py") if p.name not in REMOTE_CODE or
                    p.parent != path)
    if others:
        raise UserError(f"{where}: holds Python files besides sinklab's {' and '.join(REMOTE_CODE)} "
                        f"({', '.join(others[:5])}); {fix}")
    for name in OTHER_AUTO_MAPS:
        try:
            other = json.loads((path / name).read_text(encoding="utf-8")) if (path / name).is_file() else {}
        except (OSError, ValueError):
            other = {}
        if isinstance(other, dict) and "auto_map" in other:
            raise UserError(f"{where}: {name} has an auto_map, which would run code of its own; {fix}")
    here = Path(__file__).parents[1] / "export"  # the installed sinklab's own files (not imported here)
    if all((path / name).is_file() and (path / name).read_bytes() == (here / name).read_bytes() for name in REMOTE_CODE):
        return True
    raise UserError(f"{where}: its remote code ({', '.join(REMOTE_CODE)}) is not this sinklab's {__version__} (the "
                    f"export was written by sinklab {config.get('sinklab_version')}); {fix}")
