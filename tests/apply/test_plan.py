"""The plan schema: parsing, the canonical form, and every refusal, word for word where a
user would read it."""
import json

import pytest

from memadvisor.errors import UserError
from memadvisor.plan import (
    Environment, ModuleEntry, Plan, PlanError, auto_checkpoint_modules, environment_problems,
    repeated_blocks, resolve_checkpoint,
)


def test_compact_string_round_trip():
    plan = Plan.parse("precision=amp-bf16,checkpoint=auto,shard=zero3,world=8,hybrid=2,"
                      "offload=params+optimizer,accum=4")
    assert plan.precision == "amp-bf16" and plan.checkpoint == "auto"
    assert plan.shard == "zero3" and plan.world == 8 and plan.hybrid == 2 and plan.accum == 4
    assert plan.offload == {"optimizer", "params"}
    # canonical: KEYS order, defaults left out, lists in a fixed order
    assert str(plan) == ("precision=amp-bf16,checkpoint=auto,accum=4,shard=zero3,world=8,"
                         "hybrid=2,offload=optimizer+params")
    assert Plan.parse(str(plan)) == plan
    assert str(Plan()) == "none" and Plan.parse("none") == Plan() == Plan.parse("")


def test_json_file_and_dict(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"precision": "bf16", "checkpoint": ["blocks.0", "Block"],
                                "accum": 2, "offload": []}))
    plan = Plan.parse(str(path))
    assert plan.checkpoint == ("blocks.0", "Block") and plan.accum == 2
    assert Plan.from_dict(plan.to_dict()) == plan
    assert str(plan) == "precision=bf16,checkpoint=blocks.0+Block,accum=2"


@pytest.mark.parametrize("text, message", [
    ("precision=fp8", "plan key precision must be one of fp32, amp-fp16, amp-bf16, bf16; got 'fp8'"),
    ("colour=red", "unknown plan key 'colour'"),
    ("accum", "plan item 'accum' is not key=value"),
    ("accum=0", "plan key accum must be at least 1, got 0"),
    ("accum=two", "plan key accum must be a whole number, got 'two'"),
    ("accum=2,accum=4", "plan sets 'accum' twice"),
    ("shard=zero3", "shard=zero3 with world=1 has no other rank to shard parameters"),
    ("shard=ddp", "shard=ddp with world=1 has no other rank to replicate with"),
    ("world=4", "world=4 needs a data-parallel mode"),
    ("shard=ddp,world=4,hybrid=2", "hybrid=2 shards inside groups: it needs shard=zero1"),
    ("shard=zero3,world=4,hybrid=3", "hybrid=3 must divide world=4"),
    ("shard=zero3,world=4,hybrid=4", "with world=4 it is plain zero3, drop hybrid"),
    ("shard=zero3,world=4,hybrid=1", "plain replication: use shard=ddp"),
    ("offload=disk", "offload entry 'disk' is not one of optimizer, params, activations"),
    ("offload=params", "offload=params is realised by FSDP2's CPUOffloadPolicy: it needs shard=zero2"),
    ("shard=zero3,world=2,offload=params", "write offload=optimizer+params"),
    ("shard=zero2,world=2,offload=optimizer", "FSDP2 offloads optimizer state only together"),
    ("shard=zero1,world=2,offload=optimizer", "ZeroRedundancyOptimizer steps on the GPU"),
    ("shard=zero3,world=2,optimizer=adafactor", "torch.optim.Adafactor does not run on FSDP2"),
    ("shard=zero2,world=2,optimizer=adam8bit", "8-bit optimizers do not support FSDP2"),
    ("optimizer=lion", "plan key optimizer must be one of keep, sgd, sgd-momentum"),
    ("checkpoint=auto+Block", "none and auto cannot be combined with names"),
    ("checkpoint=blocks[0]", "is not a module path"),
    ("checkpoint=a..b", "checkpoint entry 'a..b' is not a module path"),
    ("checkpoint=-1", "checkpoint entry '-1' is not a module path"),
    ("checkpoint=x y", "checkpoint entry 'x y' is not a module path"),
    ("checkpoint=blocks.1a", "checkpoint entry 'blocks.1a' is not a module path"),
    ("checkpoint=blocks.", "checkpoint entry 'blocks.' is not a module path"),
])
def test_refusals_say_why(text, message):
    with pytest.raises(PlanError) as info:
        Plan.parse(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    # the CLI turns UserError into one line and exit status 2
    assert isinstance(info.value, UserError) and info.value.exit_code == 2


def test_sequential_children_are_module_paths():
    # a top-level nn.Sequential names its children 0, 1, ...
    plan = Plan.parse("checkpoint=0+2+4")
    assert plan.checkpoint == ("0", "2", "4") and str(plan) == "checkpoint=0+2+4"
    assert Plan.parse("checkpoint=layers.3+blocks.0.attn").checkpoint == (
        "layers.3", "blocks.0.attn")
    assert Plan.from_dict({"checkpoint": [0, 2]}).checkpoint == ("0", "2")
    sequential = [("", "Sequential", 30), ("0", "Linear", 10), ("1", "ReLU", 0),
                  ("2", "Linear", 10), ("3", "ReLU", 0), ("4", "Linear", 10)]
    assert resolve_checkpoint(Plan.parse("checkpoint=0+2+4"), sequential) == ["0", "2", "4"]


def test_plan_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(PlanError, match=r"cannot read plan file .*plan\.json: not UTF-8 text "
                                        r"\(at byte 0\)"):
        Plan.parse(str(path))


def test_missing_json_file(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        Plan.parse(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(PlanError, match="must hold a JSON object"):
        Plan.parse(str(bad))


def test_micro_batch_size_is_the_shared_split_rule():
    assert Plan.parse("shard=zero3,world=2,accum=4").micro_batch_size(16) == 2
    assert Plan().micro_batch_size(7) == 7
    with pytest.raises(PlanError, match=r"a batch of 12 samples cannot be split evenly into "
                                        r"2 ranks x 4 micro-batches: the batch must be a "
                                        r"multiple of 8"):
        Plan.parse("shard=ddp,world=2,accum=4").micro_batch_size(12)
    with pytest.raises(PlanError, match="into 3 micro-batches"):
        Plan.parse("accum=3").micro_batch_size(2)


def test_environment_refusals():
    cpu = Environment(device_type="cpu")
    assert environment_problems(Plan.parse("precision=amp-bf16,accum=2"), cpu) == []
    [fp16] = environment_problems(Plan.parse("precision=amp-fp16"), cpu)
    assert fp16.startswith("precision=amp-fp16 needs a CUDA GPU")
    [offload] = environment_problems(Plan.parse("offload=activations"), cpu)
    assert "there is no GPU to offload from" in offload
    [bnb] = environment_problems(Plan.parse("optimizer=adam8bit"), cpu)
    assert "pip install bitsandbytes" in bnb
    old_gpu = Environment(device_type="cuda", bf16_supported=False, fp16_supported=True)
    assert "no bfloat16 support" in environment_problems(Plan.parse("precision=bf16"), old_gpu)[0]
    gpu = Environment(device_type="cuda", fp16_supported=True, bitsandbytes_available=True)
    assert environment_problems(Plan.parse(
        "precision=amp-fp16,shard=zero3,world=2,offload=optimizer+params+activations"), gpu) == []


GPT = [("", "GPT", 100), ("tok_emb", "Embedding", 10), ("blocks", "ModuleList", 80),
       ("blocks.0", "Block", 40), ("blocks.0.attn", "Attention", 20),
       ("blocks.0.mlp", "MLP", 20), ("blocks.1", "Block", 40),
       ("blocks.1.attn", "Attention", 20), ("blocks.1.mlp", "MLP", 20),
       ("ln_f", "LayerNorm", 10)]
MLP = [("", "MLPRegressor", 50), ("body", "Sequential", 45), ("body.0", "Linear", 15),
       ("body.1", "ReLU", 0), ("body.2", "Linear", 15), ("body.3", "ReLU", 0),
       ("body.4", "Linear", 15), ("body.5", "ReLU", 0), ("head", "Linear", 5)]


def test_repeated_blocks_and_auto_checkpoint():
    assert repeated_blocks(GPT) == ["blocks.0", "blocks.1"]
    assert auto_checkpoint_modules(GPT) == ["blocks.0", "blocks.1"]
    # single layers repeat in the MLP: wrapping one Linear saves nothing, so the container
    assert repeated_blocks(MLP) == ["body.0", "body.2", "body.4"]
    assert auto_checkpoint_modules(MLP) == ["body"]
    # the trace's module dicts are accepted as they are
    as_dicts = [{"path": p, "type": t, "total_parameter_bytes": 4 * n} for p, t, n in GPT]
    assert repeated_blocks(as_dicts) == ["blocks.0", "blocks.1"]
    assert repeated_blocks([ModuleEntry("", "Linear", 3)]) == []


def test_resolve_checkpoint_names():
    assert resolve_checkpoint(Plan.parse("checkpoint=Block"), GPT) == ["blocks.0", "blocks.1"]
    # a module inside one already checkpointed is dropped
    assert resolve_checkpoint(Plan.parse("checkpoint=blocks.0+Attention"), GPT) == [
        "blocks.0", "blocks.1.attn"]
    with pytest.raises(PlanError, match="no module with that path or class .repeated blocks: "
                                        "blocks.0, blocks.1"):
        resolve_checkpoint(Plan.parse("checkpoint=Decoder"), GPT)
    with pytest.raises(PlanError, match="found no repeated blocks"):
        resolve_checkpoint(Plan.parse("checkpoint=auto"), [("", "Linear", 3)])


def test_plan_module_is_pure_python():
    import subprocess
    import sys
    code = "import sys, memadvisor.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_checkpoint_resolves_per_model_as_apply_prepares_each():
    """A GAN's two networks: apply's ``mem.prepare`` runs once per model, each finding its
    own repeated layers; the trace's one module tree marks both as roots."""
    from memadvisor.plan import resolve_checkpoint, resolve_checkpoint_per_root
    tree = [dict(path="", type="Discriminator", total_parameter_bytes=10880, root=True),
            dict(path="main", type="Sequential", total_parameter_bytes=10880),
            *[dict(path=f"main.{i}", type="Conv2d", total_parameter_bytes=1000)
              for i in (0, 2, 5)],
            dict(path="main.1", type="LeakyReLU", total_parameter_bytes=0),
            dict(path="criterion", type="BCELoss", total_parameter_bytes=0, root=True),
            dict(path="netG", type="Generator", total_parameter_bytes=68992, root=True),
            dict(path="netG.main", type="Sequential", total_parameter_bytes=68992),
            *[dict(path=f"netG.main.{i}", type="ConvTranspose2d", total_parameter_bytes=20000)
              for i in (0, 3, 6)]]
    auto = Plan.parse("checkpoint=auto")
    assert resolve_checkpoint_per_root(auto, tree) == ["main", "netG.main"]
    # one tree: every stack of repeated layers, each model's (issue #12)
    assert resolve_checkpoint(auto, tree) == ["main", "netG.main"]
    named = Plan.parse("checkpoint=main")
    assert resolve_checkpoint_per_root(named, tree) == ["main", "netG.main"]
    # a trace without root marks: one model, as before
    unmarked = [{k: v for k, v in m.items() if k != "root"} for m in tree]
    assert resolve_checkpoint_per_root(auto, unmarked) == ["main", "netG.main"]


def test_tp_or_pp_alone_runs_on_its_own_ranks():
    # `--plan pp=2` was refused ("world must equal pp"): without a shard mode the world is
    # the tensor-parallel group times the pipeline's stages; a world given stays checked
    from memadvisor.plan import Plan, PlanError
    assert Plan.parse("pp=2").world == 2 and Plan.parse("tp=4,sp").world == 4
    assert Plan.parse("pp=2,microbatches=4").to_compact() == "world=2,pp=2,microbatches=4"
    with pytest.raises(PlanError, match="world must equal pp"):
        Plan.parse("pp=2,world=4")
