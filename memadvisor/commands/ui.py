"""`memadvisor ui TRACE [--budget 24GiB] [--gpus N] [--gpu NAME] [--baseline OLD] [--port P]`"""
from __future__ import annotations

import click


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--budget", default=None, metavar="SIZE",
              help="Memory per GPU, e.g. 24GiB: the budget line, the headline and the "
                   "ranked plans (editable in the page).")
@click.option("--gpus", "num_gpus", default=1, show_default=True, type=click.IntRange(min=1),
              help="GPUs the plans may use (editable in the page).")
@click.option("--gpu", default=None, help="Target hardware profile for the plans, e.g. "
              "h100-80gb (default: the device that recorded the trace).")
@click.option("--baseline", "baseline_path", default=None, metavar="OLD.trace",
              help="Add a comparison against an earlier trace.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on.  The dashboard has no authentication: anything "
                   "but a loopback address needs --expose.")
@click.option("--expose", is_flag=True,
              help="Allow a non-loopback --host (anyone who reaches the port sees the trace).")
@click.option("--port", default=8050, show_default=True, type=click.IntRange(0, 65535),
              help="Port to serve on (0: any free port).")
@click.option("--no-browser", is_flag=True,
              help="Do not open a browser (never opened when stdout is not a terminal).")
def command(trace_path, budget, num_gpus, gpu, baseline_path, host, port, no_browser, expose):
    """Serve an interactive dashboard of TRACE: timeline, what is alive, plans."""
    from ..errors import UserError
    from ..units import parse_bytes

    if not _is_loopback(host):
        if not expose:
            raise UserError(f"--host {host!r} listens beyond this machine and the dashboard "
                            "has no authentication; add --expose to do it anyway")
        click.echo(f"memadvisor: warning: serving on {host or 'every interface'} without "
                   "authentication: anyone who reaches the port sees the trace", err=True)
    from ..ui import data as ui_data
    from ..ui import memory
    from ..ui.app import build_app
    from ..ui.server import bind, one_line_errors, serve, should_open_browser
    from ..ui.plans import PlanAdvisor
    from ..ui.views import Dashboard, start_ranking

    budget_bytes = parse_bytes(budget) if budget is not None else None
    memory.bound_malloc()  # a server that runs for hours keeps its memory where it started
    server = bind(host, port)  # a taken port fails before the traces are read
    advisor = None
    try:
        trace, baseline = ui_data.read(trace_path, baseline_path)
        # the plans are priced in a worker from here on, while the page is made and served
        advisor = PlanAdvisor(trace, gpu, after_job=memory.trim,
                              close_in_worker=(server.socket.fileno(),))
        start_ranking(advisor, budget_bytes, num_gpus)
        advisor.prefetch_in_background()  # then, while idle, what other budgets would show
        board = Dashboard(ui_data.from_traces(trace, baseline), budget_bytes=budget_bytes,
                          num_gpus=num_gpus, trace_name=trace_path,
                          baseline_name=baseline_path or "", advisor=advisor)
        server.app.target = one_line_errors(build_app(board, budget or "").server)
    except BaseException:
        server.server_close()
        if advisor is not None:
            advisor.close()
        raise
    try:
        serve(server, open_browser=should_open_browser(no_browser),
              announce=lambda url: click.echo(f"memadvisor: dashboard at {url} (Ctrl-C stops)"))
    finally:
        advisor.close()
    return 0


def _is_loopback(host: str) -> bool:
    """'' and 0.0.0.0 / :: mean every interface: not loopback."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
