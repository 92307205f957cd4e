"""``memadvisor apply`` end to end: files it writes (and never harms), what it refuses
before running, how failures come back, and the multi-process launch with profiling."""
import os
import shutil
import subprocess
import sys

import pytest

from apply_runs import EXAMPLES, FIXTURES, REPO
from memadvisor.cli import main
from memadvisor.trace import analysis
from memadvisor.trace.io import read_trace

MLP_ARGS = ["--steps", "2", "--batch-size", "8", "--log-every", "100"]


@pytest.fixture
def mlp(tmp_path):
    script = tmp_path / "train.py"
    shutil.copy(EXAMPLES / "mlp_regressor.py", script)
    return script


def cli(*args):
    return main([str(a) for a in args])


def test_dry_run_prints_the_diff_and_touches_nothing(mlp, capsys):
    before = mlp.read_text()
    assert cli("apply", mlp, "--plan", "accum=2", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "+import memadvisor.apply as mem" in out
    assert '+    model, optimizer = mem.prepare(model, optimizer, plan="accum=2")' in out
    assert "+        mem.step(optimizer)" in out
    assert mlp.read_text() == before
    assert sorted(p.name for p in mlp.parent.iterdir()) == ["train.py"]


def test_writes_beside_runs_and_saves_parameters(mlp, capsys):
    saved = mlp.parent / "params.pt"
    assert cli("apply", mlp, "--plan", "accum=2,checkpoint=auto", "--save-parameters", saved,
               "--", *MLP_ARGS) == 0
    captured = capsys.readouterr()
    written = mlp.parent / "train_memadvisor.py"
    assert f"memadvisor: wrote {written}" in captured.err
    assert "step     2" in captured.out  # the script ran (its own log line)
    assert saved.exists() and written.exists()
    assert mlp.read_text() == (EXAMPLES / "mlp_regressor.py").read_text()
    # applying another plan rewrites our own file again (only the plan literal changes)
    assert cli("apply", mlp, "--plan", "accum=4", "--no-run", "-q") == 0
    assert 'plan="accum=4"' in written.read_text()


def test_output_and_in_place(mlp, capsys):
    out = mlp.parent / "sub" / "applied.py"
    assert cli("apply", mlp, "--plan", "checkpoint=auto", "-o", out, "--no-run", "-q") == 0
    assert "mem.prepare" in out.read_text()
    original = mlp.read_text()
    assert cli("apply", mlp, "--plan", "checkpoint=auto", "--in-place", "--no-run", "-q") == 0
    assert (mlp.parent / "train.py.orig").read_text() == original
    assert "mem.prepare" in mlp.read_text()
    # in place again: the backup stays the true original
    assert cli("apply", mlp, "--plan", "accum=2", "--in-place", "--no-run", "-q") == 0
    assert (mlp.parent / "train.py.orig").read_text() == original
    assert 'plan="accum=2"' in mlp.read_text()


@pytest.mark.parametrize("extra, message", [
    (["--plan", "precision=fp8"], "plan key precision must be one of"),
    (["--plan", "shard=zero3"], "shard=zero3 with world=1"),
    (["--plan", "precision=amp-fp16"], "precision=amp-fp16 needs a CUDA GPU"),
    (["--plan", "accum=2,offload=activations"], "there is no GPU to offload from"),
    (["--plan", "shard=ddp,world=2", "--nproc", "3"], "the plan is for world=2 ranks but --nproc 3 starts 3"),
    (["--plan", "shard=ddp,world=4", "--nnodes", "2", "--nproc", "4"], "2 nodes x --nproc 4 starts 8"),
    (["--plan", "accum=2", "--bogus-flag", "1"], "torchrun option: unrecognized arguments: --bogus-flag"),
    (["--plan", "accum=2", "-o", "{script}"], "is the script itself: use --in-place"),
    (["--plan", "accum=2", "-o", "{foreign}"], "exists and was not written by memadvisor apply"),
])
def test_refused_before_anything_runs(mlp, capsys, extra, message):
    foreign = mlp.parent / "notes.py"
    foreign.write_text("print('mine')\n")
    extra = [e.format(script=mlp, foreign=foreign) for e in extra]
    assert cli("apply", mlp, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("memadvisor: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (mlp.parent / "train_memadvisor.py").exists()
    assert foreign.read_text() == "print('mine')\n"


def test_scripts_it_cannot_rewrite(tmp_path, capsys):
    script = tmp_path / "manual_sgd.py"
    shutil.copy(FIXTURES / "manual_sgd.py", script)
    assert cli("apply", script, "--plan", "accum=2") == 2
    err = capsys.readouterr().err
    assert "did not find optimizer, step" in err and "# memadvisor: optimizer" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manual_sgd.py"]


def test_a_batch_the_plan_cannot_split_is_one_line(mlp, capsys):
    assert cli("apply", mlp, "--plan", "accum=3", "-q", "--", *MLP_ARGS) == 2
    err = capsys.readouterr().err
    assert "memadvisor: error: a batch of 8 samples cannot be split evenly into 3 " \
           "micro-batches" in err
    assert "Traceback" not in err


def test_the_scripts_own_error_keeps_its_traceback(tmp_path, capsys):
    script = tmp_path / "crash_in_step.py"
    shutil.copy(FIXTURES / "crash_in_step.py", script)
    assert cli("apply", script, "--plan", "accum=2", "-q") == 1
    err = capsys.readouterr().err
    assert "crash_in_step_memadvisor.py\", line" in err  # the user's frames
    assert "memadvisor: error: crash_in_step_memadvisor.py failed: RuntimeError: loss check " \
           "failed at step 2" in err
    assert "memadvisor/apply" not in err


def test_scripts_that_read_files_beside_them(tmp_path, capsys):
    for name in ("uses_file_relative.py", "helper_mod.py", "config.json"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        assert cli("apply", tmp_path / "uses_file_relative.py", "--plan", "accum=2", "-q") == 0
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "helper_mod loaded" in out and "step 5 loss" in out


def test_checkpointing_lowers_activation_bytes(mlp, tmp_path):
    gpt = tmp_path / "gpt.py"
    shutil.copy(EXAMPLES / "gpt_lm.py", gpt)
    args = ["--batch-size", "8", "--steps", "5"]
    assert cli("apply", gpt, "--plan", "none", "-q", "--profile", tmp_path / "base.trace",
               "--profile-steps", "2", "--", *args) == 0
    assert cli("apply", gpt, "--plan", "checkpoint=auto", "-q", "--profile",
               tmp_path / "ckpt.trace", "--profile-steps", "2", "--", *args) == 0
    base = category_peaks(tmp_path / "base.trace")
    ckpt = category_peaks(tmp_path / "ckpt.trace")
    assert ckpt["activation"] < 0.4 * base["activation"], (base, ckpt)
    assert ckpt["parameter"] == base["parameter"]


def category_peaks(path):
    trace = read_trace(path)
    assert trace.meta.status == "completed", trace.meta.error
    window = analysis.step_slice(trace.events, analysis.analysed_step(trace))
    return {c: int(analysis.category_series(trace.events, c)[window].max())
            for c in ("parameter", "gradient", "optimizer_state", "activation")}


def run_cli_subprocess(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_ranks_with_torchrun_and_zero3_profiles(tmp_path):
    """The real launch: torchrun's parser and launcher, gloo, one trace per rank.  ZeRO-3
    over 2 ranks holds half the parameter, gradient and optimizer bytes per rank."""
    gpt = tmp_path / "gpt.py"
    shutil.copy(EXAMPLES / "gpt_lm.py", gpt)
    args = ["--batch-size", "8", "--steps", "5"]
    done = run_cli_subprocess("apply", gpt, "--plan", "shard=zero3,world=2", "-q",
                              "--profile", tmp_path / "z3.trace", "--profile-steps", "2",
                              "--", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert cli("apply", gpt, "--plan", "none", "-q", "-o", tmp_path / "plain.py", "--profile",
               tmp_path / "one.trace", "--profile-steps", "2", "--", *args) == 0
    one = category_peaks(tmp_path / "one.trace")
    for name in ("z3.trace", "z3.rank1.trace"):
        sharded = category_peaks(tmp_path / name)
        for category in ("parameter", "gradient", "optimizer_state"):
            # each rank holds half (optimizer state: plus a few step counters)
            assert abs(sharded[category] - one[category] / 2) <= 0.01 * one[category], (
                name, category, sharded, one)


@pytest.mark.slow
def test_a_failing_rank_is_named(tmp_path):
    script = tmp_path / "train.py"
    shutil.copy(EXAMPLES / "mlp_regressor.py", script)
    done = run_cli_subprocess("apply", script, "--plan", "shard=ddp,world=2", "-q", "--",
                              "--batch-size", "3", "--steps", "1", cwd=tmp_path)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("memadvisor: error: rank ") and \
        "failed: a batch of 3 samples cannot be split evenly into 2 ranks" in last, done.stderr


def test_torchrun_command_line(tmp_path):
    from memadvisor.apply.launch import LaunchRequest, nodes_of, parse_torchrun_args, torchrun_argv

    single = torchrun_argv(LaunchRequest(script=tmp_path / "t.py", args=["--lr", "1"], nproc=2,
                                         profile=tmp_path / "r.trace"))
    assert single[:3] == ["--nproc-per-node", "2", "--standalone"]
    assert single[-4:] == ["--", str(tmp_path / "t.py"), "--lr", "1"]
    parsed = parse_torchrun_args(single)
    assert parsed.module and parsed.training_script == "memadvisor.apply.rank_main"
    assert parsed.training_script_args[:2] == ["--profile", str(tmp_path / "r.trace")]
    # multi-node flags pass through untouched and replace --standalone
    flags = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "host:29500",
             "--rdzv-backend", "c10d"]
    multi = torchrun_argv(LaunchRequest(script=tmp_path / "t.py", nproc=4, launcher_args=flags))
    assert "--standalone" not in multi and multi[2:10] == flags
    parsed = parse_torchrun_args(multi)
    assert (parsed.nnodes, parsed.node_rank, parsed.rdzv_endpoint) == ("2", 1, "host:29500")
    assert nodes_of(flags) == 2 and nodes_of(["--nnodes", "1:4"]) is None


def test_an_output_edited_by_hand_is_never_overwritten(mlp, capsys):
    written = mlp.parent / "train_memadvisor.py"
    assert cli("apply", mlp, "--plan", "accum=2", "--no-run", "-q") == 0
    # apply's own file, unedited: applying another plan rewrites it
    assert cli("apply", mlp, "--plan", "accum=4", "--no-run", "-q") == 0
    edited = written.read_text().replace("mem.step(", "mem.step(  # mine\n    ", 1)
    written.write_text(edited)
    capsys.readouterr()
    assert cli("apply", mlp, "--plan", "checkpoint=auto", "--no-run", "-q") == 2
    err = capsys.readouterr().err
    assert "was written by memadvisor apply and edited since" in err
    assert written.read_text() == edited
    # a hand-written file calling the runtime is not apply's either
    handmade = mlp.parent / "mine.py"
    handmade.write_text("import memadvisor.apply as mem\n")
    assert cli("apply", mlp, "--plan", "accum=2", "-o", handmade, "--no-run", "-q") == 2
    assert handmade.read_text() == "import memadvisor.apply as mem\n"


def test_in_place_refuses_a_backup_name_it_did_not_make(mlp, capsys):
    backup = mlp.parent / "train.py.orig"
    backup.write_text("my notes\n")
    original = mlp.read_text()
    assert cli("apply", mlp, "--plan", "accum=2", "--in-place", "--no-run", "-q") == 2
    err = capsys.readouterr().err
    assert "train.py.orig, which exists and is not a copy apply made" in err
    assert mlp.read_text() == original and backup.read_text() == "my notes\n"
