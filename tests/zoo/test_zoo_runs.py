"""Every zoo script runs plainly (``python zoo/X.py``) to exit 0, does as many iterations as
its header says, and ends with its ``final_loss=`` line.

The scripts run in subprocesses two at a time (one thread each) from one fixture the first
test to ask starts (151 s for the file on a 2-core machine shared with other jobs, under
the 3 minutes it is allowed; 70 s of CPU in all);
framework scripts are skipped, naming the package, when the ``zoo`` extra is not installed.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from zoo_scripts import (LAYOUTS, ZOO, final_loss, iterations_printed, run_plainly,
                         zoo_scripts)

SCRIPTS = {script.name: script for script in zoo_scripts()}
#: what issues 12 and 13 ask the zoo to cover, by script
REQUIRED = {"hf_trainer_gpt2", "lightning_classifier", "accelerate_loop", "nanogpt_style",
            "dcgan", "vae", "lbfgs_sine", "word_lm_manual_sgd", "seq2seq_transformer",
            "bigru_tagger", "unet_groupnorm", "diffusion_unet", "llama_decoder",
            "bert_encoder", "vit", "resnet_dataloader", "moe", "kwargs_model", "multitask",
            "mnist_under_if"}


@pytest.fixture(scope="module")
def plain_runs():
    runnable = [s for s in SCRIPTS.values() if s.missing_package() is None]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip((s.name for s in runnable), pool.map(run_plainly, runnable)))


def test_the_zoo_covers_both_issues():
    assert REQUIRED <= set(SCRIPTS), sorted(REQUIRED - set(SCRIPTS))
    assert len(SCRIPTS) >= 18
    layouts = {s.truth["batch_layout"] for s in SCRIPTS.values()}
    assert layouts == LAYOUTS
    frameworks = {s.truth["framework"] for s in SCRIPTS.values()}
    assert frameworks == {"raw", "hf-trainer", "lightning", "accelerate"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_header_and_docstring(name):
    script = SCRIPTS[name]
    text = script.path.read_text()
    assert text.startswith('"""'), "module docstring first"
    assert "Imitates the style of" in text.split('"""')[1]
    assert script.truth["batch_size"] > 0 and script.truth["iterations"] == 3
    assert script.truth["steps_per_iteration"] >= 1


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_runs_plainly(name, plain_runs):
    script = SCRIPTS[name]
    missing = script.missing_package()
    if missing:
        pytest.skip(f"{name} needs {missing} (pip install -e '.[zoo]')")
    done = plain_runs[name]
    assert done.returncode == 0, f"python zoo/{name}.py exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert iterations_printed(done.stdout) == script.truth["iterations"], done.stdout[-2000:]
    loss = final_loss(done.stdout)
    assert loss is not None and math.isfinite(loss), done.stdout[-2000:]
    # nothing left behind in the zoo folder (outputs go to temporary folders)
    assert not list(ZOO.glob("*.pt")) and not list(ZOO.glob("lightning_logs"))
