"""The probes: scripts that read a host's state and print one JSON object, sent on standard input by the
control node (fleet.transport.hostcode.probe bundles each with the host agent modules it imports), because they run
where nothing may be deployed yet. Standard library only, Python 3.7+, no side effects but the ones each
names.

- `state`: the deployment's processes, ports, /health and each instance's state (instances.classify),
  the proxy, nginx, the keeper, file hashes; read by deploy, status, restart and the swaps.
- `holders`: who holds the accelerators' device files, and the kill of the user's own holders.
- `doctor`: what `inv doctor` checks (engine, model, ports, smi, tools, disk, memory).
- `deploy`: deploy's first read in one run: the preflight's script, the doctor's and the state's answers.
- `cpu_mem`: the memory of each `cpu` instance from /proc, printed as `rocm-smi --json` would.
"""
