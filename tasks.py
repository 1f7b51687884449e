"""`inv ...` from a checkout: the same tasks as the `vllm-fleet` console script (fleet/cli.py holds them).

    inv deploy --host k100-01        # = vllm-fleet deploy --host k100-01
"""
from fleet.cli import ns

__all__ = ["ns"]
