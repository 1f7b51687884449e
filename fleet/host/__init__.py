"""Each part of a deployment on a host, seen from the control node: the files put into deploy_dir, the run
lock, the keeper, the boot hook, keepalived, the cards (smi) and their release at a stop, and what a step
needs there before it acts."""
