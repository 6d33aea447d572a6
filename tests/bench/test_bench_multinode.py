"""`kvpilot bench multinode`'s layouts: TPxPPxNNODES, refused (exit 2, saying why) where the
node count does not divide the ranks; the measurement itself runs in
tests/engine/test_multinode_serve.py's process groups (bench/harness/node_group.py)."""

from __future__ import annotations

import pytest

from kvpilot.bench.multinode import main, parse_layout


def test_a_layout_is_tp_x_pp_x_nnodes():
    assert parse_layout("1x2x2") == (1, 2, 2)
    assert parse_layout("3x1x3") == (3, 1, 3)


def test_a_layout_whose_nodes_do_not_divide_the_ranks_exits_2_saying_why(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--layouts", "1x1x1", "2x1x3"])
    assert exited.value.code == 2
    assert "layout 2x1x3: nnodes 3 must divide tp x pp = 2" in capsys.readouterr().err
