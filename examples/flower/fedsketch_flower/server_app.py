"""The server: any FedSketch strategy (the run config's ``strategy``) through Flower's Grid."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from server_kit.flower import run

from .task import nodes, setup

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    architecture, _ = setup(context.run_config)
    n = len(list(grid.get_node_ids()))
    run(grid, context, defaults={"architecture": architecture},
        truth=lambda ctx: {c.cid: c.group for c in nodes(ctx.run_config, n)})
