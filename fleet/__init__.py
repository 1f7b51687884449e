"""vllm-fleet: the control plane (inventory, rendering, transport, lifecycle).

Kept free of imports: `fleet.sim` is deployed to hosts on its own and must not pull in the rest.
"""
