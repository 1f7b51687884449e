"""The simulated engine: a stand-in for `vllm serve` where there is no accelerator.

Kept to stdlib + aiohttp: it is deployed to hosts on its own (see fleet.host.sync.code_files).
"""
