"""vllm-fleet's control plane: inventory, rendering, transport, and one module per command.

Kept free of imports: `fleet.sim` (the simulated engine) is deployed to hosts on its own, under
`lib/fleet/`, and must not pull in the rest.
"""
