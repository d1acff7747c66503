"""`pdserve up --ray` refuses what it cannot use before it touches a cluster."""

from __future__ import annotations

import pytest

from pdserve.cli import main


@pytest.mark.parametrize("flag,value,says", [
    ("--decode-resources", "{bad", "--decode-resources: not JSON"),
    ("--prefill-resources", '{"node_a": "one"}', "--prefill-resources: must be an object of resource amounts"),
    ("--prefill-resources", "[1]", "--prefill-resources: must be an object"),
])
def test_bad_resources_are_refused_by_name(tiny_model, flag, value, says):
    with pytest.raises(SystemExit) as e:  # the address leads nowhere: reaching it would be the bug
        main(["up", tiny_model, "--ray", "127.0.0.1:1", flag, value])
    assert says in str(e.value)


def test_bad_counts_are_refused_by_name(tiny_model):
    with pytest.raises(SystemExit) as e:
        main(["up", tiny_model, "--ray", "127.0.0.1:1", "--decode", "0"])
    assert "decode: must be >= 1" in str(e.value)
