"""The routing kernels' logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1, in a
process of its own: the interpreter is chosen when the kernels are defined): every method,
grouped or not, on both paths (one program per token block, or the logits grid), picks the
reference's experts with its weights. The GPU tests check them compiled."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from pegainfer.core.moe import kernels
    from pegainfer.core.moe.routing import Routing, route

    torch.manual_seed(0)
    cases = [(64, 6, 64, 9, "softmax", "greedy", 1, 1, False),
             (48, 8, 64, 7, "sigmoid", "noaux_tc", 1, 1, True),
             (64, 8, 64, 17, "sigmoid", "noaux_tc", 8, 3, True),
             (40, 4, 32, 18, "softmax", "group_limited_greedy", 8, 3, False)]
    for limit in (1 << 62, 0):
        kernels._ONE_PROGRAM_ROUTER = limit
        for experts, k, hidden, tokens, scoring, method, groups, kept, normalize in cases:
            x, gate = torch.randn(tokens, hidden), torch.randn(experts, hidden) * 0.2
            bias = torch.randn(experts) * 0.1 if scoring == "sigmoid" else None
            routing = Routing(experts, k, scoring, method, groups, kept, normalize, 2.5)
            ref_w, ref_e = route(x, gate, routing, bias)
            ours_w, ours_e = kernels.route(x, gate, routing, bias)
            assert torch.equal(ours_e.long().sort(1).values, ref_e.sort(1).values), routing
            torch.testing.assert_close(ours_w.sort(1).values, ref_w.sort(1).values)
    print("routed", 2 * len(cases))
""")


def test_routing_kernels_pick_the_references_experts_interpreted():
    assert "routed 8" in run_interpreted(SCRIPT)
