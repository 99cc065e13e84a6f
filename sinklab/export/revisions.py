"""sinklab export-hf RUN OUT --revisions: a run's kept checkpoints as the revisions of one local repository, named as
Pythia names its hub revisions.

A Hugging Face hub revision is a git branch (or tag, or commit), and Pythia publishes its training checkpoints as
branches `step<N>`. OUT is made a git repository (git on PATH) holding one commit per checkpoint that `sinklab
trajectory RUN` measures (the kept ones, checkpoints/kept/step<S>-tokens<N>.ckpt, and last.ckpt where no kept one has
its step), in step order, each the full export of that checkpoint as `sinklab.export.llama.export` writes it
(config.json, model.safetensors, the tokenizer, the remote code where LLaMA cannot represent the model), plus:

- trainer_state.json: the checkpoint's `global_step` and `num_input_tokens_seen` (transformers' Trainer's names),
  from which `sinklab trajectory` places a revision named by its step only;
- README.md: a model card (the remote-code export's, or a short one) with a section naming this revision and all.

Branch `step<S>` points at each checkpoint's commit and `main` at the newest (last.ckpt's, unless a kept checkpoint is
newer), whose files are OUT's work tree. Commits are made with plain git, as sinklab (`-c user.name=... -c
user.email=...` on the command, so no git identity needs to be configured) and without LFS: the weights are ordinary
git objects. `sinklab trajectory --hf-model OUT --revision step16 step29 ...` reads the branches
(`sinklab.targets.hub_models.local_revision`). Pushing the repository to the hub takes one upload per branch
(`huggingface_hub.HfApi().upload_folder(..., revision=BRANCH)` of a checkout of it) or git with git-lfs tracking
*.safetensors (the hub refuses large files in plain git); local use needs neither.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from sinklab.errors import UserError
from sinklab.runs.checkpoints import KEPT_DIR
from sinklab.runs.run_data import is_run_dir
from sinklab.targets.hub_models import PROGRESS_FILE, git

from .llama import export, new_out_dir, tokenizer_file

FLAG = "--revisions"
# who commits: set on each command, so that a machine without a git identity (CI) commits too; no signing, no hooks
COMMITTER = ("-c", "user.name=sinklab", "-c", "user.email=sinklab@localhost", "-c", "commit.gpgsign=false",
             "-c", "core.autocrlf=false", "-c", "core.hooksPath=/dev/null")
CARD = """# {name}

A sinklab model exported by `sinklab export-hf` as `LlamaForCausalLM`:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")
```
"""
REVISIONS = """
## Revisions

This repository holds {n} checkpoints of the sinklab run `{run}` as git branches named by training step, as Pythia
names its revisions: {branches}; `main` is the newest. This revision is {this}.
Its trainer_state.json has the step and the training tokens seen. Read revisions with
`sinklab trajectory --hf-model {name} --revision {first} {last} --input random`, or check one out
(`git worktree add ../{first} {first}`); once on the hub, `from_pretrained("ORG/{name}", revision="{first}")`.
"""


def export_revisions(run: str, out_dir: str, log=print, **options) -> dict:
    """Write OUT_DIR as the module docstring says; `options` are `export`'s (dtype, check, tokenizer,
    with_tokenizer). Returns {"out_dir", "architecture", "branches", "revisions": [{branch, checkpoint, step,
    tokens, max_abs_diff}]}. On an error OUT_DIR is removed again (or emptied, when it was an empty directory)."""
    from sinklab.analysis.trajectories import run_series

    if not is_run_dir(Path(run)):
        raise UserError(f"CKPT {run}: {FLAG} exports a run's kept checkpoints; pass a training run dir (with "
                        ".hydra/config.yaml), not a checkpoint file")
    out = new_out_dir(out_dir)
    if options.get("tokenizer") is not None:
        tokenizer_file(options["tokenizer"])  # before a checkpoint is read
    git(Path.cwd(), "--version", flag=FLAG)  # git on PATH, before anything is read or written
    points = run_series(run).points
    run_dir = Path(run)
    if not any(Path(p.name).parent.name == KEPT_DIR for p in points):
        log(f"{FLAG}: {run} has no kept checkpoints (callbacks.checkpoint.keep); only last.ckpt is exported: main"
            + (f" and its branch step{points[0].step}" if points[0].step is not None else ""))
    branches = [f"step{p.step}" for p in points if p.step is not None]
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _write(run_dir, out, points, branches, log, options)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            _clear_work_tree(out, keep_git=False)
        raise


def _write(run_dir: Path, out: Path, points, branches: list[str], log, options: dict) -> dict:
    git(out, "init", "-q", flag=FLAG)
    git(out, "symbolic-ref", "HEAD", "refs/heads/main", flag=FLAG)  # main, whatever init.defaultBranch says
    revisions, architecture = [], None
    with tempfile.TemporaryDirectory(prefix="sinklab-export-", dir=out / ".git") as tmp:  # beside, outside the tree
        for i, point in enumerate(points):
            stage = Path(tmp) / str(i) / out.name  # the export's own name: its model card names it
            branch = f"step{point.step}" if point.step is not None else None
            first_lines = (lambda line: log(line.replace(str(stage), str(out)))) if i == 0 else (lambda line: None)
            res = export(point.name, str(stage), log=first_lines, **options)
            architecture = res["architecture"]
            if i == 0 and res["tokenizer"] is not None:  # found once (a data module may have to be built for it)
                options = {**options, "tokenizer": str(shutil.copy(stage / "tokenizer.json", Path(tmp)))}
            where = _relative(point.name, run_dir)
            _describe(stage, point, where, out.name, run_dir, branches)
            _clear_work_tree(out, keep_git=True)
            for f in stage.iterdir():
                f.rename(out / f.name)
            git(out, *COMMITTER, "add", "-A", flag=FLAG)
            tokens = f", {point.tokens:,} tokens seen" if point.tokens is not None else ""
            git(out, *COMMITTER, "commit", "-q", "--allow-empty", "--no-verify", "-m",
                f"{branch or 'main'}: export of {where}{tokens}", flag=FLAG)
            if branch is not None:
                git(out, "branch", "-f", branch, flag=FLAG)
            diff = res["max_abs_diff"]
            log(f"{branch or 'main'}: {where}{tokens}"
                + (f"; check: max |logit difference| {diff:.3g}" if diff is not None else ""))
            revisions.append({"branch": branch, "checkpoint": point.name, "step": point.step, "tokens": point.tokens,
                              "max_abs_diff": diff})
    log(f"wrote {out}: a git repository of {len(points)} revisions, branches {', '.join(branches) or 'none'} and "
        f"main (the newest); read them with: sinklab trajectory --hf-model {out} --revision "
        f"{' '.join(branches[:2]) or 'main'} ... --input random")
    return {"out_dir": str(out), "architecture": architecture, "branches": ["main", *branches],
            "revisions": revisions}


def _relative(path: str, run_dir: Path) -> str:
    p = Path(path)
    return str(p.relative_to(run_dir)) if p.is_relative_to(run_dir) else str(p)


def _describe(stage: Path, point, where: str, name: str, run_dir: Path, branches: list[str]) -> None:
    """trainer_state.json and the model card's revisions section of one checkpoint's export."""
    state = {"global_step": point.step, **({"num_input_tokens_seen": point.tokens} if point.tokens else {})}
    (stage / PROGRESS_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    card = stage / "README.md"
    text = card.read_text(encoding="utf-8") if card.is_file() else CARD.format(name=name)
    if point.step is None:  # a last.ckpt written outside training
        this = f"`main`, the export of `{where}`"
    else:
        seen = f", {point.tokens:,} tokens seen" if point.tokens else ""
        this = f"branch `step{point.step}`, the export of `{where}` (step {point.step}{seen})"
    text += REVISIONS.format(n=len(branches), run=run_dir.name, branches=", ".join(f"`{b}`" for b in branches),
                             this=this, name=name, first=(branches or ["main"])[0], last=(branches or ["main"])[-1])
    card.write_text(text, encoding="utf-8")


def _clear_work_tree(out: Path, keep_git: bool) -> None:
    """Remove OUT's files (its .git too unless `keep_git`), so that the next export's files are all it holds."""
    for child in out.iterdir():
        if keep_git and child.name == ".git":
            continue
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
