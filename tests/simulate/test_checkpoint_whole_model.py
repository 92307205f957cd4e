"""Checkpointing a region whose forward ends right before backward (the whole model): its
saved activations are gone before the recompute makes them again, so the two never
coexist.  Measured 2026-11-21: gpt_lm (4 layers, d 128, batch 8) checkpoint=GPT predicted
19,706,264 B, the ``memadvisor apply --profile`` run's peak to the byte; on the kept trace
below the overlap had predicted 23,660,124 B, above the unmodified run."""
import numpy as np
import pytest

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.simulate.checkpoint import CPU_RNG_STATE_BYTES, apply_checkpoint
from memadvisor.simulate.replay import PHASE_CODE
from memadvisor.trace import schema


@pytest.fixture(scope="module")
def loss_inside(tmp_path_factory):
    """gpt_lm as the demo profiles it: its forward ends with the loss and its loop zeroes
    gradients before the forward, so the last forward allocation comes right before
    backward (a few seconds to profile)."""
    import subprocess
    import sys
    from pathlib import Path

    from memadvisor.trace.io import read_trace

    root = Path(__file__).resolve().parents[2]
    path = tmp_path_factory.mktemp("whole") / "gpt_lm.trace"
    subprocess.run([sys.executable, "-m", "memadvisor.cli", "profile",
                    str(root / "examples" / "gpt_lm.py"), "-o", str(path), "--steps", "3",
                    "-q", "--", "--n-layer", "4", "--d-model", "128", "--batch-size", "8"],
                   check=True, cwd=root)
    return prepare(read_trace(path))


def test_whole_model_originals_die_before_their_recompute(loss_inside):
    base = loss_inside
    timeline, effects = apply_checkpoint(base.timeline, [""], base.device_type)
    assert effects
    start, _ = effects[0].recompute_positions
    recomputed = np.arange(len(base.timeline), len(timeline))
    recomputed = recomputed[(timeline.phase[recomputed] == PHASE_CODE[schema.BACKWARD])
                            & timeline.category_mask(schema.ACTIVATION)[recomputed]]
    assert len(recomputed)
    first_recompute = timeline.alloc_key[recomputed].min()
    original = np.arange(len(base.timeline))
    saved = original[(base.timeline.free_key[original] != timeline.free_key[original])
                     & base.timeline.category_mask(schema.ACTIVATION)[original]]
    assert len(saved) and (timeline.free_key[saved] < first_recompute).all()


def test_whole_model_checkpoint_adds_at_most_the_rng_state(loss_inside):
    base = loss_inside
    root = next(m["type"] for m in base.meta.modules if m["path"] == "")
    plan = Plan.parse(f"checkpoint={root}")
    # the forward's generator state and the recompute's (CPU: preserve_rng_state)
    assert simulate(base, plan).peak_bytes <= base.peak.bytes + 2 * CPU_RNG_STATE_BYTES


def test_a_trace_that_overlapped_them():
    """A gpt_lm trace (recorded 2026-11-21 06:00 by an earlier profiler) on which the
    overlap predicted 23,660,124 B for checkpoint=GPT, above its own 22,759,900 B."""
    from pathlib import Path

    from memadvisor.trace.io import read_trace
    path = Path(__file__).resolve().parents[1] / "fixtures" / \
        "gpt_lm_whole_model_checkpoint.trace"
    base = prepare(read_trace(path))
    assert base.peak.bytes == 22_759_900
    predicted = simulate(base, Plan.parse("checkpoint=GPT")).peak_bytes
    assert predicted <= base.peak.bytes + 2 * CPU_RNG_STATE_BYTES
