"""The launch files for clusters the user rents or owns (configs/scale-out/): the SkyPilot tasks
load with SkyPilot's own parser (offline; its CLI would start a local API server, so it is kept
out), a typo in one is refused by that parser, and what their scripts run exists here: each
Make target, each profile, each shard variable. The Slurm array script runs for real on a
one-host cluster in tests/test_scale_out_e2e.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from pipeline.core.config import load_profile
from tests.helpers import skip_unless_ci

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
SCALE_OUT = REPO / "configs" / "scale-out"
SKY_PYTHON = REPO / ".venv-sky" / "bin" / "python"
SKY_TASKS = sorted(SCALE_OUT.glob("*.sky.yaml"))
# Loads each file with SkyPilot and prints what the tests check, as JSON.
LOAD = """
import json, sys
import sky
from sky.utils import dag_utils
out = {}
for path in sys.argv[1:]:
    try:
        task = sky.Task.from_yaml(path)
        dag_utils.load_chain_dag_from_yaml(path)
    except Exception as err:
        out[path] = {"error": str(err)}
        continue
    (resources,) = task.resources
    out[path] = {"num_nodes": task.num_nodes, "accelerators": resources.accelerators,
                 "image_id": resources.image_id, "envs": task.envs, "run": task.run}
print(json.dumps(out))
"""


def sky_load(tmp_path: Path, *paths: Path) -> dict:
    if not SKY_PYTHON.exists():
        skip_unless_ci("SkyPilot's venv is missing: run `make scale-out-tools` (make test does)")
    proc = subprocess.run(
        [str(SKY_PYTHON), "-c", LOAD, *map(str, paths)],
        env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]},  # sky writes ~/.sky
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_skypilot_loads_each_task_as_written(tmp_path):
    assert SKY_TASKS, "no SkyPilot task in configs/scale-out"
    loaded = sky_load(tmp_path, *SKY_TASKS)
    for path, task in loaded.items():
        assert "error" not in task, f"{path}: {task['error']}"
        assert task["accelerators"] == {"B300": 8}, path
        assert task["image_id"], path
        profile = load_profile(REPO / task["envs"]["CONFIG"])  # the profile it names is valid
        assert profile.plan.cluster is not None, path
    shards = loaded[str(SCALE_OUT / "kimi-k2.5-500k.sky.yaml")]
    assert shards["num_nodes"] > 1 and int(shards["envs"]["SHARDS"]) >= shards["num_nodes"]
    # Each node picks its shards from SkyPilot's rank variables.
    assert "$SKYPILOT_NODE_RANK" in shards["run"] and "$SKYPILOT_NUM_NODES" in shards["run"]
    assert "run.shard=$k/$SHARDS" in shards["run"]


def test_skypilot_refuses_a_typo_by_name(tmp_path):
    good = (SCALE_OUT / "kimi-k2.5-500k.sky.yaml").read_text()
    bad = tmp_path / "typo.sky.yaml"
    bad.write_text(good.replace("num_nodes:", "num_node:"))
    (task,) = sky_load(tmp_path, bad).values()
    assert "num_nodes" in task.get("error", ""), task


def make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.MULTILINE))


def called_targets(text: str) -> set[str]:
    """The Make targets a script runs: each `make` call's first word that is not a VAR=value,
    a variable's values taken from its `for` loop or its `case` line."""
    targets = set()
    code = "\n".join(line.split("#")[0] for line in text.splitlines())  # comments name targets too
    for line in re.findall(r"\bmake\b([^\n]*)", code):
        words = [w.strip('"') for w in line.split() if "=" not in w]
        if words:
            targets.add(words[0])
    for name, values in re.findall(r"for (\w+) in ([a-z ]+); do", code):
        if f"${name}" in targets:
            targets = (targets - {f"${name}"}) | set(values.split())
    for name, values in re.findall(r'case "\$(\w+)" in ([a-z|]+)\)', code):
        if f"${name}" in targets:
            targets = (targets - {f"${name}"}) | set(values.split("|"))
    return targets


@pytest.mark.parametrize("path", [*SKY_TASKS, SCALE_OUT / "shards.sbatch"], ids=lambda p: p.name)
def test_every_make_target_a_launch_file_runs_exists(path):
    called = called_targets(path.read_text())
    assert called and called <= make_targets(), called - make_targets()
    stages = {"generate", "extract", "licenses", "train", "eval", "card", "publish"}
    assert called <= {*stages, "venv"}


def test_the_slurm_script_takes_its_shard_from_the_array():
    text = (SCALE_OUT / "shards.sbatch").read_text()
    assert "run.shard=${SLURM_ARRAY_TASK_ID}/${SHARDS}" in text
    proc = subprocess.run(["bash", "-n", str(SCALE_OUT / "shards.sbatch")], check=False)
    assert proc.returncode == 0
