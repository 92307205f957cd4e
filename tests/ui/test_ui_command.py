"""``memadvisor ui``: bad input is one line and exit 2; good input serves the page."""
from __future__ import annotations

import socket
import threading
import urllib.request

import pytest

from memadvisor.cli import main
from memadvisor.ui import server as ui_server


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["ui", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memadvisor: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0]


def test_listed_in_help(capsys):
    assert main(["--help"]) == 0
    assert "ui " in capsys.readouterr().out


def test_missing_trace(capsys, tmp_path):
    code, _, err = run_cli(capsys, str(tmp_path / "nope.trace"), "--port", "0")
    assert code == 2
    assert_one_line_error(err, "nope.trace")


def test_damaged_trace(capsys, tmp_path):
    path = tmp_path / "bad.trace"
    path.write_bytes(b"PAR1" + bytes(range(256)) * 8)
    code, _, err = run_cli(capsys, str(path), "--port", "0")
    assert code == 2
    assert_one_line_error(err, "bad.trace")


def test_bad_budget_and_gpu(capsys, synthetic_traces):
    code, _, err = run_cli(capsys, synthetic_traces["base"], "--budget", "24 potatoes")
    assert code == 2
    assert_one_line_error(err, "not a size")
    code, _, err = run_cli(capsys, synthetic_traces["base"], "--gpu", "abacus", "--port", "0")
    assert code == 2
    assert_one_line_error(err, "unknown GPU")


def test_port_in_use(capsys, synthetic_traces):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, synthetic_traces["base"], "--port", str(port))
    assert code == 2
    assert_one_line_error(err, f"cannot serve on 127.0.0.1:{port}")


def test_serves_the_page_and_prints_the_url(capsys, monkeypatch, synthetic_traces):
    """The real command up to serving; the fake ``serve`` fetches the page and stops."""
    fetched = {}

    def fake_serve(server, *, open_browser, announce):
        fetched["open_browser"] = open_browser
        announce(ui_server.url_of(server))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = ui_server.url_of(server)
            for path in ("", "_dash-layout", "_dash-dependencies"):
                with urllib.request.urlopen(url + path, timeout=10) as response:
                    fetched[path] = (response.status, response.read().decode())
        finally:
            server.shutdown()
            server.server_close()

    monkeypatch.setattr(ui_server, "serve", fake_serve)
    code, out, _ = run_cli(capsys, synthetic_traces["bigger"], "--baseline",
                           synthetic_traces["base"], "--budget", "1GiB", "--port", "0")
    assert code == 0
    assert out.startswith("memadvisor: dashboard at http://127.0.0.1:")
    assert fetched["open_browser"] is False  # not a terminal
    assert fetched[""][0] == 200 and "<title>memadvisor</title>" in fetched[""][1]
    assert '"timeline"' in fetched["_dash-layout"][1]
    assert "comparison-section" in fetched["_dash-layout"][1]
    assert "plan-table.rowData" in fetched["_dash-dependencies"][1]


@pytest.mark.parametrize("no_browser, tty, expected", [
    (False, True, True), (True, True, False), (False, False, False)])
def test_browser_only_for_a_terminal(no_browser, tty, expected):
    class Stream:
        def isatty(self):
            return tty

    assert ui_server.should_open_browser(no_browser, Stream()) is expected
