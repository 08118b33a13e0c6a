"""Every preset's `run` and `compare` at tiny sizes against its recorded outputs
(`tests/golden.py`): a change of the surface must not move a number. CI runs 20 of
the 34 cases; the other 14 (presets whose experiment CI runs elsewhere) are in the
exhaustive tier (conftest.py `EXHAUSTIVE`, `--run-exhaustive`).

On the machine that recorded them the outputs are byte-identical (`python
tests/golden.py --check`); here float cells are compared to `golden.RTOL`, since
another CPU may round a fused reduction differently, and every other cell exactly.
"""

from __future__ import annotations

import golden
import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", list(golden.CASES))
def test_outputs_equal_the_recorded_ones(tmp_path, case):
    out = golden.produce(case, tmp_path / "out")
    command = golden.CASES[case][0]
    problems = []
    for name in golden.FILES[command]:
        problems += golden.differences(out / name, golden.GOLDEN / case / name)
    assert not problems, "\n".join(problems[:20])
