"""The profiler's 16-bit convolution probes (profile/probes.py, ``meta.probes``)."""
import torch
import torch.nn as nn

from memadvisor.profile import probes
from memadvisor.profile.session import ProfileSession


def _profile(model, x, probes=True):
    with ProfileSession(probes=probes) as session:
        # a real gradient (``sum`` alone would hand back an expanded, stride-0 one)
        model(x).square().sum().backward()
    return session


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2))


def test_each_cpu_convolution_is_probed_in_fp32_and_bf16():
    torch.manual_seed(0)
    session = _profile(_net(), torch.randn(2, 3, 12, 12))
    before = torch.get_rng_state()
    table, meta = session.build()
    # the probe builds modules and inputs of its own: the script's RNG stream is untouched
    assert torch.equal(before, torch.get_rng_state())
    entries = {e["module"]: e for e in meta.probes["convolution"]}
    assert set(entries) == {"0", "2"}
    assert entries["2"]["input_shape"] == [2, 8, 12, 12]
    events = table.to_pandas()
    raw = events[(events["action"] == "alloc") & (events["dtype"] == "bytes")
                 & (events["op"] == "aten::convolution_backward")]
    for entry in entries.values():
        assert set(entry["raw_bytes"]) == {"float32", "bfloat16"}
    # rebuilt at the recorded shapes, the fp32 probes allocate what the script's calls did
    # (compared over both modules: the dispatch engine names backward modules differently)
    assert sorted(int(b) for b in raw["size_bytes"]) == sorted(
        b for e in entries.values() for b in e["raw_bytes"]["float32"]["backward"])


def test_nothing_to_probe_no_probe():
    session = _profile(nn.LayerNorm(4), torch.randn(2, 4))
    assert session.build()[1].probes == {}


def test_a_failing_probe_is_recorded_not_raised(monkeypatch):
    def broken(spec, dtype):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(probes, "_run", broken)
    session = _profile(_net(), torch.randn(2, 3, 12, 12))
    _, meta = session.build()
    assert all("no such kernel" in e["skipped"] for e in meta.probes["convolution"])


def test_first_convolution_input_without_grad_is_probed_so():
    spec = probes.conv_spec(nn.Conv2d(3, 4, 3), (torch.randn(1, 3, 8, 8),))
    assert spec["input_requires_grad"] is False and spec["weight_requires_grad"] is True
    assert probes.conv_spec(nn.Linear(3, 4), (torch.randn(1, 3),)) is None


def test_linear_probe_matches_the_same_layer_run_in_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    session = _profile(model, torch.randn(4, 6, 16))
    entries = {e["module"]: e for e in session.build()[1].probes["linear"]}
    assert set(entries) == {"0", "2"}
    second = entries["2"]
    assert second["rows"] == [24, 12] and second["input_shape"] == [4, 6, 32]
    assert set(second["bfloat16"]) == {"forward", "input_gradient", "weight_gradient"}
    # the script's own layer, run in bf16 and recorded: its forward matmul's blocks
    bf16 = _profile(model.to(torch.bfloat16), torch.randn(4, 6, 16, dtype=torch.bfloat16),
                    probes=False)
    events = bf16.build()[0].to_pandas()
    raw = events[(events["module"] == "2") & (events["action"] == "alloc")
                 & (events["dtype"] == "bytes") & (events["phase"] == "forward")]
    assert int(raw["size_bytes"].sum()) == second["bfloat16"]["forward"][0]
    # the first layer's input needs no gradient: no input-gradient matmul
    assert entries["0"]["bfloat16"]["input_gradient"] == [0, 0]


def test_alike_modules_are_probed_once_and_the_budget_holds(monkeypatch):
    probed = []
    real = probes._runs

    def counting(kind, spec):
        probed.append(spec["input_requires_grad"])
        return real(kind, spec)

    monkeypatch.setattr(probes, "_runs", counting)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    session = _profile(model, torch.randn(2, 3, 8))
    entries = session.build()[1].probes["linear"]
    assert len(entries) == 4 and all("bfloat16" in e for e in entries)
    # two distinct calls: the first layer reads data (no input gradient), the rest alike
    assert sorted(probed) == [False, True]
    assert entries[1]["bfloat16"] == entries[3]["bfloat16"]
    out = probes.probe_modules(dict(session.modules.probe_specs),
                               lambda: ProfileSession(probes=False),
                               budget_s=0.0)
    assert len(probed) == 2  # nothing probed once the budget is spent
    assert all("budget" in e["skipped"] for e in out["linear"])


def test_no_probes_and_a_probe_crash_keep_the_trace(monkeypatch):
    with ProfileSession(probes=False) as session:
        _net()(torch.randn(2, 3, 12, 12)).square().sum().backward()
    assert session.build()[1].probes == {}

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    # even an interrupt during the probes leaves a complete trace, saying why there are none
    monkeypatch.setattr(probes, "probe_modules", broken)
    import memadvisor.profile.session as session_module
    monkeypatch.setattr(session_module, "probe_modules", broken)
    with ProfileSession() as session:
        _net()(torch.randn(2, 3, 12, 12)).square().sum().backward()
    table, meta = session.build()
    assert table.num_rows > 0 and meta.probes == {"skipped": "KeyboardInterrupt: "}
