"""Input the CLI must refuse in one line (or warn about) instead of a traceback or a silent
default: plans the target cannot run, unwritable --save-plan paths, unreadable plan files,
sizes under one byte, an empty --gpu, --expandable-segments on a CPU target."""
import json

import pytest

from memadvisor.cli import main
from memadvisor.errors import UserError
from memadvisor.plan import Plan
from memadvisor.units import parse_bytes


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code, err, message):
    assert code == 2
    assert err.startswith("memadvisor: error: ") and err.count("\n") == 1
    assert message in err


# --- simulate refuses what advise rejects and apply refuses ----------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--plan", "precision=amp-fp16"],
     "cannot simulate precision=amp-fp16 on cpu: precision=amp-fp16 needs a CUDA GPU"),
    (["--plan", "accum=2,offload=activations"], "there is no GPU to offload from"),
    (["--plan", "precision=bf16", "--gpu", "v100"],
     "on v100-32gb: precision=bf16: this cuda device has no bfloat16 support"),
    (["--plan", "precision=amp-bf16", "--gpu", "t4"], "no bfloat16 support; use amp-fp16"),
])
def test_simulate_refuses_plans_the_target_cannot_run(capsys, baseline_file, argv, message):
    code, out, err = run(capsys, "simulate", baseline_file, *argv)
    assert_one_line_error(code, err, message)
    assert out == ""


def test_simulate_still_predicts_gpu_plans_on_a_gpu_target(capsys, baseline_file):
    code, out, _ = run(capsys, "simulate", baseline_file, "--plan",
                       "precision=amp-fp16,offload=activations", "--gpu", "v100", "--json")
    assert code == 0
    data = json.loads(out)
    assert 0 < data["peak_bytes"] < data["baseline_peak_bytes"]


def test_the_python_api_does_not_refuse(base):
    # only the CLI refuses: the library still predicts what a plan would do
    from memadvisor.simulate import hardware, simulate
    prediction = simulate(base, Plan.parse("precision=amp-fp16"), hardware(None))
    assert prediction.peak_bytes > 0


# --- --save-plan is checked before the search --------------------------------------------------
def test_save_plan_in_a_missing_folder(capsys, baseline_file, tmp_path):
    path = tmp_path / "nodir" / "best.json"
    code, out, err = run(capsys, "advise", baseline_file, "--budget", "20MiB", "--gpus", "4",
                         "--save-plan", str(path))
    assert_one_line_error(code, err, f"the folder {tmp_path / 'nodir'} does not exist")
    assert out == "" and not path.exists()


def test_save_plan_in_a_file_used_as_a_folder(capsys, baseline_file, tmp_path):
    (tmp_path / "file").write_text("")
    code, _, err = run(capsys, "advise", baseline_file, "--budget", "20MiB",
                       "--save-plan", str(tmp_path / "file" / "best.json"))
    assert_one_line_error(code, err, "is not a directory")


def test_save_plan_onto_a_directory(capsys, baseline_file, tmp_path):
    code, _, err = run(capsys, "advise", baseline_file, "--budget", "20MiB", "--save-plan",
                       str(tmp_path), "--overwrite")
    assert_one_line_error(code, err, f"--save-plan {tmp_path} is a directory")


def test_save_plan_write_failure_is_one_line(capsys, baseline_file, base, tmp_path,
                                             monkeypatch):
    # the folder vanishes between the check and the write
    from memadvisor.commands import advise
    monkeypatch.setattr(advise, "_check_save_path", lambda path, overwrite: None)
    path = tmp_path / "gone" / "best.json"
    code, _, err = run(capsys, "advise", baseline_file, "--budget",
                       str(int(base.peak.bytes * 2)), "--save-plan", str(path))
    assert_one_line_error(code, err, f"cannot write --save-plan {path}: No such file")


# --- plan files ------------------------------------------------------------------------------
def test_plan_file_that_is_not_utf8(capsys, baseline_file, tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b'{"precision": "\xff"}')
    code, _, err = run(capsys, "simulate", baseline_file, "--plan", str(path))
    assert_one_line_error(code, err, f"cannot read plan file {path}: not UTF-8 text")


# --- sizes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("1e3GB", 10**12), ("1.5e-3KiB", 1), ("2E2", 200), ("4.35MB", 4_350_000), ("1 kib", 1024),
])
def test_sizes_with_exponents_and_exact_decimals(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, message", [
    ("0.5", "size must be at least 1 byte: '0.5' rounds down to 0 bytes"),
    ("1e-400", "size must be at least 1 byte"),
    ("0", "size must be positive"),
    ("1e999999999", "size too large"),
    pytest.param("9" * 400, "size too large", id="400-digits"),
    ("2e", "not a size"),
])
def test_sizes_that_are_refused(text, message):
    with pytest.raises(UserError, match=message):
        parse_bytes(text)


def test_budget_under_one_byte(capsys, baseline_file):
    code, _, err = run(capsys, "advise", baseline_file, "--budget", "0.5")
    assert_one_line_error(code, err, "size must be at least 1 byte")


# --- --gpu and --expandable-segments ---------------------------------------------------------
@pytest.mark.parametrize("command", [["simulate"], ["advise", "--budget", "1GiB"]])
def test_empty_gpu_is_an_error(capsys, baseline_file, command):
    code, _, err = run(capsys, command[0], baseline_file, *command[1:], "--gpu", "")
    assert_one_line_error(code, err, "--gpu needs a name; known: h100-80gb")


@pytest.mark.parametrize("command", [["simulate"], ["advise", "--budget", "1GiB"]])
def test_expandable_segments_on_cpu_warns(capsys, baseline_file, command):
    argv = [command[0], baseline_file, *command[1:], "--expandable-segments"]
    code, out, err = run(capsys, *argv)
    assert code == 0 and out
    assert err == ("memadvisor: warning: --expandable-segments only applies to CUDA targets; "
                   "ignored for cpu (pick a GPU with --gpu)\n")
    code, _, err = run(capsys, *argv, "--gpu", "h100")
    assert code == 0 and err == ""
