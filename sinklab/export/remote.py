"""sinklab export-hf of a config LLaMA cannot represent: a transformers directory with remote code.

The export holds config.json (a `SinklabConfig`: sinklab's model config as a dict, the sinklab version, the plugin
modules it needs, the modules' non-tensor state (DSA's step), and `auto_map` naming the two files below for AutoConfig and AutoModelForCausalLM),
configuration_sinklab.py and modeling_sinklab.py (copies of `sinklab.export.configuration_sinklab` and
`sinklab.export.modeling_sinklab`, written by transformers' `save_pretrained` for classes registered for the auto
classes), model.safetensors (the checkpoint's weights under sinklab's names, `model.` first), the tokenizer as the
LLaMA export writes it, and a README.md saying how to load it:

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

The modeling file runs sinklab's own model (its docstring says why), so loading needs `pip install sinklab` (the
version is in config.json) and, for a plugin's component, that plugin's package: the modules the model's components
come from are named in config.json (`sinklab_plugins`, module -> the installed distribution that provides it) and
must be loaded by the user (the package's entry point, or SINKLAB_PLUGINS): the modeling file checks them but never
imports a module because a file names it. A component whose module cannot be imported by name (defined in a script or a
notebook: `__main__`) is refused in one line, since nothing could import it where the export is loaded.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Optional

import torch

import sinklab
from sinklab.errors import UserError
from sinklab.model import FAMILIES, ModelConfig
from sinklab.model.layer_pattern import layer_ops
from sinklab.model.registry import ATTENTION_OPS
from sinklab.plugins import is_plugin

CARD = """# {name}

A sinklab model ({what}) exported by `sinklab export-hf` as transformers remote code: LLaMA cannot represent
{why}.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)  # it reads config.json too
```

`trust_remote_code=True` runs modeling_sinklab.py from this directory, which builds sinklab's own model from
config.json's `sinklab_model`: it needs `pip install sinklab=={version}`{plugins}. `model.generate(...)` decodes
through sinklab's KV cache (a transformers `Cache`); `output_attentions=True` gives each layer's attention map over
the real tokens (learned sink tokens' and bias slots' columns left out: a row's mass on them is 1 - its sum);
`sinklab measure --hf-model {name} --input random` measures it as `sinklab measure RUN --input random` measures
the run.
"""


def plugin_modules(cfg: ModelConfig) -> dict[str, Optional[str]]:
    """The plugin modules whose components the config selects -> the distribution providing each ("pkg==1.0"), None
    for code on PYTHONPATH; one line for a component whose module cannot be imported by name."""
    classes = [registry.selected(cfg) for registry in FAMILIES]
    classes += [ATTENTION_OPS.get(op) for op in sorted(layer_ops(cfg))]  # a layer pattern's ops
    found: dict[str, Optional[str]] = {}
    for cls in classes:
        if not is_plugin(cls) or cls.__module__ in found:
            continue
        module = cls.__module__
        spec = importlib.util.find_spec(module) if module != "__main__" else None
        if spec is None:
            raise UserError(f"model.{cls.registry.key}={cls.name} cannot be exported: its component is defined in "
                            f"module {module!r}, which cannot be imported by name where the export is loaded; move "
                            f"it into a package (docs/extending.md, 'Add a component from your own package')")
        found[module] = distribution(module)
    return found


def distribution(module: str) -> Optional[str]:
    """'name==version' of the installed distribution providing `module`'s top-level package, None when none does
    (code on PYTHONPATH)."""
    top = module.split(".")[0]
    for name in importlib.metadata.packages_distributions().get(top) or [top]:  # no file list: a name alike
        try:
            return f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def write(state: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, torch_dtype: torch.dtype,
          eos_id: Optional[int], plugins: dict[str, Optional[str]], why: list[str]) -> None:
    """OUT_DIR as the module docstring says; `state`: sinklab's weights (no `model.` prefix)."""
    import transformers

    from sinklab.targets.hf_common import quiet

    from .configuration_sinklab import SinklabConfig
    from .modeling_sinklab import SinklabForCausalLM

    SinklabConfig.register_for_auto_class()  # save_pretrained then writes the files and config.json's auto_map
    SinklabForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    hf_cfg = SinklabConfig(sinklab_model=cfg.to_dict(), sinklab_version=sinklab.__version__,
                           sinklab_plugins=plugins, eos_token_id=eos_id, bos_token_id=None, pad_token_id=None,
                           sinklab_extra_state={k: v for k, v in state.items() if k.endswith("._extra_state")})
    hf_cfg.architectures = ["SinklabForCausalLM"]
    model = SinklabForCausalLM(hf_cfg)
    model.model.load_state_dict(state, strict=True)
    with quiet(transformers):
        model.to(torch_dtype).save_pretrained(str(out))
    needs = "".join(f" and `pip install {p}`" if p else f" and module {m} on PYTHONPATH" for m, p in plugins.items())
    what = ", ".join(f"{k}={v}" for k, v in describe(cfg).items())
    (out / "README.md").write_text(CARD.format(name=out.name, what=what, why="; ".join(why),
                                               version=sinklab.__version__, plugins=needs), encoding="utf-8")


def describe(cfg: ModelConfig) -> dict:
    """The model's size and every component away from LLaMA's, for the model card."""
    shown = {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "d_model": cfg.d_model}
    shown.update({r.key: getattr(cfg, r.key) for r in FAMILIES if getattr(cfg, r.key) != r.llama})
    return shown


def load(out: Path, transformers, dtype_kwargs):
    """The export loaded back with transformers (its remote code), fp32, in eval mode."""
    from sinklab.targets.hf_common import quiet

    with quiet(transformers):
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(out), trust_remote_code=True, local_files_only=True, **dtype_kwargs(transformers, torch.float32)).eval()
