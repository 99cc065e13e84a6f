"""A GGUF file (llama.cpp's format) as an `--hf-model` source: `--hf-model path/to/model.gguf`, or a directory that
holds one .gguf and no config.json. `hub_models.resolve_model` hands it here, so every `--hf-model` command (and
`load_hf_model`, `load_hf_tokenizer`) reads it.

transformers reads GGUF itself (`from_pretrained(dir, gguf_file=NAME)`, which needs the `gguf` and `accelerate`
packages: the `gguf` extra) and dequantizes every tensor; any architecture its reader knows loads (LLaMA, Mistral,
Qwen2/3, Phi-3, Gemma2/3, GPT-2, ...; a file of another is one line with transformers' reason). Reading a file is slow
(SmolLM2-135M's 98 MB: ~22 s for the model, ~5 s more for each tokenizer load, on 2 cores: its metadata, the
tokenizer's 49k tokens and merges, is parsed in pure Python on every read), so it is read once and converted into a
transformers directory in the sinklab cache, `$SINKLAB_CACHE/gguf/<file stem>-<key>/` (config.json, model.safetensors
with the weights dequantized to float32, the tokenizer), which every later command loads in under a second at the
`--dtype` it asks for (float32 holds every dequantized value exactly, so a cast from it equals dequantizing to that
dtype). The key hashes the file's name, size and mtime and the transformers version (whose reader made the
conversion): a changed file, or another transformers, converts again. A conversion is written into
`<dir>.partial-<pid>` and renamed to `<dir>` when complete, so a killed one never leaves a directory that is read
later (its .partial is removed by the next conversion once its process is gone).

The converted config.json records `sinklab_gguf`: the file, its architecture, its quantization (general.file_type, else
the type of most parameters) and each tensor type's share of the parameters, from which `weights_note` writes the line
every command prints beside the model ("4-bit Q4_1 weights from X.gguf, dequantized to float32; ..."): numbers measured
on dequantized weights approximate the original model's. Remote code never runs for a GGUF (trust_remote_code=False:
its config is one of transformers' own architectures).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from sinklab.errors import UserError

INSTALL_HINT = "--hf-model {name} needs the gguf extra: pip install 'sinklab[gguf]'"
# the gguf extra's transformers minimum (pyproject.toml): 5.5, the hf extra's, reads a LLaMA-architecture GGUF with a
# BPE tokenizer (SmolLM2's layout) into a tokenizer that fails on every text ("Unk token `None` not found"); 5.24 is
# the release the GGUF tests pass on (.ci/run: the newest)
MIN_TRANSFORMERS = "5.24"  # the gguf extra's pin (tests/targets/test_targets.py checks that they agree)
RECORD = "sinklab_gguf"  # the key of config.json that records where the converted weights came from
CONVERSION = 1  # the layout of a converted directory; a new one converts again
log = logging.getLogger(__name__)


def gguf_file(p: Path, name: str) -> Optional[Path]:
    """The GGUF file `--hf-model name` names: the file itself (*.gguf), or the one .gguf of a directory without
    config.json; None for anything else (a transformers dir, a hub id). A directory holding several is one line
    listing them."""
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        raise UserError(f"--hf-model {name}: the directory holds {len(found)} GGUF files; pass one: "
                        + ", ".join(f.name for f in found[:6]) + (" ..." if len(found) > 6 else ""))
    return found[0] if found else None


def converted(file: Path, name: str, revision: Optional[str]) -> Path:
    """The transformers directory of the GGUF `file` (`--hf-model name`) in the sinklab cache, converted now if it is
    not there (module docstring)."""
    from sinklab.data.fsutil import resolve_cache_dir

    if revision is not None:
        raise UserError(f"--revision {revision}: --hf-model {name} is a GGUF file, which has no revisions; --revision "
                        "picks a branch, tag or commit of a hub id or of a local git repository")
    dest = resolve_cache_dir() / "gguf" / f"{file.stem}-{cache_key(file)}"
    if (dest / "config.json").is_file():
        return dest
    require(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(dest)
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    log.info("converting %s into %s (once)", file, dest)
    try:
        convert(file, partial, name)
        try:
            partial.rename(dest)
        except OSError:  # another process renamed its complete conversion first: use it
            if not (dest / "config.json").is_file():
                raise
    except OSError as err:
        raise UserError(f"--hf-model {name}: cannot write its conversion into {dest.parent} "
                        f"({err.strerror or err}); set SINKLAB_CACHE to a writable directory") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def cache_key(file: Path) -> str:
    """16 hex digits of (name, size, mtime, transformers version, CONVERSION): what makes a conversion current."""
    from .hf_common import require_transformers

    transformers = require_transformers()
    st = file.stat()
    text = f"{file.name}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}\0{CONVERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def require(name: str) -> None:
    """gguf and accelerate importable (transformers' GGUF reader needs both) and transformers at least the gguf
    extra's minimum (MIN_TRANSFORMERS), or one line saying what to install."""
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError:
        raise UserError(INSTALL_HINT.format(name=name)) from None
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise UserError(f"--hf-model {name}: GGUF files need transformers >= {MIN_TRANSFORMERS}, this is "
                        f"{transformers.__version__}; pip install 'sinklab[gguf]'")


def remove_stale_partials(dest: Path) -> None:
    """The .partial directories of `dest` whose conversion's process is gone (killed): removed."""
    for p in dest.parent.glob(f"{dest.name}.partial-*"):
        pid = p.name.rpartition("-")[2]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def convert(file: Path, out: Path, name: str) -> None:
    """The GGUF `file` read by transformers (dequantized to float32) and written to `out` with save_pretrained: a
    fresh model of the same config without its quantization flag (a GGUF-loaded model refuses save_pretrained) takes
    the loaded tensors (no copy), with the tokenizer the file describes; config.json records `sinklab_gguf`."""
    import torch

    from .hf_common import dtype_kwargs, quiet, require_transformers

    transformers = require_transformers()
    record = read_record(file, name)
    # transformers' own bar of the dequantization (a plain tqdm, which its logging settings leave on) is not shown
    with quiet(transformers), open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(file.parent), gguf_file=file.name, local_files_only=True, trust_remote_code=False,
                **dtype_kwargs(transformers, torch.float32))
        except Exception as err:  # an architecture or a tensor type transformers' reader does not know, ...
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise UserError(f"--hf-model {name}: transformers {transformers.__version__} cannot read this GGUF as a "
                            f"causal LM ({type(err).__name__}: {first})") from None
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        setattr(config, RECORD, record)
        with torch.device("meta"):  # no second copy of the weights: the fresh model takes the loaded tensors
            fresh = transformers.AutoModelForCausalLM.from_config(config, **dtype_kwargs(transformers, torch.float32))
        fresh.load_state_dict(model.state_dict(), assign=True, strict=True)
        fresh.tie_weights()
        fresh.save_pretrained(str(out))
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name,
                                                                   local_files_only=True, trust_remote_code=False)
        except Exception:  # no tokenizer transformers can build from the file: natural input says so in one line
            return
        tokenizer.save_pretrained(str(out))


def read_record(file: Path, name: str) -> dict:
    """What the file says about its weights: {file, architecture, quantization, tensor_types {type: share of the
    parameters}}; one line for a file that is not GGUF."""
    from gguf import GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(str(file))
    except Exception as err:  # not a GGUF file (bad magic), truncated, ...
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise UserError(f"--hf-model {name}: not a readable GGUF file ({type(err).__name__}: {first})") from None
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    total = sum(counts.values()) or 1
    shares = {k: round(v / total, 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
    quant = next(iter(shares), "unknown")
    field = reader.fields.get("general.file_type")
    if field is not None:
        try:
            kind = LlamaFileType(int(field.parts[field.data[0]][0])).name
            quant = kind.removeprefix("MOSTLY_").removeprefix("ALL_") if kind != "GUESSED" else quant
        except ValueError:  # a file type this gguf package does not know: the parameters' majority type
            pass
    arch = reader.fields.get("general.architecture")
    architecture = bytes(arch.parts[arch.data[0]]).decode(errors="replace") if arch is not None else None
    return {"file": str(file.resolve()), "architecture": architecture, "quantization": quant, "tensor_types": shares}


def weights_note(model) -> Optional[str]:
    """'4-bit Q4_1 weights from X.gguf, dequantized to float32' (then each tensor type's share of the parameters, of
    those of 1% or more, where there are several) for a model converted from a GGUF file; None for any other."""
    record = getattr(model.config, RECORD, None)
    if not isinstance(record, dict):
        return None
    quant = str(record.get("quantization"))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    bits = re.match(r"I?Q(\d)", quant)
    shares = {k: v for k, v in (record.get("tensor_types") or {}).items() if v >= 0.01}
    mix = f"; {', '.join(f'{k} {v:.0%}' for k, v in shares.items())} of the parameters" if len(shares) > 1 else ""
    return (f"{bits.group(1) + '-bit ' if bits else ''}{quant} weights from {Path(str(record.get('file'))).name}, "
            f"{'dequantized' if bits else 'converted'} to {dtype}{mix}")
