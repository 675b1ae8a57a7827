"""03-compiled's exercise checks: typical wrong answers get their hint."""

import jacutil as ju
from jacutil.teaching import check
from jacutil.teaching.check.notebook_03 import xla_shapes
from tests.check_hints import hint

SIZES = range(1, 201)


def test_03_2_the_rule_is_compiled_jacobians():
    # 200 = 3 blocks of 64 and one of 8; 100 = 64 + 36 -> 64
    assert xla_shapes([100, 200], 64) == {8, 64}
    assert xla_shapes(SIZES, 64) == {2, 4, 8, 16, 32, 64}  # one runs as two
    small = ju.question_mlp(hidden=(2,))
    jac = ju.compiled_jacobian(small, jit_compile=True, block_size=4)
    for n in [1, 3, 6, 9]:
        jac(ju.regression_data(n)[0])
    assert jac.compiled_shapes == xla_shapes([1, 3, 6, 9], 4)


def test_03_2_shapes_xla_compiles():
    right = [2, 4, 8, 16, 32, 64]
    context = {"sizes": SIZES, "block_size": 64}
    assert check.verdict("03-2", right, **context).correct
    assert check.verdict("03-2", tuple(reversed(right)), **context).correct
    message = hint("03-2", right + [128, 256], **context)
    assert "larger than block_size" in message and "[2," not in message
    assert "padded too, to two" in hint("03-2", [1, *right], **context)
    assert "blocks" in hint("03-2", [64, 128, 192, 200], **context)
    message = hint("03-2", [2, 4, 8, 16, 32, 64, 72, 136, 200], **context)
    assert "block_size" in message
    assert "not such padded sizes" in hint("03-2", [2, 3, 4, 8], **context)
    message = hint("03-2", [8, 16, 32, 64], **context)
    assert "2 shape(s) are missing" in message and "smallest" in message
    assert "whole numbers" in hint("03-2", [1.5, 2], **context)
    assert not check.verdict("03-2", None, **context).answered


def test_03_1_traces_with_reduce_retracing():
    sizes = [3, 5, 8, 13, 21]
    assert check.verdict("03-1", (2, None), sizes=sizes).correct
    assert check.verdict("03-1", [2, None], sizes=[2, 3]).correct
    assert check.verdict("03-1", (1, 4), sizes=[4, 4]).correct
    message = hint("03-1", (5, None), sizes=sizes)
    assert "one trace per batch size" in message and "2" not in message
    assert "exact shape" in hint("03-1", (1, None), sizes=sizes)
    assert "too large" in hint("03-1", (4, None), sizes=sizes)
    assert "two things" in hint("03-1", 2, sizes=sizes)  # the count alone
    message = hint("03-1", (2, 21), sizes=sizes)  # the right count, unexplained
    assert "could not serve" in message and "None" not in message
    assert "one number" in hint("03-1", ([3, 4], None), sizes=sizes)
