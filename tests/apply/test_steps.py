"""``apply --steps N``: the applied script stops after N optimizer steps, every optimizer
having made exactly N updates, and the parameters are those of N full iterations."""
import textwrap

import torch

from memadvisor.cli import main

TRAIN = textwrap.dedent('''
    import sys
    import torch
    torch.manual_seed(0)
    iterations = int(sys.argv[1])
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(iterations, 8, 6)
    target = data.sum(-1, keepdim=True)
    for i in range(iterations):
        x, y = data[i], target[i]
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"iter {i}", flush=True)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, "plain.pt")
''')


def test_stops_after_the_steps_with_the_parameters_of_that_many_iterations(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    # the unmodified script, run for 3 iterations: its own parameters
    assert main(["apply", str(script), "--plan", "none", "-q", "--", "3"]) == 0
    three = torch.load(tmp_path / "plain.pt")
    capsys.readouterr()
    # 10 iterations asked of the script, stopped by --steps after 3 (accum=2 splits exactly)
    assert main(["apply", str(script), "--plan", "accum=2", "-q", "--steps", "3",
                 "--save-parameters", str(tmp_path / "applied.pt"), "--", "10"]) == 0
    out = capsys.readouterr()
    assert out.out.count("iter ") == 3, out.out
    assert "stopping after 3 optimizer step(s)" in out.err
    saved = torch.load(tmp_path / "applied.pt")  # {"plan", "names", "tensors"}
    applied = dict(zip(saved["names"], saved["tensors"]))
    assert set(applied) == set(three)
    for name, value in three.items():
        torch.testing.assert_close(applied[name], value, rtol=1e-5, atol=1e-6)


def test_every_optimizer_makes_the_same_number_of_updates(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gan = textwrap.dedent('''
        import torch
        g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
        opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
        counts = {"d": 0, "g": 0}
        opt_d.register_step_post_hook(lambda *a: counts.__setitem__("d", counts["d"] + 1))
        opt_g.register_step_post_hook(lambda *a: counts.__setitem__("g", counts["g"] + 1))
        try:
            for i in range(10):
                loss_d = d(g(torch.randn(8, 4)).detach()).mean()
                opt_d.zero_grad(); loss_d.backward(); opt_d.step()
                loss_g = -d(g(torch.randn(8, 4))).mean()
                opt_g.zero_grad(); loss_g.backward(); opt_g.step()
        finally:
            print("updates", counts["d"], counts["g"], flush=True)
    ''')
    from memadvisor.apply.launch import run_in_process
    script = tmp_path / "gan.py"
    script.write_text(gan)
    assert run_in_process(script, [], steps=4) == 0
    assert "updates 4 4" in capsys.readouterr().out
