"""`inv ...` from a checkout: the same tasks as the `vllm-fleet` console script (fleet/cli.py holds them).

    inv deploy --host k100-01        # = vllm-fleet deploy --host k100-01
"""
from fleet.cli import guard_inv, ns

guard_inv()      # invoke's parse errors in the toolkit's form: `error: ...`, the closest name, exit 2

__all__ = ["ns"]
