"""The submitit launcher presets in conf/hydra/launcher: composed by Hydra, checked against the plugin's schema,
rendered to the sbatch script submitit would submit, and (local) run for real."""
import json
import subprocess
import sys
import warnings

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from sinklab.config import register_configs
from tests.helpers import HYDRA_SCHEMA_WARNING, REPO

CONF = REPO / "conf"


@pytest.fixture
def conf_dir(tmp_path):
    """A minimal primary config whose search path includes the repo's conf (for hydra/launcher)."""
    d = tmp_path / "conf"
    d.mkdir()
    (d / "config.yaml").write_text(
        "hydra:\n"
        f"  searchpath: [file://{CONF}]\n"
        f"  sweep: {{dir: {tmp_path}/multirun, subdir: '${{hydra.job.num}}'}}\n"
        "defaults:\n  - _self_\n"
        "trainer: {devices: 2, num_nodes: 3, accelerator: gpu}\n"
        "optim: {weight_decay: 0.1}\n")
    return d


def compose_cfg(conf_dir, overrides=(), name="config"):
    """Compose with sinklab's schemas registered (as sinklab-train does); any warning is an error: the presets extend
    the plugin's schemas explicitly, so Hydra's "automatic schema matching" deprecation warning must not show."""
    register_configs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return compose(name, overrides=list(overrides), return_hydra_config=True)


def compose_launcher(conf_dir, launcher, overrides=(), name="config"):
    return compose_cfg(conf_dir, [f"hydra/launcher={launcher}", *overrides], name)


def test_slurm_preset_resolves_and_fits_the_plugin_schema(conf_dir, tmp_path):
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    cfg = compose_launcher(conf_dir, "slurm")
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "slurm"
    raw = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert raw["tasks_per_node"] == "${oc.select:trainer.devices,1}"  # ours, not the plugin's default
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["tasks_per_node"] == 2 and launcher["gpus_per_node"] == 2 and launcher["nodes"] == 3
    assert launcher["submitit_folder"] == f"{tmp_path}/multirun/.submitit/%j"
    assert launcher["max_num_timeout"] > 0
    assert launcher["additional_parameters"] == {} and launcher["setup"] == []
    assert launcher["partition"] is None and launcher["account"] is None
    # every key is one of the schema's and every value has the schema's type
    schema = OmegaConf.structured(SlurmQueueConf)
    assert set(launcher) == set(schema.keys())
    merged = OmegaConf.to_container(OmegaConf.merge(schema, launcher), resolve=True)
    assert merged == launcher
    # the values the plugin's launcher would receive
    inst = instantiate(cfg.hydra.launcher)
    assert type(inst).__name__ == "SlurmLauncher"
    assert inst.params["tasks_per_node"] == 2 and inst.params["name"] == cfg.hydra.job.name


def test_slurm_preset_defaults_without_trainer_keys(tmp_path):
    d = tmp_path / "conf"
    d.mkdir()
    (d / "config.yaml").write_text(f"hydra:\n  searchpath: [file://{CONF}]\nx: 1\n")
    cfg = compose_launcher(d, "slurm")
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["tasks_per_node"] == 1 and launcher["nodes"] == 1 and launcher["gpus_per_node"] == 1


def test_slurm_preset_renders_the_sbatch_script(conf_dir, tmp_path):
    """The sbatch text submitit builds from these parameters, as the plugin passes them (base parameters by name,
    the rest slurm-specific; submitit_folder and max_num_timeout go to the executor's constructor)."""
    from submitit.slurm import slurm

    cfg = compose_launcher(conf_dir, "slurm", ["hydra.launcher.partition=gpu", "hydra.launcher.mem_gb=32"])
    params = dict(instantiate(cfg.hydra.launcher).params)
    folder = params.pop("submitit_folder")
    assert params.pop("max_num_timeout") == 5
    renamed = {slurm.SlurmExecutor._equivalence_dict().get(k, k): v for k, v in params.items()}
    unknown = set(renamed) - set(slurm._get_default_parameters())
    assert not unknown, f"submitit would reject {unknown}"
    renamed["mem"] = slurm._convert_mem(renamed["mem"])
    text = slurm._make_sbatch_string(command="python -u -m submitit.core._submit X", folder=folder, **renamed)
    lines = set(text.splitlines())
    for want in ("#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2", "#SBATCH --nodes=3",
                 "#SBATCH --partition=gpu", "#SBATCH --mem=32GB", "#SBATCH --cpus-per-task=8", "#SBATCH --time=240",
                 "#SBATCH --signal=USR2@120", f"#SBATCH --output={tmp_path}/multirun/.submitit/%j/%j_0_log.out"):
        assert want in lines, f"{want} not in:\n{text}"
    assert not any(line.startswith("#SBATCH --account") for line in lines)


def test_real_trainer_presets_set_the_task_count(tmp_path):
    """With the project's own train.yaml: tasks per node follow trainer.devices of the chosen trainer preset."""
    overrides = ["trainer=ddp", f"paths.root_dir={tmp_path}"]
    try:
        base = compose_cfg(CONF, overrides, "train")
    except Exception as e:  # the rest of conf/ is not composable in this checkout: nothing to check against
        pytest.skip(f"conf/train.yaml does not compose: {type(e).__name__}: {e}")
    cfg = compose_launcher(CONF, "slurm", overrides, "train")
    assert cfg.hydra.launcher.tasks_per_node == base.trainer.devices == cfg.hydra.launcher.gpus_per_node
    assert cfg.hydra.launcher.nodes == base.trainer.num_nodes
    assert str(cfg.hydra.launcher.submitit_folder).startswith(str(cfg.hydra.sweep.dir))


@pytest.mark.parametrize("name", ["slurm", "local"])
def test_the_plugins_preset_names_select_sinklabs_presets(conf_dir, name):
    """hydra/launcher=submitit_slurm and submitit_local (the plugin's names, and the files of earlier sinklab
    versions) compose to sinklab's slurm and local presets, without a warning."""
    new = compose_launcher(conf_dir, name)
    old = compose_launcher(conf_dir, f"submitit_{name}")
    assert old.hydra.runtime.choices["hydra/launcher"] == f"submitit_{name}"
    assert OmegaConf.to_container(old.hydra.launcher) == OmegaConf.to_container(new.hydra.launcher)
    assert new.hydra.launcher.timeout_min == 240  # sinklab's setting, not the plugin's 60


@pytest.mark.slow
@pytest.mark.ci
def test_local_preset_runs_a_two_job_sweep(tmp_path):
    """A real multirun of a tiny Hydra app (which registers sinklab's schemas, as sinklab-train does) through the
    plugin's name of the local preset: each job runs in its own process under submitit with sinklab's settings and
    leaves its dir; submitit's files stay in the sweep dir's .submitit/; Hydra prints no deprecation warning."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text(f"hydra:\n  searchpath: [file://{CONF}]\ntrainer: {{devices: 1}}\nx: 0\n")
    (tmp_path / "app.py").write_text(
        "import json, os, hydra\n"
        "from hydra.core.hydra_config import HydraConfig\n"
        "from sinklab.config import register_configs\n"
        "register_configs()\n"
        "@hydra.main(config_path='conf', config_name='config', version_base='1.3')\n"
        "def main(cfg):\n"
        "    out = HydraConfig.get().runtime.output_dir\n"
        "    info = {'x': cfg.x, 'executor': os.environ.get('SUBMITIT_EXECUTOR'), 'pid': os.getpid(),\n"
        "            'cuda': os.environ.get('CUDA_VISIBLE_DEVICES')}\n"
        "    with open(os.path.join(out, 'status.json'), 'w') as f:\n"
        "        json.dump({'status': 'completed', 'error': None, 'step': 0, 'final': {}, 'info': info}, f)\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    sweep = tmp_path / "multirun"
    p = subprocess.run([sys.executable, "app.py", "-m", "hydra/launcher=submitit_local", "x=1,2",
                        f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=2"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    infos = [json.loads((sweep / str(i) / "status.json").read_text())["info"] for i in (0, 1)]
    assert [i["x"] for i in infos] == [1, 2]
    assert all(i["executor"] == "local" for i in infos) and infos[0]["pid"] != infos[1]["pid"]
    assert all(i["cuda"] == "0" for i in infos)  # gpus_per_node = trainer.devices (sinklab's local preset)
    logs = list((sweep / ".submitit").glob("*/*_log.*"))
    assert logs
    for text in [p.stderr, *(f.read_text() for f in logs)]:
        assert HYDRA_SCHEMA_WARNING not in text

    from sinklab import report

    res = report.build_report(sweep, tmp_path / "report")
    assert [(r["job"], r["x"], r["status"]) for r in res["rows"]] == [("0", 1, "completed"), ("1", 2, "completed")]
